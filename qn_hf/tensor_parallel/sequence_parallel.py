"""Sequence parallelism inside tensor parallelism (Megatron-SP): checks, the plan change, the hooks.

Between tensor-parallel regions a block's activations are whole on every tp rank: the norms, the
residual adds and dropout there repeat the same work tp times and keep tp copies alive. Under
sequence parallelism each tp rank keeps only its contiguous slice of the sequence there:

* a tp entry (the attention or MLP module, whose first argument feeds only column layers) all-gathers
  the sequence on the way in (reduce-scatter of the input gradient, where the plain tp entry
  all-reduces it);
* its row layer reduce-scatters along the sequence where it all-reduced (all-gather backward);
* each stage's first block takes its slice of the incoming (whole) hidden states, and the last
  block's output, or on the last stage the final norm's output, is all-gathered again. The model's
  own forward therefore builds its masks and rotary tables for the whole sequence, before the
  first block, and whatever it does after the blocks (GPT-2 reshapes to the input's shape), the
  head and the loss see whole activations.
* between pipeline stages only this rank's slice travels (``sequence_wire``): the sender cuts it out
  of the gathered output (its gradient flows back through the gather's backward, a local split, so
  nothing more is communicated), the receiver all-gathers the slices of its tp group into the whole
  sequence its model's forward expects. That moves (tp-1)/tp of the pipeline bytes onto one more
  all-gather inside the tp group, typically the faster links (within a node, where pipeline
  neighbours are often on other nodes).

Inside a block the bytes on tp equal the all-reduce version (an all-reduce is a reduce-scatter plus
an all-gather); the two edges add one all-gather of the hidden states each per microbatch and stage,
and a received activation one more.

Replicated parameters that now see only this rank's slice of the sequence get their gradients summed
over tp: the norms between the regions (each rank's gradient covers its tokens only), the final
norm (likewise), and the row layers' biases (added to this rank's slice of the sum). Dropout there
draws from the tp-local random stream: the ranks hold different tokens, so equal masks would
correlate token i with token i + sequence/tp.

A block child outside the tp entries that may mix positions (neither a norm, dropout nor an
activation: MLA attention, whose low-rank ``q_a_proj`` reads the input beside the columns; a Mamba
or linear-attention mixer; an MoE block with a tp-split shared expert) is a whole region: it gathers
the sequence on the way in and keeps this rank's slice of its output, and inside runs exactly as
under plain tp (whole activations, whole gradients; tp entries in it are plain tp entries). It
saves nothing by sequence parallelism and repeats its replicated work on every tp rank, as plain tp
does; the blocks around it keep the savings.

With context parallelism the layout has two levels. The "sequence" this module splits is the cp
rank's part of it: two chunks of the 2*cp (``ChunkLayout``), L/cp tokens, concatenated, each with its
true ``position_ids``. Between the tp regions a tp rank holds the contiguous L/(cp*tp) tokens
``[t * L/(cp*tp), (t+1) * L/(cp*tp))`` of that part (they may straddle the two chunks: nothing here
reads positions); an entry gathers the part back over tp, and inside it ring attention exchanges
key/value blocks over cp. So every length must be a multiple of cp * lcm(2, tp) (``sequence_split``).
Gradients: the norms' over tp (the slices), everything over dp x cp (the chunks), independently.
"""

from __future__ import annotations

import contextlib
import inspect
from collections.abc import Iterator, Mapping
from dataclasses import replace

import torch
from torch import nn
from torch.distributed import ProcessGroup

from ..step.batch import check_sequence_length, sequence_split
from ..comm import (all_gather_sequence, gather_sequence, gather_sequence_into_region, group_rank, group_size,
                   split_sequence)
from .patterns import join
from ..pipeline.split import StagePlan
from ..pipeline.stage import Wire
from .hooks import partial_sum_hooks
from .layers import RowParallelLinear
from .plan import TpPlan, rule_module
from .styles import EMBEDDING_STYLES, PARAM_STYLES, Style

