"""What one rank's model becomes as a pipeline stage, and how that stage runs a microbatch.

Every stage runs the Hugging Face base model's own forward, so whatever a block needs besides the
hidden state (causal mask, rotary embeddings, position ids) is rebuilt by HF's code on each stage.
What differs per stage is which modules are real:

* the blocks: each stage keeps the contiguous ranges of its chunks (under their original indices,
  so parameter names stay the HF names) and drops the rest;
* the entry (token/patch embedding): real on the first stage; elsewhere an ``Injector`` that returns
  the activation received from the previous stage. Where the base forward makes the blocks' input
  out of the embedding (``StagePlan.receive_at_blocks``: Granite's multiplier, DeepSeek-V4's
  streams, NanoChat's norm), it would do that again to what a later stage receives: there the entry
  gives zeros, the received activation replaces the first argument of the chunk's first block, and
  a chunk sends its last block's output rather than the base model's;
* first-only and last-only modules: real on their stage, a parameter-free stand-in elsewhere;
* the task head (``lm_head``, ``classifier``): on the last stage only; earlier stages run the task
  model's forward up to the return of the module holding the blocks and send that module's output
  (the last block's where the two differ in shape: Longformer's window padding);
* modules real on every stage (``StagePlan.every_stage``: Gemma 4's per-layer embeddings and the
  token embedding they read): each stage computes them as the plain model does and its first block
  takes the received activation; those whose output holds one part per block, which the forward
  indexes by its loop's position, are rotated so that the chunk's first block finds its own part.

``apply_stage`` edits one rank's model in place (from a ``StagePlan``, see split.py) and returns
the ``StageModules`` whose ``forward`` runs a microbatch through whatever the stage kept.

With virtual stages a rank runs several chunks (interleaved schedules): its model holds the union
of their blocks, with the real entry and first-only modules on rank 0 and the real last-only
modules and heads on the last rank. A chunk's forward installs that chunk's view for its duration
(its blocks, its cut config, and the stand-in or real module at each entry, first-only, last-only
and head path) and restores the rank's view afterwards: a handful of ``setattr``. Outside a forward
the model is the rank's whole shard, which is what optimizers, buckets and checkpoints see.
"""

from __future__ import annotations

import contextlib
import warnings
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field

import torch
from torch import nn
from transformers.utils import ModelOutput

from ..policies.model_policy import StandIn as StandInKind
from ..policies.patterns import base_model_and_prefix, join
from .seq2seq import run_chunk
from .seq2seq import stage_modules as seq2seq_stage_modules
from .split import StagePlan
from .stage_config import cut_layer_lists
from .standins import BlockRotation, BodyInjector, Injector, PassThrough, mirror_reads, standin_for


def _unchanged(x: torch.Tensor) -> torch.Tensor:
    return x


@dataclass(frozen=True)
class Wire:
    """How an activation crosses a stage boundary: ``out`` turns a chunk's output into what is sent,
    ``into`` turns what was received into the next chunk's entry activation. Both are the identity
    unless a feature keeps activations in another layout between stages: sequence parallelism sends
    each tp rank's slice of the sequence (``sequence_hooks.sequence_wire``)."""

    out: Callable[[torch.Tensor], torch.Tensor] = _unchanged
    into: Callable[[torch.Tensor], torch.Tensor] = _unchanged


