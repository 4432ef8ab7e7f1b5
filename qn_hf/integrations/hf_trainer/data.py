"""How ``qn_hf.Trainer`` feeds the mesh: every rank iterates the loader one process would (same sampler, same seed,
batches of ``per_device_train_batch_size x dp``), merges the accumulation batches of one optimizer step into that
step's global batch and keeps its dp rank's contiguous rows. No data moves between ranks.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from functools import partial

import torch
from accelerate.data_loader import prepare_data_loader
from torch.utils.data import DataLoader, IterableDataset, RandomSampler, SequentialSampler
from transformers.trainer_utils import seed_worker

from ...config.options import IGNORE_INDEX
from ...step.loss import count_targets
from ...step.packed import batch_rows, packed_keys

# The value a right-padded position takes per key; any other key that differs in length cannot be merged.
PAD_VALUES = {"labels": IGNORE_INDEX, "shift_labels": IGNORE_INDEX, "attention_mask": 0, "input_ids": 0,
              "token_type_ids": 0, "position_ids": 0, "mm_token_type_ids": 0}  # (a VLM processor's: 0 is text)


def one_process_loader(dataset, *, args, batch_size: int, collate_fn: Callable, training: bool) -> DataLoader:
    """The loader ``transformers.Trainer`` builds in one process with this batch size, on every rank.

    ``accelerate.prepare_data_loader`` with one process swaps the ``RandomSampler`` for its seeded sampler (seed:
    ``data_seed``, else the run's seed, which ``Trainer`` has just set) exactly as the one-process Trainer's
    ``accelerator.prepare`` does; batches stay on the CPU (``train_step`` moves them) and nothing is dispatched or
    synchronized between ranks."""
    sampler = None
    if not isinstance(dataset, IterableDataset):
        shuffle = training and args.train_sampling_strategy == "random"
        sampler = RandomSampler(dataset) if shuffle else SequentialSampler(dataset)
    loader = DataLoader(
        dataset, batch_size=batch_size, sampler=sampler, collate_fn=collate_fn, drop_last=args.dataloader_drop_last,
        num_workers=args.dataloader_num_workers, pin_memory=args.dataloader_pin_memory,
        persistent_workers=args.dataloader_persistent_workers, prefetch_factor=args.dataloader_prefetch_factor,
        worker_init_fn=partial(seed_worker, num_workers=args.dataloader_num_workers, rank=0) if training else None,
    )
    seed = args.data_seed if args.data_seed is not None else args.seed
    return prepare_data_loader(loader, num_processes=1, process_index=0, put_on_device=False, dispatch_batches=False,
                               use_seedable_sampler=args.accelerator_config.use_seedable_sampler, data_seed=seed)


def merge_batches(batches: Sequence[Mapping]) -> dict[str, torch.Tensor]:
    """The accumulation batches of one step as one batch (rows in order), right-padding sequence keys to the
    longest (labels -100, masks 0: a causal model's earlier positions never see them, and they carry no loss).
    A packed input (a VLM's images, step/packed.py) may be in some of them only (a batch of text alone): its
    items, back to back, are those of the batches that have it, in their order, as its rows' tokens say."""
    not_tensors = sorted(k for b in batches for k, v in b.items() if not isinstance(v, torch.Tensor))
    if not_tensors:
        raise ValueError(f"batch values {not_tensors} are not tensors; qn_hf.Trainer cuts batches by rows, so the "
                         f"collator must return tensors only (for TRL, padding_free=False)")
    packed = set().union(*(packed_keys(b) for b in batches))
    keys = list(dict.fromkeys(k for b in batches for k in b))  # the first batch's order, then what others add
    if any({k for k in b if k not in packed} != {k for k in keys if k not in packed} for b in batches):
        raise ValueError(f"accumulation batches have different keys: {[sorted(b) for b in batches]}")
    merged = {}
    for key in keys:
        parts = [b[key] for b in batches if key in b]
        if parts[0].dim() >= 2 and len({p.shape[1] for p in parts}) > 1:
            if key not in PAD_VALUES:
                raise ValueError(f"batch[{key!r}] differs in length between accumulation batches "
                                 f"({[tuple(p.shape) for p in parts]}) and qn_hf does not know its padding value")
            longest = max(p.shape[1] for p in parts)
            parts = [torch.nn.functional.pad(p, (0, longest - p.shape[1]), value=PAD_VALUES[key]) for p in parts]
        merged[key] = torch.cat(parts) if len(parts) > 1 else parts[0]
    return merged


def rows_of(batch: Mapping[str, torch.Tensor]) -> int:
    return batch_rows(batch)  # not a packed input's items (step/packed.py)


def count_items(batches: Sequence[Mapping], *, shifts_labels: bool) -> torch.Tensor | None:
    """``num_items_in_batch`` as one process counts it (targets of every accumulation batch: labels after the
    shift for a causal LM), here without any gather since every rank holds the whole global batch."""
    if not batches or "labels" not in batches[0]:
        return None
    return torch.tensor(sum(count_targets(b["shift_labels"], causal=False) if "shift_labels" in b
                            else count_targets(b["labels"], causal=shifts_labels) for b in batches))


def user_loss(func: Callable, *, batch: Mapping[str, torch.Tensor], num_items: torch.Tensor | None, dp: int,
              microbatches: int) -> Callable:
    """``compute_loss_func`` as ``pm.train_step``'s ``loss_fn``. train_step weighs a loss_fn by its microbatch's
    share of the global rows, which this undoes, so the step's loss is the sum of
    ``func(outputs, labels, num_items_in_batch)`` over the microbatches, as one process sums it over the
    accumulation batches."""
    padded_rows = -(-rows_of(batch) // (dp * microbatches)) * dp * microbatches  # dp_rows' padded global batch

    def loss_fn(outputs, mb: Mapping[str, torch.Tensor]) -> torch.Tensor:
        return func(outputs, mb.get("labels"), num_items_in_batch=num_items) * (padded_rows / rows_of(mb))

    return loss_fn
