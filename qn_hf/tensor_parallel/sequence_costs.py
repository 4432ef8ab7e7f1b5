"""Sequence parallelism in the planner's meta trace: the hooks of ``qn_hf/tensor_parallel/sequence_hooks.py`` and
``qn_hf/tensor_parallel/apply.py`` at the same places, with shape-only stand-ins for their collectives.

The trace runs the unsharded model; with sequence parallelism on, it runs it as one tp rank sees the
hidden states (``[b, s, H]`` with ``s`` the whole sequence):

* each stage's first block takes the first ``s/tp`` positions of its input, by the same
  ``chunk(...).contiguous()`` as ``split_sequence`` (a view when that is contiguous, else a copy);
* each tp entry's first argument is gathered back to ``[b, s, H]`` (a new tensor). Without
  recomputation (``regather``, as ``parallelize`` sets it) what the entry's layers save of it is kept
  as this rank's slice and gathered again in backward: the saves of the gathered tensor are
  replaced by a reference to the slice, so the gathered tensor dies and the slice stays alive;
* each row layer inside an entry reduce-scatters its output to ``[b, s/tp, H]`` (a new tensor);
* each non-last stage's last block, and on the last stage the final norm (without one, the last
  block), gathers its output to ``[b, s, H]``. A non-last stage's gathered output is held until the
  trace is measured, as the pipeline executor holds what it sent until the gradient comes back.

Like qn_hf's autograd collectives, the stand-ins (``cat``, ``narrow`` + ``clone``, ``chunk``) keep
nothing for backward, so what stays alive is what a rank keeps. Outside the tp regions every tensor
then has one rank's size; inside a region (an entry, from its gather to its row layer) tensors hold
every head over the whole sequence and count as split over tp, as without sequence parallelism:
``region`` says which, for the allocations being made.

Each stand-in reports the collective it stands for, forward and backward, with the payload
``CommMeter`` counts: an all-gather's input (this rank's slice), a reduce-scatter's whole input;
an entry whose gathered input was saved reports the backward all-gather that gathers it again.
The stage-edge hooks sit on the blocks themselves, which transformers' checkpointing leaves outside
the recomputed ``forward``: recomputation never runs them again. The entries' and row layers' run
inside a block's forward, and again with it, as in training.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import nn
from torch.multiprocessing.reductions import StorageWeakRef

from ..comm_meter import Collective
from ..config.sequence import check_sequence_length, sequence_split
from ..pipeline.split import StagePlan
from ..policies.patterns import join
from ..policies.styles import Style
from ..policies.tp_plan import TpPlan
from ..tensor_parallel.sequence_parallel import final_norm, first_argument, with_first

GATHER, SCATTER = Collective.ALL_GATHER_INTO_TENSOR, Collective.REDUCE_SCATTER_TENSOR
SEQ_DIM = 1


@dataclass(frozen=True)
class StageEdges:
    """Where each stage takes its slice of the sequence (its first block) and gathers it again (its
    last block, or on the last stage the final norm), by module name, in stage order."""

    splits: tuple[str, ...]
    gathers: tuple[str, ...]


def stage_edges(model: nn.Module, stage_plan: StagePlan) -> StageEdges:
    """The edges ``apply_sequence_parallel`` hooks on every stage of ``stage_plan``."""
    layers, ranges = stage_plan.layers, stage_plan.layer_ranges
    final = final_norm(model, stage_plan) or join(layers, str(ranges[-1][1] - 1))
    return StageEdges(splits=tuple(join(layers, str(first)) for first, _ in ranges),
                      gathers=tuple(join(layers, str(stop - 1)) for _, stop in ranges[:-1]) + (final,))


@dataclass(frozen=True)
class SeqCollective:
    """One tp collective of sequence parallelism, per microbatch: ``(op, payload elements)`` forward
    and backward (None: no communication that way)."""

    module: str  # where it runs; its stage is this module's
    forward: tuple[str, int] | None
    backward: tuple[str, int] | None
    in_block_forward: bool  # inside a block's forward: recomputation may run it again
    rerun: bool = False  # recomputation does run it again (set by the trace)
    regather: bool = False  # gathers an entry's saved input again: only without recomputation


def _gather(x: torch.Tensor, tp: int) -> torch.Tensor:
    return torch.cat([x] * tp, dim=SEQ_DIM)  # one new [b, s, H] tensor, nothing saved for backward


class _Regathered:
    """An entry call's saved-tensor hooks under ``regather``: saves of the gathered input keep this
    rank's slice instead (``on_save`` sees every save, as the hooks this pair hides would)."""

    def __init__(self, local: torch.Tensor, gathered: torch.Tensor, on_save: Callable[[torch.Tensor], object]) -> None:
        self.local, self.on_save = local.detach(), on_save
        self.storage = StorageWeakRef(gathered.untyped_storage()).cdata
        self.saves = 0
        self.hooks = torch.autograd.graph.saved_tensors_hooks(self.pack, self.unpack)

    def pack(self, saved: torch.Tensor):
        packed = self.on_save(saved)
        if StorageWeakRef(saved.untyped_storage()).cdata != self.storage:
            return packed
        self.saves += 1
        return (self.local,)

    def unpack(self, packed):  # the trace runs no backward; the slice is what backward would gather
        return packed