@dataclass(kw_only=True)
class StageModules:
    """What one rank's model became: its stage, the modules it runs and, past the first chunk, the
    injector that feeds it the received activation."""

    stage: int
    stages: int
    injector: Injector | None
    config: object  # the whole model's config, as given: exports and checkpoints write this one
    model: nn.Module  # the whole (cut) HF model: its head runs on the last chunk
    base: nn.Module  # its HF base model: what earlier chunks run
    plan: StagePlan
    # chunk -> the stand-ins to set while that chunk runs, as (holder, attribute, stand-in), for the
    # entry/first/last/head paths whose real module belongs to another chunk; empty with one chunk
    # per rank, whose view is the model as it stands
    views: dict[int, tuple[tuple[nn.Module, str, nn.Module], ...]] = field(default_factory=dict)
    wire: Wire = field(default_factory=Wire)
    rotation: BlockRotation | None = None  # per-block outputs rotated to the running chunk's blocks
    # earlier chunks run the task model too (its head a stand-in there) and take the base model's
    # output from a hook: FSDP's root hooks sit on the task model (dp_shard, data_parallel/sharded.py)
    enter_at_top: bool = False

    @property
    def chunks(self) -> tuple[int, ...]:
        """This rank's chunks, in model order (just its stage when virtual=1)."""
        return self.plan.chunks_of(self.stage)

    @property
    def is_first(self) -> bool:
        return self.stage == 0

    @property
    def is_last(self) -> bool:
        return self.stage == self.stages - 1

    def is_last_chunk(self, chunk: int) -> bool:
        return chunk == self.plan.chunks - 1

    @contextlib.contextmanager
    def view(self, chunk: int) -> Iterator[None]:
        """Install ``chunk``'s view. The blocks and the loop's config are taken from the model as it
        is now (whatever replaced modules inside the blocks, or the config, after the cut), and real
        modules are never held here: the rank's view keeps them, a chunk only masks some."""
        if self.rotation is not None:
            self.rotation.start = self.plan.layer_ranges[chunk][0]
        if chunk not in self.views:
            yield
            return
        layers_holder, layers_name = _holder(self.model, self.plan.layers)
        union = getattr(layers_holder, layers_name)
        start, stop = self.plan.layer_ranges[chunk]
        swaps = [*self.views[chunk]]
        if self.plan.loop_count is None:  # a looped module is called by the config's count: the list stays whole
            blocks = nn.ModuleList()
            for i in range(start, stop):
                blocks.add_module(str(i), getattr(union, str(i)))  # by name: the union's indices have gaps
            swaps.append((layers_holder, layers_name, blocks))
        # the module holding the blocks loops over them and reads per-layer config lists by index
        shared = getattr(layers_holder, "config", None)
        total = self.plan.layer_ranges[-1][1]
        if shared is not None:
            swaps.append((layers_holder, "config", cut_layer_lists(shared, start=start, stop=stop, total=total,
                                                                   count=self.plan.loop_count)))
        saved = [getattr(holder, name) for holder, name, _ in swaps]
        try:
            for holder, name, value in swaps:
                setattr(holder, name, value)
            yield
        finally:
            for (holder, name, _), value in zip(swaps, saved):
                setattr(holder, name, value)

    def forward(self, inputs: Mapping[str, torch.Tensor], received: torch.Tensor | None, *, chunk: int | None = None,
                **kwargs):
        """One microbatch through ``chunk`` (default: this rank's only chunk). ``received`` (None on
        chunk 0) enters through the injector. A non-last chunk returns the activation to send (the
        base model's ``last_hidden_state``: no head runs before the last chunk); the last chunk
        returns the HF model's outputs, for the loss. ``kwargs`` go to the HF forward as they are."""
        chunk = self.stage if chunk is None else chunk
        if self.plan.seq2seq is not None:  # encoder stages, then decoder stages (seq2seq.py)
            return run_chunk(self, self.plan.seq2seq, chunk=chunk, inputs=inputs, received=received, kwargs=kwargs)
        with self.view(chunk):
            if self.injector is not None:
                self.injector.pending = self.wire.into(received) if chunk > 0 else None
            if not self.is_last_chunk(chunk):
                if self.plan.receive_at_blocks:
                    return self.wire.out(self._last_block_output(chunk, inputs, kwargs))
                if self.enter_at_top:
                    return self.wire.out(self._captured(self.base, inputs, kwargs))
                return self.wire.out(self._base_output(chunk, inputs, kwargs))
            return self.model(**inputs, **kwargs)

    def _base_output(self, chunk: int, inputs: Mapping[str, torch.Tensor], kwargs: dict) -> torch.Tensor:
        """What a chunk sends when activations enter at the entry: the blocks' stack's output as the task
        model's forward calls it, unless the base reshapes the blocks' output before that (Longformer pads the
        sequence to its attention window before the blocks and cuts the padding off after): then the last
        block's output, which the next stage's blocks take, and the last stage's own forward cuts once.

        The task model's forward runs up to the return of the module that holds the blocks (the base model,
        or its encoder or decoder) and is stopped there: no head runs before the last chunk, and what the
        task forward gives the base besides the batch is the same on every stage (Longformer's classifier and
        span heads add global attention on the first token or the question). A task forward that never calls
        that module has its base model called instead."""
        holder = self.model.get_submodule(self.plan.layers.rpartition(".")[0])
        stop = holder.register_forward_hook(_stop_at_return)
        try:
            with _capturing(self._last_block(chunk)) as captured:
                self.model(**inputs, **kwargs)
            stop.remove()
            with _capturing(self._last_block(chunk)) as captured:
                out = self.base(**inputs, **kwargs)
        except _StackReturned as returned:
            out = returned.output
        finally:
            stop.remove()
        hidden = first_output(out)
        return captured[-1] if captured and captured[-1].shape != hidden.shape else hidden

    def _last_block(self, chunk: int) -> nn.Module:
        return self.plan.block(self.model, self.plan.layer_ranges[chunk][1] - 1)

    def _last_block_output(self, chunk: int, inputs: Mapping[str, torch.Tensor], kwargs: dict) -> torch.Tensor:
        """What a chunk sends when activations enter at the blocks: its last block's output (a
        hyper-connection model's streams), not the base model's, which runs whatever follows the
        blocks on it (NanoChat's final norm is real on every stage: it holds no parameters). The hook
        is added for this call only, so it runs after every hook installed at parallelize time
        (sequence parallelism's gather of the whole sequence)."""
        return self._captured(self._last_block(chunk), inputs, kwargs)

    def _captured(self, module: nn.Module, inputs: Mapping[str, torch.Tensor], kwargs: dict) -> torch.Tensor:
        """``module``'s output (the first of a tuple, a model output's ``last_hidden_state``) in one run
        of the base model, or of the task model with ``enter_at_top``."""
        with _capturing(module) as captured, warnings.catch_warnings():
            # FSDP warns that the task model returns a view (the head's stand-in passes the sliced
            # hidden states through); that output is dropped here, never changed in place
            warnings.filterwarnings("ignore", message=r"FSDP2-wrapped module .* returned a view tensor")
            (self.model if self.enter_at_top else self.base)(**inputs, **kwargs)
        return captured[-1]


