"""Every list of blocks of a base model read into one tp plan (``structure.derive_block`` reads a block):
a list whose blocks of one class hold different mixers by layer (a hybrid stack) is read kind by kind."""

from __future__ import annotations

import inspect
from dataclasses import replace

from torch import nn

from .fused import FusedAttention, HeadAxis
from .module_kinds import in_out_features, is_projection
from .patterns import join, match_modules, submodule_or_none
from .structure import NO_ATTENTION, Derived, derive_block
from .styles import Style


def derive_structure(base: nn.Module, *, stacks: list[str], heads: int | None, fused: FusedAttention | None = None,
                     config=None) -> Derived:
    """The tp rules of every list of blocks in ``stacks`` (paths in ``base``), each kind's from its first
    block and applied to all (``{stack}.*.{rule}``): a path two kinds hold is split alike in both."""
    tp_plan: dict[str, Style] = {}
    patches: dict[str, str] = {}
    head_inputs: dict[str, dict] = {}
    attention: list[str] = []
    for stack in stacks:
        blocks = list(base.get_submodule(stack))
        # a hybrid stack's blocks hold different mixers (Bamba's Mamba or attention by layer, in one class;
        # Zamba's in two): each kind, named by its class and projections, is read from its first block, the
        # attention's kinds first
        kinds: dict[tuple, int] = {}
        for i, block in enumerate(blocks):
            kinds.setdefault((type(block), *sorted(n for n, m in block.named_modules() if n and is_projection(m))), i)
        read = {i: derive_block(blocks[i], heads_expected=heads, fused=fused, config=config) for i in kinds.values()}
        order = sorted(read, key=lambda i: read[i].refusal is not None)
        first = read[order[0]]
        width = getattr(config, "hidden_size", None)
        if first.refusal is not None and first.refusal.startswith(NO_ATTENTION) and isinstance(width, int):
            # no block with attention (Bamba's defaults: Mamba mixers only): the MLPs split, the mixers whole
            first = derive_block(blocks[order[0]], heads_expected=heads, fused=fused, config=config, hidden=width)
            if first.refusal is None and not any(s in (Style.COLWISE, Style.COLWISE_PACKED2) for s in first.tp_plan.values()):
                first = Derived({}, {}, refusal=f"{NO_ATTENTION}, nor an MLP")
        if first.refusal is not None:
            return Derived({}, {}, refusal=f"{stack}.{order[0]}: {first.refusal}")
        hidden = next((in_out_features(m)[1] for n, m in blocks[order[0]].named_modules()
                       if first.tp_plan.get(n) == Style.ROWWISE), width)
        rules: dict[str, Style] = {}
        for i in order:
            # a kind without attention is read again with the stack's width (a kind with it reads its own)
            derived = first if i == order[0] else read[i] if read[i].refusal != NO_ATTENTION else derive_block(
                blocks[i], heads_expected=heads, fused=fused, config=config, hidden=hidden)
            if derived.refusal is not None:
                return Derived({}, {}, refusal=f"{stack}.{i}: {derived.refusal}")
            clash = sorted(n for n, s in derived.tp_plan.items() if rules.setdefault(n, s) != s)
            if clash:
                return Derived({}, {}, refusal=f"{stack}.{i}: {clash[0]} is split unlike in {stack}.{order[0]}")
            for n in (*derived.attr_patches, *derived.head_inputs):
                # a patch names its module by path in every block: where another kind holds another module
                # there (RecurrentGemma's temporal_block, attention or recurrence), it would change that too
                holder = n if n in derived.head_inputs else n.rpartition(".")[0]
                kinds_there = {type(b.get_submodule(holder)) for b in blocks if submodule_or_none(b, holder) is not None}
                if len(kinds_there) > 1:
                    return Derived({}, {}, refusal=f"{stack}.{i}: {holder} is a {' or a '.join(sorted(k.__name__ for k in kinds_there))} "
                                                   f"by block, and tp would change what its attention reads in each")
            patches.update({f"{stack}.*.{n}": v for n, v in derived.attr_patches.items()})
            head_inputs.update({join(f"{stack}.*", n): v for n, v in derived.head_inputs.items()})
            attention += [f"{stack}.*.{n}" if n else f"{stack}.*" for n in derived.attention
                          if (f"{stack}.*.{n}" if n else f"{stack}.*") not in attention]
        tp_plan.update({f"{stack}.*.{n}": s for n, s in rules.items()})
    return Derived(tp_plan, patches, attention=tuple(attention), head_inputs=head_inputs)


# the argument an attention takes a bias built for every head under, outside its block (MPNet, CpmAnt)
HEAD_BIAS_INPUT = "position_bias"


def head_bias_tables(base: nn.Module, derived: Derived, *, stacks: list[str], heads: int) -> Derived:
    """``derived`` with a relative position bias built outside the blocks taken per head: a table with a
    column per head held outside every list of blocks (MPNet's encoder's ``relative_attention_bias``
    embedding, CpmAnt's ``position_bias`` parameter), looked up once for all heads as ``(batch, heads, q,
    k)`` and handed to every attention as ``position_bias``. Each rank's attention takes its heads' rows
    of it (``head_inputs``); the table stays whole, each rank's gradient reaching its heads' columns only,
    so it is summed over tp. Where any attention takes no such argument nothing changes (and
    tensor_parallel/rules.py refuses a table it would not fit)."""
    if (derived.refusal is not None or derived.head_inputs or heads < 2 or not derived.attention
            or Style.PARAM_ROWWISE in derived.tp_plan.values()):
        # (a table per head inside a block, split with its heads, makes a bias the blocks hand on already split:
        # T5's, UDOP's beside its own outside tables)
        return derived
    try:
        inputs = base.get_input_embeddings()
    except (NotImplementedError, AttributeError):  # an audio or convolution model names none
        inputs = None
    tables = []
    for name, module in base.named_modules():
        if any(name == s or name.startswith(s + ".") for s in stacks):
            continue
        if isinstance(module, nn.Embedding) and module.embedding_dim == heads and module is not inputs:
            tables.append(name)
        tables += [join(name, p) for p, param in module.named_parameters(recurse=False)
                   if not isinstance(module, nn.Embedding) and param.dim() == 2 and param.shape[-1] == heads]
    takers = [match_modules(base, pattern) for pattern in derived.attention]
    if not tables or not all(names and HEAD_BIAS_INPUT in inspect.signature(base.get_submodule(names[0]).forward).parameters
                             for names in takers):
        return derived
    return replace(derived, tp_plan={**derived.tp_plan, **dict.fromkeys(tables, Style.REPLICATE_GRAD_SUM)},
                   head_inputs={pattern: {HEAD_BIAS_INPUT: HeadAxis.AFTER_BATCH} for pattern in derived.attention})
