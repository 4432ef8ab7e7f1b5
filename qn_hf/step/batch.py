"""Checking a batch and cutting it into microbatches along dim 0."""

from __future__ import annotations

import inspect
import zlib
from collections.abc import Mapping

import torch
import torch.distributed as dist
from torch.distributed import ProcessGroup

from ..config.options import IGNORE_INDEX, LossKind, ProblemType
from ..config.sequence import check_sequence_length
from ..policies.packed_inputs import item_towers
from ..policies.positions import PositionLimits
from ..policies.task import SPAN_KEYS, TaskHead, main_input_name
from .loss import problem_type
from .packed import RowLayout, batch_rows, packed_keys, placed_by_tokens, row_layout


def check_batch(batch: Mapping[str, torch.Tensor], *, microbatches: int, required: tuple[str, ...] = (),
                config: object | None = None) -> int:
    """Return the batch size after checking that the batch is a dict of tensors of one size along
    dim 0, at least ``microbatches`` rows (every microbatch gets one), holding every key in ``required``;
    a packed input (``packed.py``: Qwen2-VL's images) lies along its rows as the model's ``config`` says."""
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
    packed = packed_keys(batch)
    sizes = {k: v.shape[0] if v.dim() else None for k, v in batch.items() if k not in packed}
    if len(set(sizes.values())) != 1 or None in sizes.values():
        raise ValueError(f"batch tensors must share their size along dim 0, got {sizes}")
    size = next(iter(sizes.values()))
    if packed:
        row_layout(batch, config)  # raises where its items cannot be told apart by rows
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
                     config, num_items: object = None, head: TaskHead | None = None, dp: int = 1,
                     loss_keys: tuple[str, ...] = (), positions: PositionLimits | None = None,
                     decoder_stages: int = 0, dp_shard: int = 1) -> int:
    """Every host-side check of one step's batch (and of train_step's ``num_items_in_batch``), in the
    order a user would fix them; returns the batch size. Raised on one rank only: ``agreement.py``
    makes it every rank's. ``decoder_stages``: how many pipeline chunks run an encoder-decoder's decoder."""
    if builtin and loss is None:
        raise ValueError(f"{type(model).__name__} has no built-in loss (a base model, or a head whose forward "
                         f"computes none); pass loss_fn=(outputs, batch) -> loss")
    if builtin and loss is LossKind.OWN and dp * cp * microbatches > 1:
        raise ValueError(f"{type(model).__name__} computes a loss qn_hf does not split (not one of a causal or masked "
                         f"LM's, a classifier's, a token classifier's or a span head's), so train_step trains its "
                         f"own outputs.loss, which needs one forward over the whole batch, not dp={dp} x cp={cp} x "
                         f"microbatches={microbatches}; use dp=1, cp=1 and microbatches=1, or pass "
                         f"loss_fn=(outputs, batch) -> the mean loss of a microbatch's rows")
    required = (head.label_keys if head is not None else ("labels",)) if builtin else ()
    size = check_batch(batch, microbatches=microbatches, required=required, config=config)
    from_labels = head is not None and head.decoder_from_labels and "labels" in batch
    if decoder_stages > 1 and not from_labels and not {"decoder_input_ids", "decoder_inputs_embeds"} & set(batch):
        # a decoder chunk short of the last runs the decoder stack itself, which needs its inputs; the task
        # model's forward makes them from input_ids (BART's classifier shifts them right) on the last only
        raise ValueError(f"{type(model).__name__}'s decoder runs on {decoder_stages} pipeline stages here and the batch "
                         f"carries no decoder_input_ids, which its forward would make from input_ids; pass "
                         f"decoder_input_ids in the batch, or give the decoder one stage (pp=2)")
    packed = placed_by_tokens(batch)
    if packed and dp_shard > 1 and not item_towers(model):
        # FSDP2 gathers a group's weights at each call of its module: a rank whose rows hold no image (or no video)
        # runs the vision tower fewer times than another, and the ranks' collectives no longer pair up; the towers
        # item_towers finds sit in the root group instead (data_parallel/sharded.py), but none is found here
        raise ValueError(f"dp_shard={dp_shard}: the batch packs {packed}, whose items the ranks' rows hold in different "
                         f"numbers, and {type(model).__name__} has no module whose forward takes them as a tower does "
                         f"(grid_thw beside hidden_states or pixel_values), which qn_hf would keep in FSDP's root group; "
                         f"use dp_shard=1 (dp, ZeRO-1, tp and microbatches take packed inputs)")
    if cp > 1:
        unknown = sorted(set(batch) - set(cp_keys))
        if unknown:
            raise ValueError(f"cp={cp}: batch keys {unknown} cannot be cut along the sequence; use only {cp_keys}")
    check_model_inputs({k: v for k, v in batch.items() if k not in loss_keys}, model=model,
                       loss=loss if builtin else None, sequence_split=split, head=head, positions=positions)
    terms = 2 if builtin and loss is LossKind.SPANS else 1
    if num_items is not None:  # a tensor's value may sit on the device: only its form is checked
        if isinstance(num_items, torch.Tensor):
            if num_items.numel() != terms or num_items.is_complex() or num_items.dtype == torch.bool:
                what = "one real number" if terms == 1 else f"{terms} real numbers (the starts', the ends')"
                raise ValueError(f"num_items_in_batch must be {what}, got a tensor of shape "
                                 f"{tuple(num_items.shape)} and dtype {num_items.dtype}; pass pm.count_items(batches)")
        elif terms > 1 or isinstance(num_items, bool) or not isinstance(num_items, (int, float)) or not num_items > 0:
            raise ValueError(f"num_items_in_batch={num_items!r} must be a positive count (targets, or rows with a "
                             f"loss_fn) of every batch of the optimizer step; pass pm.count_items(batches)")
    return size