def _holder(model: nn.Module, name: str) -> tuple[nn.Module, str]:
    parent, _, child = name.rpartition(".")
    return (model.get_submodule(parent) if parent else model), child


def _replace(model: nn.Module, name: str, new: nn.Module) -> None:
    holder, child = _holder(model, name)
    setattr(holder, child, new)


def apply_stage(model: nn.Module, plan: StagePlan, *, stage: int) -> StageModules:
    """Keep only ``stage``'s modules in ``model`` (in place); the others are freed."""
    config = model.config
    base = base_model_and_prefix(model)[0]
    if plan.stages == 1:
        return StageModules(stage=0, stages=1, injector=None, config=config, model=model, base=base, plan=plan)
    if plan.seq2seq is not None:
        return _seq2seq_stage(model, plan, stage=stage, config=config, base=base)
    layers = model.get_submodule(plan.layers)
    chunks = plan.chunks_of(stage)
    if plan.siblings:  # a written-out body's lists stay whole, the other stages' positions pass-throughs
        mine = {i for chunk in chunks for i in range(*plan.layer_ranges[chunk])}
        for path in (plan.layers, *plan.siblings):
            whole = model.get_submodule(path)
            _replace(model, path, nn.ModuleList([whole[i] if i in mine else PassThrough() for i in range(len(whole))]))
    elif plan.loop_count is None:  # a looped module is called by the config's count: the list stays whole
        kept = nn.ModuleList()
        for chunk in chunks:
            for i in range(*plan.layer_ranges[chunk]):
                kept.add_module(str(i), layers[i])  # original index: parameter names stay the HF names
        _replace(model, plan.layers, kept)
    if len(chunks) == 1:  # with several chunks, each forward cuts the config for its chunk (_view)
        loop_holder = _holder(model, plan.layers)[0]
        start, stop = plan.layer_ranges[stage]
        if getattr(loop_holder, "config", None) is not None:
            loop_holder.config = cut_layer_lists(loop_holder.config, start=start, stop=stop,
                                                 total=plan.layer_ranges[-1][1], count=plan.loop_count)

    # Each entry, first-only, last-only and head path is real in one chunk (the first or the last)
    # and a parameter-free stand-in in every other. A rank that holds that chunk keeps the real
    # module; the others free it.
    owners = {path: 0 for path in [plan.entry, *(n for n, _ in plan.first_only)] if path not in plan.every_stage}
    owners.update({path: plan.chunks - 1 for path in [*(n for n, _ in plan.last_only), *plan.heads]})
    kinds = dict(plan.first_only) | dict(plan.last_only)
    # an entry real on every stage (ModelPolicy.pp_every_stage) stays; the injector only feeds the blocks
    injector: Injector | None = Injector() if plan.entry in plan.every_stage and chunks[-1] > 0 else None
    standins: dict[str, nn.Module] = {}
    for path, owner in owners.items():
        if all(chunk == owner for chunk in chunks):
            continue  # this rank runs only the real module
        module = model.get_submodule(path)
        if path == plan.entry:
            injector = Injector()
            # receiving at the blocks, the entry gives zeros of its shape for the forward to work on
            standins[path] = standin_for(StandInKind.ZEROS, module) if plan.receive_at_blocks else injector
            mirror_reads(standins[path], module, plan.entry_reads)
        else:
            standins[path] = PassThrough() if path in plan.heads else standin_for(kinds[path], module)
        if owner not in chunks:
            _replace(model, path, standins[path])  # the real module lives on another rank: freed here
    if plan.siblings and injector is not None:
        # the received activation is what the module before the chunk's first position returns (indexed_lists.py)
        start = plan.layer_ranges[chunks[0]][0]
        injector = BodyInjector()  # StageModules sets its pending
        _replace(model, join(plan.layers, str(start - 1)), injector)
    elif plan.receive_at_blocks and injector is not None:
        # once per module: a looped module is every chunk's first block, and the first call takes the activation
        for block in {id(b): b for b in (plan.block(model, plan.layer_ranges[c][0]) for c in chunks if c > 0)}.values():
            block.register_forward_pre_hook(injector.into_block, with_kwargs=True)
    rotation = BlockRotation(blocks=plan.layer_ranges[-1][1]) if plan.per_block else None
    for path in plan.per_block:
        model.get_submodule(path).register_forward_hook(rotation.hook)
    views: dict[int, tuple[tuple[nn.Module, str, nn.Module], ...]] = {}
    if len(chunks) > 1:
        for chunk in chunks:
            views[chunk] = tuple((*_holder(model, path), standin) for path, standin in standins.items()
                                 if chunk != owners[path] and owners[path] in chunks)
    return StageModules(stage=stage, stages=plan.stages, injector=injector, config=config, model=model, base=base,
                        plan=plan, views=views, rotation=rotation)