# Rules outside the blocks that leave whole activations whole (the head gets the gathered output).
_OUTSIDE_BLOCKS = {*EMBEDDING_STYLES, Style.VOCAB_COLWISE, Style.REPLICATE, Style.REPLICATE_GRAD_SUM}
# colwise_gather and rowwise_split too (Phi-3's q|k|v, GLM's gate|up): the entry gathers the sequence
# before the column layer, and the row layer reduce-scatters what it would all-reduce
# param_colwise too: a per-head parameter (attention sinks, a gate's bias) split like the heads that
# read it, on the whole sequence the entry gathered, as under plain tp
_INSIDE_ENTRIES = {Style.COLWISE, Style.COLWISE_KV, Style.COLWISE_PACKED2, Style.COLWISE_PACKED3, Style.COLWISE_GATHER,
                   Style.ROWWISE, Style.ROWWISE_SPLIT, Style.REPLICATE, Style.REPLICATE_GRAD_SUM,
                   Style.REPLICATE_AFTER_ROW, Style.PARAM_COLWISE}
_ROWS = (Style.ROWWISE, Style.ROWWISE_SPLIT)
# What a block's forward may take beside its hidden states and leave whole for every block: masks,
# positions and rotary tables, caches and flags, read only where the sequence is whole (the tp entries
# and the whole regions gather it) or not per position (found on the zoo's blocks; any other name is
# refused, since a per-position input next to the block's slice would not match it)
_WHOLE_BLOCK_INPUTS = frozenset({
    "attention_mask", "position_ids", "position_embeddings", "cache_position", "past_key_values", "past_key_value",
    "layer_past", "use_cache", "output_attentions", "output_router_logits", "attention_scaling", "shared_kv_states",
    "prev_topk_indices", "conv_mask",
    # cross-attention's encoder sequence, which is not this one (None in a causal LM: GPT-2's block)
    "encoder_hidden_states", "encoder_attention_mask", "head_mask"})
# ... and what it takes per position next to its hidden states, split like them at every block (the
# base model passes it whole to each): Gemma 3n's and Gemma 4's per-layer inputs
_PER_POSITION_BLOCK_INPUTS = frozenset({"per_layer_input"})
# where elementwise activation functions live (Gemma 4 calls its block-level act_fn between the regions)
_ACTIVATION_MODULES = ("torch.nn.modules.activation", "transformers.activations")
# expert-TP: the experts module's hook and its sliced parameters
_EXPERT_TP = (Style.EXPERTS, *PARAM_STYLES)


def position_wise(module: nn.Module) -> bool:
    """A module that acts on each position alone: dropout, identity, a norm over the features, or a
    parameter-free activation function (torch's or transformers')."""
    if isinstance(module, (nn.Dropout, nn.Identity, nn.LayerNorm, nn.RMSNorm)):
        return True
    if not list(module.parameters()) and (type(module).__module__ in _ACTIVATION_MODULES):
        return True
    name = type(module).__name__
    return name.endswith(("RMSNorm", "LayerNorm")) and all(p.dim() == 1 for p in module.parameters())


def _inside(name: str, entries: tuple[str, ...]) -> bool:
    return any(name == e or name.startswith(e + ".") for e in entries)