def dp_rows(batch: Mapping[str, torch.Tensor], *, dp: int, dp_rank: int, multiple: int,
            config: object | None = None) -> dict[str, torch.Tensor]:
    """dp rank ``dp_rank``'s contiguous rows of the global ``batch``, after padding it to a multiple of
    ``dp * multiple`` rows (every microbatch of every replica gets a row) with copies of row 0 whose labels are all
    -100: they add no target, so the loss and gradients are those of the real rows. A packed input's items go
    with their rows (``packed.py``, as the model's ``config`` says)."""
    layout = row_layout(batch, config)
    rows = layout.rows
    target = -(-rows // (dp * multiple)) * dp * multiple
    if target != rows:
        fix = "make the dataset a multiple of the global batch or set dataloader_drop_last=True"
        keys = [k for k in ("labels", "shift_labels", *SPAN_KEYS) if k in batch]
        if not keys:
            raise ValueError(f"a batch of {rows} rows must be padded to {target} (dp={dp} x {multiple} microbatches) "
                             f"with rows that carry no loss, which needs a 'labels' key; {fix}")
        if any(batch[k].is_floating_point() for k in keys):
            raise ValueError(f"a batch of {rows} rows must be padded to {target} (dp={dp} x {multiple} microbatches) "
                             f"with rows that carry no loss, but its labels are real values (regression or "
                             f"multi-label), which have no value to ignore; {fix}")
        pad = {k: v[:1].expand(target - rows, *v.shape[1:]) for k, v in batch.items() if k not in layout.bounds}
        for key in keys:  # labels the loss ignores; a span past every position (the span loss ignores it)
            pad[key] = torch.full_like(pad[key], IGNORE_INDEX if key not in SPAN_KEYS else torch.iinfo(pad[key].dtype).max)
        batch = layout.pad(batch, pad)
        layout = row_layout(batch, config)
    per = target // dp
    return layout.take(batch, dp_rank * per, (dp_rank + 1) * per)


def microbatch_rows(size: int, *, microbatches: int) -> list[int]:
    """Rows of each microbatch of a local batch of ``size`` (``torch.tensor_split``: the first
    ``size % microbatches`` take one row more). Every pipeline stage computes this from the batch it
    was given, so receive buffers are sized without sending a shape per microbatch."""
    return [size // microbatches + (1 if i < size % microbatches else 0) for i in range(microbatches)]


def split_microbatches(batch: Mapping[str, torch.Tensor], *, microbatches: int,
                       layout: RowLayout | None = None) -> list[dict[str, torch.Tensor]]:
    """``torch.tensor_split`` of every tensor along dim 0 (the sizes of ``microbatch_rows``); a packed input's
    items with their rows, as ``layout`` (``packed.row_layout`` of the batch) says."""
    size = check_batch(batch, microbatches=microbatches) if layout is None else layout.rows
    layout = layout or RowLayout(rows=size)
    ends = [0]
    for rows in microbatch_rows(size, microbatches=microbatches):
        ends.append(ends[-1] + rows)
    return [layout.take(batch, start, stop) for start, stop in zip(ends, ends[1:])]


# Keys Hugging Face models take as indices: integers, never floats (labels only for the built-in
# losses that take indices: a user's loss_fn may take float or soft labels; masks may be float or 4-D).
INTEGER_KEYS = ("input_ids", "token_type_ids", "position_ids")
# Keys a step adds to a microbatch for the loss, never given to the forward (context parallelism's).
INTERNAL_KEYS = ("targets", "local_valid")


def check_model_inputs(batch: Mapping[str, torch.Tensor], *, model: torch.nn.Module, loss: LossKind | str | None,
                       sequence_split: tuple[int, str] = (1, ""), head: TaskHead | None = None,
                       positions: PositionLimits | None = None) -> None:
    """Check a batch against the model before anything is sent: the main input is there, keys are
    forward arguments (when the forward names them all), index tensors are integers and images
    floating point, and shapes fit the config (sequence lengths within the ``positions`` tables,
    image size and channels, label shapes and ranges for the built-in ``loss`` and its ``head``; None:
    a user's loss_fn), and a sequence length that ``sequence_split`` (a multiple, and why) divides.
    Without this, each mistake surfaces as a shape error deep inside a forward on some ranks."""
    loss = None if loss is None else LossKind(loss)
    main = main_input_name(model)
    if main not in batch and "inputs_embeds" not in batch:
        raise ValueError(f"batch lacks {main!r}, the input of {type(model).__name__} (has {sorted(batch)})")
    params = inspect.signature(model.forward).parameters
    if not any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values()):
        unknown = sorted(set(batch) - set(params) - set(INTERNAL_KEYS))
        if unknown:
            raise ValueError(f"batch keys {unknown} are not arguments of {type(model).__name__}.forward")
    config = model.config
    problem = (problem_type(config, batch["labels"], problem_types=head is None or head.problem_types,
                            own=head is not None and head.own_problem_types)
               if loss is LossKind.CLASSIFICATION and "labels" in batch else None)
    indices = INTEGER_KEYS + (("labels",) if loss is not None and (loss.per_position or problem is ProblemType.SINGLE_LABEL)
                              else ()) + (SPAN_KEYS if loss is LossKind.SPANS else ())
    for key in indices:
        if key in batch and (batch[key].is_floating_point() or batch[key].is_complex()):
            raise ValueError(f"batch[{key!r}] has dtype {batch[key].dtype}; it holds indices or a mask and must be "
                             "an integer tensor (e.g. .long())")
        # the loss's targets: torch's cross entropy takes int64 class indices only (int32 ends in its raw error)
        if key in batch and key in ("labels", *SPAN_KEYS) and batch[key].dtype != torch.long:
            raise ValueError(f"batch[{key!r}] has dtype {batch[key].dtype}; the loss takes int64 class indices: pass "
                             f"batch[{key!r}].long()")
    if "pixel_values" in batch:
        pixels = batch["pixel_values"]
        if not pixels.is_floating_point():
            raise ValueError(f"batch['pixel_values'] has dtype {pixels.dtype}; images must be floating point (e.g. .float())")
        # a vision model's own config fixes its input's size (ViT's position table); a composite config's top-level
        # image_size may be its processor's (MiniCPM-V 4.6's 448 slices, while its tower takes its own 224)
        own = getattr(config, "vision_config", None) is None
        size, channels = getattr(config, "image_size", None) if own else None, getattr(config, "num_channels", None)
        if isinstance(size, (tuple, list)):
            size = tuple(size)
        elif size:
            size = (size, size)
        if pixels.dim() == 4 and ((channels and pixels.shape[1] != channels) or (size and tuple(pixels.shape[2:]) != size)):
            raise ValueError(f"batch['pixel_values'] has shape {tuple(pixels.shape)}; the model takes "
                             f"(batch, {channels}, {', '.join(map(str, size or ('height', 'width')))})")
    encoder_decoder = bool(getattr(config, "is_encoder_decoder", False))
    if "input_ids" in batch:
        ids = batch["input_ids"]
        if ids.dim() != 2 and not (ids.dim() == 3 and type(model).__name__.endswith("ForMultipleChoice")):
            raise ValueError(f"batch['input_ids'] has shape {tuple(ids.shape)}; it must be (batch, sequence)")
        if ids.shape[-1] == 0:  # the forward's reshapes fail on it, deep inside attention
            raise ValueError(f"batch['input_ids'] has shape {tuple(ids.shape)}: sequences of no tokens; give every row "
                             f"at least one token (pad shorter rows, with attention_mask 0)")
        check_sequence_length(ids.shape[-1], sequence_split)
        for key in ("attention_mask", "token_type_ids", "position_ids"):
            if key in batch and batch[key].dim() == ids.dim() and batch[key].shape != ids.shape:
                raise ValueError(f"batch[{key!r}] has shape {tuple(batch[key].shape)}, input_ids {tuple(ids.shape)}")
    limits = positions or PositionLimits()
    decoder_ids = batch.get("decoder_input_ids", batch.get("labels") if encoder_decoder else None)
    for key, values, table in (("input_ids", batch.get("input_ids"), limits.inputs),
                               ("decoder_input_ids" if "decoder_input_ids" in batch else "labels", decoder_ids,
                                limits.decoder)):
        if table is not None and values is not None and values.dim() >= 2 and values.shape[-1] > table.positions:
            raise ValueError(f"sequence length {values.shape[-1]} exceeds the model's {table.positions} positions "
                             f"(batch[{key!r}], {table.name}); cut the sequences")
    labels = batch.get("labels")
    if labels is not None and loss is not None and loss.per_position and "input_ids" in batch and not encoder_decoder \
            and labels.shape != batch["input_ids"].shape:
        what = "a causal LM" if loss.shifted else "a model of one label per position"
        raise ValueError(f"batch['labels'] has shape {tuple(labels.shape)}; for {what} it must match "
                         f"input_ids {tuple(batch['input_ids'].shape)}")
    if labels is not None and problem is ProblemType.SINGLE_LABEL and labels.dim() != 1:
        raise ValueError(f"batch['labels'] has shape {tuple(labels.shape)}; class labels are one per example")
    for key in SPAN_KEYS if loss is LossKind.SPANS else ():
        if key in batch and not (batch[key].dim() == 1 or (batch[key].dim() == 2 and batch[key].shape[1] == 1)):
            raise ValueError(f"batch[{key!r}] has shape {tuple(batch[key].shape)}; it holds one position per example")
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    vocab = getattr(text, "vocab_size", None)
    if vocab and "input_ids" in batch:
        check_index_range("input_ids", batch["input_ids"], size=vocab, what="the vocabulary")
    if labels is not None and loss is not None and loss.per_position:
        classes, what = (vocab, "the vocabulary") if head is None or head.vocab_output or loss.shifted or encoder_decoder \
            else (getattr(config, "num_labels", None), "the classes")
        if classes:
            check_index_range("labels", labels, size=classes, what=what, ignored=IGNORE_INDEX)
    if labels is not None and problem is ProblemType.SINGLE_LABEL and (head is None or head.problem_types) \
            and getattr(config, "num_labels", None):
        if head is not None and head.own_problem_types:  # DeBERTa's rules drop every negative label
            labels = labels.masked_fill(labels < 0, IGNORE_INDEX)
        check_index_range("labels", labels, size=config.num_labels, what="the classes", ignored=IGNORE_INDEX)


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
    head = torch.tensor([float(zlib.crc32(layout.encode())), float(batch_rows(batch))],
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