def _seq2seq_stage(model: nn.Module, plan: StagePlan, *, stage: int, config: object, base: nn.Module) -> StageModules:
    """One stage of an encoder-decoder pipeline (seq2seq.py), its entry's stand-in made as above: an
    ``Injector``, or zeros with the received activation entering at the stage's first block."""
    def injector_for(cut, entry: nn.Module) -> Injector:
        injector = Injector()
        standin = standin_for(StandInKind.ZEROS, entry) if cut.receive_at_blocks else injector
        if cut.receive_at_blocks:
            _, layers, _ = plan.seq2seq.stack_of(stage)
            first = getattr(model.get_submodule(layers), str(plan.layer_ranges[stage][0]))
            first.register_forward_pre_hook(injector.into_block, with_kwargs=True)
        mirror_reads(standin, entry, cut.entry_reads)
        _replace(model, cut.entry, standin)
        return injector

    injector = seq2seq_stage_modules(model, plan.seq2seq, chunk=stage, layer_ranges=plan.layer_ranges,
                                     replace=lambda path, module: _replace(model, path, module), injector_for=injector_for)
    return StageModules(stage=stage, stages=plan.stages, injector=injector, config=config, model=model, base=base,
                        plan=plan)


class _StackReturned(Exception):  # noqa: N818 -- not an error: how a stage stops the task forward (_base_output)
    def __init__(self, output) -> None:
        super().__init__()
        self.output = output


def _stop_at_return(_module: nn.Module, _args, output):
    # raised from the forward hook of the module holding the blocks: the task model's forward stops where that
    # returns, the autograd graph up to its output kept (nothing after it ran)
    raise _StackReturned(output)


def first_output(out):
    """The hidden states a module returns: itself, the first of a tuple or a model output, or the
    first of a list (OpenAI GPT's blocks return ``[hidden, *attentions]``)."""
    return out[0] if isinstance(out, (tuple, list, ModelOutput)) else out


@contextlib.contextmanager
def _capturing(module: nn.Module):
    """The outputs ``module`` gives inside the ``with`` (the first of a tuple, a model output's
    ``last_hidden_state``), in call order."""
    captured: list[torch.Tensor] = []
    handle = module.register_forward_hook(
        lambda _m, _a, out: captured.append(first_output(out)))
    try:
        yield captured
    finally:
        handle.remove()