def sequence_parallel_plan(model: nn.Module, plan: TpPlan, stage_plan: StagePlan, *,
                           token_wise: Mapping[str, frozenset[str]] | None = None) -> TpPlan:
    """``plan`` with sequence parallelism on, after checking ``model`` can take it (no communication).
    ``token_wise``: block children that act token by token though they are no norm (an MoE block
    whose experts ep shards: its router and its dispatch take this rank's tokens as they are; or
    whose only tp rules are its experts' at ep=1: the router takes this rank's tokens and the experts
    gather every rank's rows, ``sequence_experts``), each with its parameters that are not replicated
    over tp (the experts', summed over their holders or split over tp)."""
    token_wise = token_wise or {}
    if plan.tp == 1:
        raise ValueError("sequence_parallel=True needs tp > 1: it splits the activations between tensor-parallel "
                         "regions over the tp ranks; use tp >= 2 or sequence_parallel=False")
    layers = stage_plan.layers
    why = f"sequence_parallel=True ({plan.policy.model_type})"
    blocks = [join(layers, str(i)) for i in range(len(model.get_submodule(layers)))]
    for block in {type(model.get_submodule(b)) for b in blocks}:
        extra = [n for n, p in list(inspect.signature(block.forward).parameters.items())[2:]
                 if n not in _WHOLE_BLOCK_INPUTS | _PER_POSITION_BLOCK_INPUTS and p.kind not in (p.VAR_POSITIONAL, p.VAR_KEYWORD)]
        if extra:
            raise ValueError(f"{why}: {block.__name__}.forward takes {', '.join(extra)} beside the hidden states: "
                             f"an input for the whole sequence next to the block's slice of it, which qn_hf cannot "
                             f"tell is safe to leave whole or to split (DeepSeek-V4's token ids for hash routing, "
                             f"Inkling 2's block states); use sequence_parallel=False")
    # What runs between the tp entries, child by child of each block: norms and dropout on this rank's
    # slice; token-wise MoE blocks on this rank's tokens; anything else (attention or a mixer that is
    # no entry, an MoE block with a tp-split shared expert) as a whole region (``whole_region_hooks``).
    sums: list[str] = []
    whole: list[str] = []
    for block in blocks:
        # the block's own parameters (Doge's residual scales) act on its slice, as its residual adds do
        sums += [join(block, p) for p, _ in model.get_submodule(block).named_parameters(recurse=False)]
        for full, module in _called_children(model.get_submodule(block), block):
            if full in plan.tp_entries:
                continue
            if full in token_wise:  # its replicated parameters (the router) see this rank's tokens only
                sums += [join(full, p) for p, _ in module.named_parameters() if join(full, p) not in token_wise[full]]
            elif position_wise(module):
                sums += [join(full, p) for p, _ in module.named_parameters()]
            else:
                whole.append(full)
    regions = tuple(whole)
    # an entry inside a whole region takes its input whole there: a plain tp entry (its columns copy
    # the input into the tp region one by one), not one that gathers the sequence
    entries = tuple(e for e in plan.tp_entries if not _inside(e, regions))
    for name, style in plan.rules:
        module = rule_module(name, style)
        if not module.startswith(layers + "."):
            if style not in _OUTSIDE_BLOCKS:
                raise ValueError(f"{why}: {name} ({style}) outside the blocks is not supported; use sequence_parallel=False")
        elif _inside(module, regions):
            continue  # plain tp there, every style as without sequence parallelism
        elif _inside(module, tuple(token_wise)) and style in _EXPERT_TP:
            continue  # the experts of a token-wise MoE block: their call gathers the rows
        elif not _inside(module, entries):
            raise ValueError(f"{why}: {name} ({style}) is not inside a tp entry (a module whose first argument feeds "
                             f"only column layers), so its input cannot be gathered there; use sequence_parallel=False")
        elif style not in _INSIDE_ENTRIES:
            raise ValueError(f"{why}: style {style!r} ({name}) is not supported with sequence parallelism; "
                             f"use sequence_parallel=False")
    for entry in entries:
        if not any(style in _ROWS and n.startswith(entry + ".") for n, style in plan.rules):
            raise ValueError(f"{why}: tp entry {entry} has no rowwise layer to reduce-scatter its output; "
                             f"use sequence_parallel=False")
    final = final_norm(model, stage_plan)
    if final is not None:
        sums += [join(final, p) for p, _ in model.get_submodule(final).named_parameters()]
    # a row layer's bias is added to this rank's slice of the sum (whole inside a whole region)
    sums += [join(n, "bias") for n, style in plan.rules
             if style in _ROWS and getattr(model.get_submodule(n), "bias", None) is not None and not _inside(n, regions)]
    # a layer on a row layer's reduce-scattered output sees this rank's positions only (LoRA's B)
    sums += [join(n, p) for n, style in plan.rules if style == Style.REPLICATE_AFTER_ROW and not _inside(n, regions)
             for p, _ in model.get_submodule(n).named_parameters()]
    return replace(
        plan,
        sequence_parallel=True,
        tp_entries=entries,
        grad_sum=tuple(dict.fromkeys((*plan.grad_sum, *sums))),
        tp_rng_regions=tuple(dict.fromkeys((*plan.tp_rng_regions, *blocks))),
        # inside the blocks activations are slices (or head shards): their own masks, except on inputs
        # an entry gathered whole (a LoRA column target's dropout: one mask, as in one process) and in
        # whole regions, which draw as under plain tp: the shared stream on whole activations, the
        # tp-local one where plain tp has it (a region that is itself a tp rng region: its heads)
        shared_rng_regions=tuple(dict.fromkeys(
            [n for n in plan.shared_rng_regions
             if not n.startswith(layers + ".") or n in plan.whole_input_rng_regions or _inside(n, regions)]
            + [r for r in regions if r not in plan.tp_rng_regions])),
        sequence_experts=tuple(n for n, style in plan.rules if style == Style.EXPERTS and _inside(n, tuple(token_wise))),
        whole_regions=regions,
    )


