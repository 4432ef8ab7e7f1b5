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

Replicated parameters that see only this rank's slice of the sequence get their gradients summed
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
rank's part of it: two pieces of the 2*cp (``PieceLayout``), L/cp tokens, concatenated, each with its
true ``position_ids``. Between the tp regions a tp rank holds the contiguous L/(cp*tp) tokens
``[t * L/(cp*tp), (t+1) * L/(cp*tp))`` of that part (they may straddle the two pieces: nothing here
reads positions); an entry gathers the part back over tp, and inside it ring attention exchanges
key/value blocks over cp. So every length must be a multiple of cp * lcm(2, tp) (``sequence_split``).
Gradients: the norms' over tp (the slices), everything over dp x cp (the pieces), independently.

This module decides (checks, the plan change); ``sequence_hooks.py`` installs the hooks.
"""

from __future__ import annotations

import inspect
from collections.abc import Iterator, Mapping
from dataclasses import replace

from torch import nn

from ..compat import CACHE_KWARGS
from ..pipeline.split import StagePlan
from ..policies.module_kinds import is_fused_experts, position_wise
from ..policies.patterns import join
from ..policies.styles import EMBEDDING_STYLES, PARAM_STYLES, Style
from ..policies.tp_plan import TpPlan, rule_module

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
    *CACHE_KWARGS, "attention_mask", "position_ids", "position_embeddings", "cache_position", "past_key_value",
    "layer_past", "use_cache", "output_attentions", "output_router_logits", "attention_scaling", "shared_kv_states",
    "prev_topk_indices", "conv_mask",
    # cross-attention's encoder sequence, which is not this one (None in a causal LM: GPT-2's block)
    "encoder_hidden_states", "encoder_attention_mask", "head_mask"})
# ... and what it takes per position next to its hidden states, split like them at every block (the
# base model passes it whole to each): Gemma 3n's and Gemma 4's per-layer inputs
PER_POSITION_BLOCK_INPUTS = frozenset({"per_layer_input"})
# where elementwise activation functions live (Gemma 4 calls its block-level act_fn between the regions)
# expert-TP: the experts module's hook and its sliced parameters
_EXPERT_TP = (Style.EXPERTS, *PARAM_STYLES)


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
    if stage_plan.loop_count is not None:
        # the sequence is split where a stage's blocks begin and gathered where they end; one module called in
        # every iteration is both, at each call
        raise ValueError(f"{why}: its blocks are one module its forward calls config.{stage_plan.loop_count} times "
                         f"({layers}), where a split sequence cannot begin and end; use sequence_parallel=False")
    if stage_plan.siblings:  # no block module begins or ends a position of a body written out in the forward
        raise ValueError(f"{why}: its forward writes the blocks' body out over parallel lists ({layers}, "
                         f"{', '.join(stage_plan.siblings)}), which has no module where a split sequence can begin "
                         f"and end; use sequence_parallel=False")
    blocks = [join(layers, str(i)) for i in range(len(model.get_submodule(layers)))]
    for block in dict.fromkeys(type(model.get_submodule(b)) for b in blocks):  # in model order: one message every run
        extra = [n for n, p in list(inspect.signature(block.forward).parameters.items())[2:]
                 if n not in _WHOLE_BLOCK_INPUTS | PER_POSITION_BLOCK_INPUTS and p.kind not in (p.VAR_POSITIONAL, p.VAR_KEYWORD)]
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
            elif is_fused_experts(module):
                # the block calls its experts itself (Gemma 4: a router and experts beside its MLP), on
                # its tokens flattened to rows, which a whole region, gathered along the sequence, is not
                raise ValueError(f"{why}: {full} ({type(module).__name__}) is called by its block itself on "
                                 f"flattened token rows, not from an MoE block qn_hf can run on this rank's tokens; "
                                 f"use sequence_parallel=False (tp and ep shard its experts)")
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
    if stage_plan.layers is None:
        return None
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
