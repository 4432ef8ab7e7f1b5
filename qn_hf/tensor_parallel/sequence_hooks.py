"""Sequence parallelism's hooks: the entries' gathers, the whole regions, each chunk's first and last
block, the pipeline wire and the switch that turns it all off for ``generate``. What they implement,
and the checks and the plan change that decide where they go, are in ``sequence_parallel.py``.
"""

from __future__ import annotations

import contextlib
import inspect
from collections.abc import Iterator

import torch
from torch import nn
from torch.distributed import ProcessGroup

from ..comm import (
    all_gather_sequence,
    gather_sequence,
    gather_sequence_into_region,
    group_rank,
    group_size,
    split_sequence,
)
from ..config.sequence import check_sequence_length, sequence_split
from ..pipeline.split import StagePlan
from ..pipeline.stage import Wire
from ..policies.tp_plan import TpPlan
from .hooks import partial_sum_hooks
from .layers import RowParallelLinear
from .sequence_parallel import PER_POSITION_BLOCK_INPUTS, first_argument, with_first


class _Regathered:
    """The gathered input of one entry call, as autograd keeps it: this rank's slice only, gathered
    again when backward first unpacks it and dropped after the last unpack."""

    def __init__(self, local: torch.Tensor, full: torch.Tensor, group: ProcessGroup) -> None:
        self.local, self.group = local.detach(), group
        self.storage = full.untyped_storage().data_ptr()
        self.full: torch.Tensor | None = None
        self.pending = 0

    def pack(self, saved: torch.Tensor):
        if saved.untyped_storage().data_ptr() != self.storage:
            return saved
        self.pending += 1
        return self, saved.size(), saved.stride(), saved.storage_offset()

    def unpack(self, packed):
        if not isinstance(packed, tuple):
            return packed
        _, size, stride, offset = packed
        if self.full is None:
            with torch.no_grad():
                self.full = all_gather_sequence(self.local, group=self.group)
        view = self.full.as_strided(size, stride, offset)
        self.pending -= 1
        if self.pending <= 0:
            self.full = None
        return view


class SequenceParallelSwitch:
    """Sequence parallelism on (training, evaluation, logits) or off (``generate``). A decoding step
    feeds one token, which cannot be split over the tp ranks; with the switch off every hook below
    passes its input through and the row layers all-reduce instead of reduce-scattering, which is
    plain tensor parallelism: the same weights, the same sums, whole activations between the regions."""

    def __init__(self, model: nn.Module) -> None:
        self.on = True
        self._rows = [m for m in model.modules() if isinstance(m, RowParallelLinear) and m.sequence_parallel]

    @contextlib.contextmanager
    def off(self) -> Iterator[None]:
        self.on = False
        for row in self._rows:
            row.sequence_parallel = False
        try:
            yield
        finally:
            self.on = True
            for row in self._rows:
                row.sequence_parallel = True


def _entry_hooks(entry: nn.Module, *, group: ProcessGroup, regather: bool, switch: SequenceParallelSwitch) -> None:
    """The entry's first argument (this rank's sequence slice) is gathered on the way in, with a
    reduce-scatter of its gradient. With ``regather``, what the entry's layers save of the gathered
    input for their weight gradients is kept as the slice and gathered again in backward (as
    Megatron does): one more all-gather per entry and microbatch, and the saved input shrinks by tp."""
    contexts: list[torch.autograd.graph.saved_tensors_hooks] = []

    def enter(module: nn.Module, args: tuple, kwargs: dict):
        if not switch.on:
            return None
        key, local = first_argument(module, args, kwargs)
        full = gather_sequence_into_region(local, group=group)
        if regather and torch.is_grad_enabled():
            kept = _Regathered(local, full, group)
            contexts.append(torch.autograd.graph.saved_tensors_hooks(kept.pack, kept.unpack))
            contexts[-1].__enter__()
        return with_first(args, kwargs, key, full)

    def leave(*_):
        if contexts:
            contexts.pop().__exit__(None, None, None)

    entry.register_forward_pre_hook(enter, with_kwargs=True)
    entry.register_forward_hook(leave, always_call=True)


