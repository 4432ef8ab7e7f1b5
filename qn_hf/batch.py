"""Checking a batch and cutting it into microbatches along dim 0."""

from __future__ import annotations

from collections.abc import Mapping

import torch


def check_batch(batch: Mapping[str, torch.Tensor], *, microbatches: int, required: tuple[str, ...] = ()) -> int:
    """Return the batch size after checking that the batch is a dict of tensors of one size along
    dim 0 that ``microbatches`` divides, holding every key in ``required``."""
    if not isinstance(batch, Mapping) or not batch:
        raise ValueError(f"batch must be a non-empty dict of tensors, got {type(batch).__name__}")
    not_tensors = sorted(k for k, v in batch.items() if not isinstance(v, torch.Tensor))
    if not_tensors:
        raise ValueError(f"batch values must be tensors; {not_tensors} are not")
    missing = [k for k in required if k not in batch]
    if missing:
        raise ValueError(f"batch lacks {missing} (has {sorted(batch)})")
    sizes = {k: v.shape[0] if v.dim() else None for k, v in batch.items()}
    if len(set(sizes.values())) != 1 or None in sizes.values():
        raise ValueError(f"batch tensors must share their size along dim 0, got {sizes}")
    size = next(iter(sizes.values()))
    if size % microbatches:
        raise ValueError(
            f"microbatches={microbatches} does not divide the local batch size {size}; "
            f"use a batch size that is a multiple of {microbatches}"
        )
    return size


def split_microbatches(batch: Mapping[str, torch.Tensor], *, microbatches: int) -> list[dict[str, torch.Tensor]]:
    size = check_batch(batch, microbatches=microbatches)
    step = size // microbatches
    return [{k: v[i * step : (i + 1) * step] for k, v in batch.items()} for i in range(microbatches)]
