"""Checking a batch and cutting it into microbatches along dim 0."""

from __future__ import annotations

import inspect
import zlib
from collections.abc import Mapping

import torch
import torch.distributed as dist
from torch.distributed import ProcessGroup

from ..config.options import IGNORE_INDEX, LossKind
from ..config.sequence import check_sequence_length
from .loss import check_builtin_loss


def check_batch(batch: Mapping[str, torch.Tensor], *, microbatches: int, required: tuple[str, ...] = ()) -> int:
    """Return the batch size after checking that the batch is a dict of tensors of one size along
    dim 0, at least ``microbatches`` rows (every microbatch gets one), holding every key in ``required``."""
    if not isinstance(batch, Mapping) or not batch:
        raise ValueError(f"batch must be a non-empty dict of tensors, got {type(batch).__name__}")
    not_tensors = sorted(k for k, v in batch.items() if not isinstance(v, torch.Tensor))
    if not_tensors:
        raise ValueError(f"batch values must be tensors; {not_tensors} are not")
    missing = [k for k in required if k not in batch]
    if missing:
        fix = (": the built-in loss needs them; for a causal LM pass labels=input_ids (qn_hf shifts them, as HF "
               "does; -100 marks positions to ignore), or pass loss_fn=(outputs, batch) -> loss") if "labels" in missing else ""
        raise ValueError(f"batch lacks {missing} (has {sorted(batch)}){fix}")
    sizes = {k: v.shape[0] if v.dim() else None for k, v in batch.items()}
    if len(set(sizes.values())) != 1 or None in sizes.values():
        raise ValueError(f"batch tensors must share their size along dim 0, got {sizes}")
    size = next(iter(sizes.values()))
    if size == 0:
        raise ValueError(f"the batch is empty (0 rows: {sorted(batch)} have shape[0] == 0); give every step at least "
                         f"one row per microbatch ({microbatches} here)")
    if size < microbatches:
        raise ValueError(
            f"microbatches={microbatches} is more than the local batch size {size}: a microbatch would be empty; "
            f"use microbatches <= {size} or a larger batch"
        )
    return size


def check_step_batch(batch: Mapping[str, torch.Tensor], *, model: torch.nn.Module, loss: LossKind | None,
                     builtin: bool, microbatches: int, cp: int, cp_keys: tuple[str, ...], split: tuple[int, str],
                     config, num_items: object = None) -> int:
    """Every host-side check of one step's batch (and of train_step's ``num_items_in_batch``), in the
    order a user would fix them; returns the batch size. Raised on one rank only: ``agreement.py``
    makes it every rank's."""
    if builtin and loss is None:
        raise ValueError(f"{type(model).__name__} has no built-in loss (a base model); pass "
                         f"loss_fn=(outputs, batch) -> loss")
    size = check_batch(batch, microbatches=microbatches, required=("labels",) if builtin else ())
    if cp > 1:
        unknown = sorted(set(batch) - set(cp_keys))
        if unknown:
            raise ValueError(f"cp={cp}: batch keys {unknown} cannot be cut along the sequence; use only {cp_keys}")
    check_model_inputs(batch, model=model, loss=loss if builtin else None, sequence_split=split)
    if builtin:
        check_builtin_loss(loss, config)
    if num_items is not None:  # a tensor's value may sit on the device: only its form is checked
        if isinstance(num_items, torch.Tensor):
            if num_items.numel() != 1 or num_items.is_complex() or num_items.dtype == torch.bool:
                raise ValueError(f"num_items_in_batch must be one real number, got a tensor of shape "
                                 f"{tuple(num_items.shape)} and dtype {num_items.dtype}; pass pm.count_items(batches)")
        elif isinstance(num_items, bool) or not isinstance(num_items, (int, float)) or not num_items > 0:
            raise ValueError(f"num_items_in_batch={num_items!r} must be a positive count (targets, or rows with a "
                             f"loss_fn) of every batch of the optimizer step; pass pm.count_items(batches)")
    return size