def _whole_region_hooks(region: nn.Module, *, name: str, group: ProcessGroup, switch: SequenceParallelSwitch) -> None:
    """A block child that may mix positions and is no tp entry (MLA attention, whose low-rank q_a
    reads the input beside the columns; a Mamba mixer; an MoE block with a tp-split shared expert)
    runs exactly as under plain tp: its first argument is all-gathered (backward: this rank's slice
    of the input gradient, which is whole and equal on every rank there, as plain tp keeps it), and
    this rank's slice of its output is taken (backward: all-gather of the slices' gradients). The
    region repeats its work on every tp rank, as plain tp does; its parameters' gradients are whole.

    Per-position tensors beside them travel the same way: every output shaped like the whole
    sequence is cut (HY-V4's hyper-connection returns its weights and its mix, its attention the
    top-k indices the next layer's reads), and every other input shaped like this rank's slice
    ``[batch, slice, ...]`` is gathered (those indices, as the next region receives them)."""

    def enter(module: nn.Module, args: tuple, kwargs: dict):
        if not switch.on:
            return None
        key, local = first_argument(module, args, kwargs)
        batch, part = local.shape[:2]

        def whole(value):
            if isinstance(value, torch.Tensor) and value.dim() >= 2 and part > 1 and value.shape[:2] == (batch, part):
                return gather_sequence(value, group=group)
            return value

        args, kwargs = tuple(whole(a) for a in args), {k: whole(v) for k, v in kwargs.items()}
        return with_first(args, kwargs, key, gather_sequence(local, group=group))

    def leave(_module: nn.Module, args: tuple, kwargs: dict, output):
        if not switch.on:
            return None
        batch, full = first_argument(_module, args, kwargs)[1].shape[:2]

        def cut(value, *, first: bool):
            if isinstance(value, torch.Tensor) and value.dim() >= 2 and value.shape[:2] == (batch, full):
                return split_sequence(value, group=group)
            if first and isinstance(value, torch.Tensor) and value.dim() == 2 and value.shape[0] == batch * full:
                # token rows, batch-major (Llama 4's MoE block returns them flattened; the block reshapes)
                return split_sequence(value.reshape(batch, full, -1), group=group).flatten(0, 1)
            if first:
                raise ValueError(f"sequence_parallel=True: {name} ({type(region).__name__}) runs on the whole "
                                 f"sequence and must return it first ([{batch}, {full}, ...] or [{batch * full}, ...]);"
                                 f" it returned {tuple(value.shape) if isinstance(value, torch.Tensor) else type(value).__name__}"
                                 f"; use sequence_parallel=False")
            return value

        if isinstance(output, tuple):
            return (cut(output[0], first=True), *(cut(o, first=False) for o in output[1:]))
        return cut(output, first=True)

    region.register_forward_pre_hook(enter, with_kwargs=True)
    region.register_forward_hook(leave, with_kwargs=True)


def apply_sequence_parallel(model: nn.Module, *, plan: TpPlan, stage_plan: StagePlan, stage: int, final: str | None,
                            group: ProcessGroup, regather: bool) -> SequenceParallelSwitch:
    """Hook this stage's tp entries (gather the sequence), the first block of each of its chunks
    (take the sequence slice) and each chunk's last block, or ``final`` (the final norm, after the
    last chunk), to gather it again: what travels between chunks is the whole sequence.
    ``regather`` keeps the entries' saved inputs as slices (off under recomputation, which keeps no
    block internals anyway). Returns the switch that turns all of it off (``generate``)."""
    layers = model.get_submodule(stage_plan.layers)
    switch = SequenceParallelSwitch(model)
    for entry in plan.tp_entries:
        _entry_hooks(model.get_submodule(entry), group=group, regather=regather, switch=switch)
    for experts in plan.sequence_experts:
        partial_sum_hooks(model.get_submodule(experts), group=group, rows_split=lambda: switch.on)
    for region in plan.whole_regions:
        _whole_region_hooks(model.get_submodule(region), name=region, group=group, switch=switch)

    def split(module: nn.Module, args: tuple, kwargs: dict):
        if not switch.on:
            return None
        key, hidden = first_argument(module, args, kwargs)
        # train_step checked the batch already; this covers direct calls and inputs_embeds
        check_sequence_length(hidden.shape[1], sequence_split(cp=1, tp=group_size(group), sequence_parallel=True))
        return with_first(args, kwargs, key, split_sequence(hidden, group=group))

    def gather(_module: nn.Module, _args: tuple, output):
        if not switch.on:
            return None
        if isinstance(output, tuple):
            return (gather_sequence(output[0], group=group), *output[1:])
        return gather_sequence(output, group=group)

    def split_per_position(module: nn.Module, args: tuple, kwargs: dict):
        if not switch.on:
            return None
        bound = inspect.signature(module.forward).bind(*args, **kwargs)
        for name in PER_POSITION_BLOCK_INPUTS & set(bound.arguments):
            if isinstance(bound.arguments[name], torch.Tensor):
                bound.arguments[name] = split_sequence(bound.arguments[name], group=group)
        return bound.args, bound.kwargs

    for chunk in stage_plan.chunks_of(stage):
        start, stop = stage_plan.layer_ranges[chunk]
        getattr(layers, str(start)).register_forward_pre_hook(split, with_kwargs=True)
        for index in range(start, stop):
            block = getattr(layers, str(index))
            if PER_POSITION_BLOCK_INPUTS & set(inspect.signature(block.forward).parameters):
                block.register_forward_pre_hook(split_per_position, with_kwargs=True)
        last = final if final is not None and chunk == stage_plan.chunks - 1 else None
        (model.get_submodule(last) if last is not None else getattr(layers, str(stop - 1))).register_forward_hook(gather)
    return switch


def sequence_wire(group: ProcessGroup) -> Wire:
    """Activations between stages as this tp rank's contiguous slice of the sequence: sent as the
    slice of the gathered output (backward: zeros elsewhere, which the gather's backward, a local
    split, drops), received and all-gathered over tp (backward: this rank's slice of the gradient)."""
    size = group_size(group)

    def out(x: torch.Tensor) -> torch.Tensor:
        return x.chunk(size, dim=1)[group_rank(group)]

    def into(x: torch.Tensor) -> torch.Tensor:
        return gather_sequence(x, group=group)

    return Wire(out=out, into=into)