class SequenceStandIns:
    """Installs the stand-ins on ``model`` while entered (after the trace's own hooks, so that an
    allocation is attributed to the module it runs in); ``note`` receives every collective.
    ``regather`` as ``parallelize`` sets it (without recomputation); ``on_save`` then packs every
    tensor saved inside an entry, in place of the saved-tensor hooks active around the forward."""

    def __init__(self, model: nn.Module, plan: TpPlan, edges: StageEdges, *, note: Callable[[SeqCollective], None],
                 regather: bool, on_save: Callable[[torch.Tensor], object] = lambda t: t) -> None:
        self.model, self.plan, self.edges, self.note = model, plan, edges, note
        self.regather, self.on_save = regather, on_save
        self.region = False  # inside an entry, between its gather and its row layer
        self.whole_numel = 0  # the hidden states one stage hands the next, gathered
        self._held: list[torch.Tensor] = []
        self._entered: list[_Regathered | None] = []  # the entry calls under way
        self._handles: list = []

    def _enter(self, name: str):
        def hook(module: nn.Module, args: tuple, kwargs: dict):
            key, x = first_argument(module, args, kwargs)
            gathered = _gather(x, self.plan.tp)  # allocated outside the region: whole on every rank
            self.note(SeqCollective(name, (GATHER, x.numel()), (SCATTER, gathered.numel()), in_block_forward=True))
            regathered = _Regathered(x, gathered, self.on_save) if self.regather and torch.is_grad_enabled() else None
            if regathered is not None:
                regathered.hooks.__enter__()
            self._entered.append(regathered)
            self.region = True
            return with_first(args, kwargs, key, gathered)
        return hook

    def _leave_entry(self, name: str):
        def hook(_module: nn.Module, _args: tuple, _output) -> None:
            self.region = False
            regathered = self._entered.pop()
            if regathered is not None:
                regathered.hooks.__exit__(None, None, None)
                if regathered.saves:  # backward gathers the slice once for all of them
                    self.note(SeqCollective(name, None, (GATHER, regathered.local.numel()), in_block_forward=True,
                                            regather=True))
        return hook

    def _scatter(self, name: str):
        def hook(_module: nn.Module, _args: tuple, output: torch.Tensor) -> torch.Tensor:
            self.region = False
            piece = output.narrow(SEQ_DIM, 0, output.shape[SEQ_DIM] // self.plan.tp)
            piece = piece.clone(memory_format=torch.contiguous_format)
            self.note(SeqCollective(name, (SCATTER, output.numel()), (GATHER, piece.numel()), in_block_forward=True))
            return piece
        return hook

    def _split(self, name: str):
        def hook(module: nn.Module, args: tuple, kwargs: dict):
            key, x = first_argument(module, args, kwargs)
            tp = self.plan.tp
            check_sequence_length(x.shape[SEQ_DIM], sequence_split(cp=1, tp=tp, sequence_parallel=True))
            self.whole_numel = x.numel()
            piece = x.chunk(tp, dim=SEQ_DIM)[0].contiguous()
            self.note(SeqCollective(name, None, (GATHER, piece.numel()), in_block_forward=False))
            return with_first(args, kwargs, key, piece)
        return hook

    def _gather_edge(self, name: str, *, held: bool):
        def hook(_module: nn.Module, _args: tuple, output):
            first = output[0] if isinstance(output, tuple) else output
            whole = _gather(first, self.plan.tp)
            self.note(SeqCollective(name, (GATHER, first.numel()), None, in_block_forward=False))
            if held:
                self._held.append(whole)
            return (whole, *output[1:]) if isinstance(output, tuple) else whole
        return hook

    def __enter__(self) -> SequenceStandIns:
        model, plan = self.model, self.plan
        entries = set(plan.tp_entries)
        for entry in plan.tp_entries:
            module = model.get_submodule(entry)
            self._handles.append(module.register_forward_pre_hook(self._enter(entry), with_kwargs=True))
            self._handles.append(module.register_forward_hook(self._leave_entry(entry), prepend=True, always_call=True))
        for name, style in plan.rules:  # row layers inside an entry reduce-scatter (tensor_parallel.py)
            if style == Style.ROWWISE and any(name.startswith(e + ".") for e in entries):
                self._handles.append(model.get_submodule(name).register_forward_hook(self._scatter(name), prepend=True))
        for name in self.edges.splits:
            self._handles.append(model.get_submodule(name).register_forward_pre_hook(self._split(name), with_kwargs=True))
        last = len(self.edges.gathers) - 1
        for i, name in enumerate(self.edges.gathers):
            hook = self._gather_edge(name, held=i < last)
            self._handles.append(model.get_submodule(name).register_forward_hook(hook, prepend=True))
        return self

    def release(self) -> None:
        """Drop the stages' sent outputs (after the trace has measured what is alive)."""
        self._held.clear()

    def __exit__(self, *exc: object) -> None:  # the held outputs stay until ``release``
        for handle in self._handles:
            handle.remove()
        self._handles.clear()