def dp_rows(batch: Mapping[str, torch.Tensor], *, dp: int, dp_rank: int, multiple: int) -> dict[str, torch.Tensor]:
    """dp rank ``dp_rank``'s contiguous rows of the global ``batch``, after padding it to a multiple of
    ``dp * multiple`` rows (every microbatch of every replica gets a row) with copies of row 0 whose labels are all
    -100: they add no target, so the loss and gradients are those of the real rows."""
    rows = next(iter(batch.values())).shape[0]
    target = -(-rows // (dp * multiple)) * dp * multiple
    if target != rows:
        if "labels" not in batch:
            raise ValueError(f"a batch of {rows} rows must be padded to {target} (dp={dp} x {multiple} microbatches) "
                             f"with rows that carry no loss, which needs a 'labels' key; make the dataset a multiple "
                             f"of the global batch or set dataloader_drop_last=True")
        pad = {k: v[:1].expand(target - rows, *v.shape[1:]) for k, v in batch.items()}
        pad["labels"] = torch.full_like(pad["labels"], IGNORE_INDEX)
        if "shift_labels" in pad:
            pad["shift_labels"] = torch.full_like(pad["shift_labels"], IGNORE_INDEX)
        batch = {k: torch.cat([v, pad[k]]) for k, v in batch.items()}
    per = target // dp
    return {k: v[dp_rank * per:(dp_rank + 1) * per] for k, v in batch.items()}


def microbatch_rows(size: int, *, microbatches: int) -> list[int]:
    """Rows of each microbatch of a local batch of ``size`` (``torch.tensor_split``: the first
    ``size % microbatches`` take one row more). Every pipeline stage computes this from the batch it
    was given, so receive buffers are sized without sending a shape per microbatch."""
    return [size // microbatches + (1 if i < size % microbatches else 0) for i in range(microbatches)]


def split_microbatches(batch: Mapping[str, torch.Tensor], *, microbatches: int) -> list[dict[str, torch.Tensor]]:
    """``torch.tensor_split`` of every tensor along dim 0 (the sizes of ``microbatch_rows``)."""
    check_batch(batch, microbatches=microbatches)
    parts = {k: torch.tensor_split(v, microbatches) for k, v in batch.items()}
    return [{k: p[i] for k, p in parts.items()} for i in range(microbatches)]


# Keys Hugging Face models take as indices: integers, never floats (labels only for the built-in
# losses: a user's loss_fn may take float or soft labels; masks may be float or 4-D).
INTEGER_KEYS = ("input_ids", "token_type_ids", "position_ids")


def check_model_inputs(batch: Mapping[str, torch.Tensor], *, model: torch.nn.Module, loss: LossKind | str | None,
                       sequence_split: tuple[int, str] = (1, "")) -> None:
    """Check a batch against the model before anything is sent: the main input is there, keys are
    forward arguments (when the forward names them all), index tensors are integers and images
    floating point, and shapes fit the config (sequence length within a learned position table,
    image size and channels, label shapes for the built-in ``loss``; None: a user's loss_fn), and a
    sequence length that ``sequence_split`` (a multiple, and why) divides.
    Without this, each mistake surfaces as a shape error deep inside a forward on some ranks."""
    loss = None if loss is None else LossKind(loss)
    main = getattr(model, "main_input_name", "input_ids")
    if main not in batch and "inputs_embeds" not in batch:
        raise ValueError(f"batch lacks {main!r}, the input of {type(model).__name__} (has {sorted(batch)})")
    params = inspect.signature(model.forward).parameters
    if not any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values()):
        unknown = sorted(set(batch) - set(params))
        if unknown:
            raise ValueError(f"batch keys {unknown} are not arguments of {type(model).__name__}.forward")
    for key in INTEGER_KEYS + (("labels",) if loss else ()):
        if key in batch and (batch[key].is_floating_point() or batch[key].is_complex()):
            raise ValueError(f"batch[{key!r}] has dtype {batch[key].dtype}; it holds indices or a mask and must be "
                             "an integer tensor (e.g. .long())")
    config = model.config
    if "pixel_values" in batch:
        pixels = batch["pixel_values"]
        if not pixels.is_floating_point():
            raise ValueError(f"batch['pixel_values'] has dtype {pixels.dtype}; images must be floating point (e.g. .float())")
        size, channels = getattr(config, "image_size", None), getattr(config, "num_channels", None)
        if pixels.dim() != 4 or (channels and pixels.shape[1] != channels) or (size and tuple(pixels.shape[2:]) != (size, size)):
            raise ValueError(f"batch['pixel_values'] has shape {tuple(pixels.shape)}; the model takes "
                             f"(batch, {channels}, {size}, {size})")
    if "input_ids" in batch:
        ids = batch["input_ids"]
        if ids.dim() != 2:
            raise ValueError(f"batch['input_ids'] has shape {tuple(ids.shape)}; it must be (batch, sequence)")
        check_sequence_length(ids.shape[1], sequence_split)
        positions = getattr(config, "n_positions", None)  # a learned position table (GPT-2); RoPE models have none
        if positions and ids.shape[1] > positions:
            raise ValueError(f"sequence length {ids.shape[1]} exceeds the model's {positions} positions; cut the sequences")
        for key in ("attention_mask", "token_type_ids", "position_ids"):
            if key in batch and batch[key].dim() == 2 and batch[key].shape != ids.shape:
                raise ValueError(f"batch[{key!r}] has shape {tuple(batch[key].shape)}, input_ids {tuple(ids.shape)}")
    if "labels" in batch and loss is LossKind.CAUSAL_LM and "input_ids" in batch and batch["labels"].shape != batch["input_ids"].shape:
        raise ValueError(f"batch['labels'] has shape {tuple(batch['labels'].shape)}; for a causal LM it must match "
                         f"input_ids {tuple(batch['input_ids'].shape)} (the model shifts them)")
    if "labels" in batch and loss is LossKind.CLASSIFICATION and batch["labels"].dim() != 1:
        raise ValueError(f"batch['labels'] has shape {tuple(batch['labels'].shape)}; class labels are one per example")
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    vocab = getattr(text, "vocab_size", None)
    if vocab and "input_ids" in batch:
        check_index_range("input_ids", batch["input_ids"], size=vocab, what="the vocabulary")
    if "labels" in batch and loss is LossKind.CAUSAL_LM and vocab:
        check_index_range("labels", batch["labels"], size=vocab, what="the vocabulary", ignored=IGNORE_INDEX)
    if "labels" in batch and loss is LossKind.CLASSIFICATION and getattr(config, "num_labels", None):
        check_index_range("labels", batch["labels"], size=config.num_labels, what="the classes", ignored=IGNORE_INDEX)


def check_index_range(key: str, values: torch.Tensor, *, size: int, what: str, ignored: int | None = None) -> None:
    """Every index in ``values`` lies in [0, size) (or is ``ignored``), as the plain model's
    embedding and cross-entropy demand: a vocab-parallel layer would instead mask an index outside
    every rank's range and train on zeros. A CPU batch is checked here (``IndexError``, as the plain
    model raises); a batch already on an accelerator by a device-side assertion, as the plain model's
    kernels do, so the host never waits for the device."""
    if values.device.type == "meta" or values.numel() == 0:
        return
    if values.device.type != "cpu":
        inside = (values >= 0) & (values < size)
        if ignored is not None:
            inside |= values == ignored
        torch._assert_async(inside.all(), f"batch[{key!r}] holds an index outside {what} [0, {size})")
        return
    host = values.detach().numpy()  # the caller's host tensor, read where it is (no device involved)
    inside = (host >= 0) & (host < size)
    if ignored is not None:
        inside |= host == ignored
    if not inside.all():
        bad = int(host[~inside][0])
        raise IndexError(f"batch[{key!r}] holds {bad}, outside {what} [0, {size})"
                         + (f" (and is not the ignored {ignored})" if ignored is not None else "")
                         + "; the plain model raises on it too")


# Words that name a batch's layout in its signature (sorted keys, shapes, dtypes); compared, never read back.
_SIGNATURE = 4  # floats per rank: layout digest, rows, integer contents, floating contents


def batch_signature(batch: Mapping[str, torch.Tensor], *, device: torch.device) -> torch.Tensor:
    """``[_SIGNATURE]`` float64 on ``device``: what two ranks given the same batch agree on exactly:
    a digest of its keys, shapes and dtypes, its rows, and position-weighted sums of its contents
    (integers wrap in int64; the same values summed in the same order give the same float64)."""
    layout = repr(sorted((k, tuple(v.shape), str(v.dtype)) for k, v in batch.items()))
    ints = torch.zeros((), dtype=torch.int64, device=device)
    floats = torch.zeros((), dtype=torch.float64, device=device)
    for _, v in sorted(batch.items()):
        flat = v.reshape(-1).to(device)
        weights = torch.arange(flat.numel(), device=device) % 65521 + 1
        if flat.is_floating_point():
            floats += (flat.double() * weights).sum()
        else:
            ints += (flat.long() * weights).sum()
    head = torch.tensor([float(zlib.crc32(layout.encode())), float(next(iter(batch.values())).shape[0])],
                        dtype=torch.float64, device=device)
    return torch.cat([head, (ints % 2**52).double().reshape(1), floats.reshape(1)])


def check_same_batch(signature: torch.Tensor, *, replica: int, replicas: int, group: ProcessGroup | None = None) -> None:
    """Every rank of a data-parallel replica was given the same batch (tp ranks, pipeline stages and
    cp ranks take one dict per replica): one all-reduce over ``group`` (default: the world) of every
    replica's signature range, read on the host once, so every rank of the world raises together.
    Meant for the first step (and every step when asked): ranks given different batches would train
    silently wrong, or, with different sequence lengths, abort inside a collective."""
    rows = torch.full((replicas, 2, signature.numel()), -float("inf"), dtype=torch.float64, device=signature.device)
    rows[replica, 0], rows[replica, 1] = signature, -signature  # max and -min over the replica's ranks
    dist.all_reduce(rows, op=dist.ReduceOp.MAX, group=group)
    differ = (rows[:, 0] != -rows[:, 1]).any(dim=1).tolist()
    if any(differ):
        which = [r for r, d in enumerate(differ) if d]
        raise ValueError(f"the ranks of data-parallel replica(s) {which} were given different batches: every tp rank, "
                         f"pipeline stage and cp rank of a replica must get the same dict (same keys, shapes and "
                         f"contents; slice a global batch by pm.coords['dp'] only)")