def _called_children(module: nn.Module, name: str) -> Iterator[tuple[str, nn.Module]]:
    """The children a block's forward calls: those of a container (LongCat's two attentions in a
    ModuleList) in its place, since a container's own hooks never run."""
    for child, sub in module.named_children():
        if isinstance(sub, (nn.ModuleList, nn.ModuleDict)):
            yield from _called_children(sub, join(name, child))
        else:
            yield join(name, child), sub


def final_norm(model: nn.Module, stage_plan: StagePlan) -> str | None:
    """The norm after the blocks (last stage only), whose output is gathered; None: there is none,
    or something else after the blocks may mix positions or hold parameters (HY-V4's hc_head,
    placed last or not placed at all), and the last block's output is gathered instead."""
    base = stage_plan.layers.rpartition(".")[0]
    placed = {stage_plan.layers, stage_plan.entry, *(n for n, _ in stage_plan.first_only)}
    for child, module in (model.get_submodule(base) if base else model).named_children():
        if join(base, child) not in placed and any(True for _ in module.parameters()) and not position_wise(module):
            return None
    for name, _ in stage_plan.last_only:
        if position_wise(model.get_submodule(name)) and not isinstance(model.get_submodule(name), nn.Identity):
            return name
    return None


def regathers(recompute: str | None) -> bool:
    """Whether entries keep only their input's slice for backward and gather it again there: not under
    recomputation, which keeps no block internals anyway (and would recompute the gather)."""
    return recompute is None


def first_argument(module: nn.Module, args: tuple, kwargs: dict) -> tuple[str | int, object]:
    """A forward's first argument, passed by position (key 0) or by name (key: its name)."""
    if args:
        return 0, args[0]
    name = next(iter(inspect.signature(module.forward).parameters))
    return name, kwargs[name]


def with_first(args: tuple, kwargs: dict, key: str | int, value: object) -> tuple[tuple, dict]:
    return ((value, *args[1:]), kwargs) if key == 0 else (args, {**kwargs, key: value})


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
        for name in _PER_POSITION_BLOCK_INPUTS & set(bound.arguments):
            if isinstance(bound.arguments[name], torch.Tensor):
                bound.arguments[name] = split_sequence(bound.arguments[name], group=group)
        return bound.args, bound.kwargs

    for chunk in stage_plan.chunks_of(stage):
        start, stop = stage_plan.layer_ranges[chunk]
        getattr(layers, str(start)).register_forward_pre_hook(split, with_kwargs=True)
        for index in range(start, stop):
            block = getattr(layers, str(index))
            if _PER_POSITION_BLOCK_INPUTS & set(inspect.signature(block.forward).parameters):
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
