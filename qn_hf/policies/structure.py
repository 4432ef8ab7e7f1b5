"""A tensor-parallel plan derived from a model's module structure, for models transformers declares
no plan for and no policy of ours describes (BERT, T5, BART, GPT-J, OPT, CLIP, Whisper, ...).

Attention and MLP layers are found in one block of each list of blocks by the names transformers'
modeling files give their projections (``ROLES``, data), each confirmed by its shape against the
module's own head count and width:

* queries ``hidden -> heads x head_dim``, keys and values ``hidden -> kv_heads x head_dim`` (column
  splits: a rank computes its heads), the output ``heads x head_dim -> hidden`` (row split, summed);
* an MLP's up (and gate) ``hidden -> inner`` (columns), its down ``inner -> hidden`` (rows).

Every linear layer of a block must take one of these roles with its shape: a layer the derivation
cannot place (a fused q|k|v, whose row order only the model's forward knows, a gate on the whole
width) refuses tp for the model, naming it, never a guess. The attention module's forward (and the
methods of its own it calls) is read for the integers it reshapes with: one equal to the heads, the
KV heads or the query width is patched to this rank's share; a per-head table (T5's relative
attention bias) is split by heads. What remains unproven by reading is proven by the model zoo,
each derived type against the plain model (tests/test_heads_zoo.py).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from torch import nn

from ..arguments import Choice
from .forward_reads import halves, int_reads, pairs_heads, sized_by, width_read_off_input
from .fused import FusedAttention, FusedLayout
from .module_kinds import in_out_features, is_projection, position_wise
from .patterns import join
from .styles import Style


class Role(Choice):
    """What a projection does in a block."""

    QUERY = "query projection"
    KEY = "key projection"
    VALUE = "value projection"
    OUTPUT = "output projection"  # an attention's output
    POSITION = "position projection"  # DeBERTa's projections of the relative positions, per head like keys
    UP = "mlp up"  # an MLP's up or gate
    DOWN = "mlp down"  # an MLP's down


# The names transformers gives projections, by role; a path's longest matching suffix decides
# (``attention.output.dense`` is an output, ``output.dense`` an MLP's down). Names two roles share
# (``c_proj``, ``dense``) are an attention's output only beside its q, k and v.
ROLES: dict[str, Role] = {
    **dict.fromkeys(("q_proj", "query", "q", "q_lin", "query_proj", "Wq", "project_q"), Role.QUERY),
    **dict.fromkeys(("k_proj", "key", "k", "k_lin", "key_proj", "Wk", "project_k"), Role.KEY),
    **dict.fromkeys(("v_proj", "value", "v", "v_lin", "value_proj", "Wv", "project_v"), Role.VALUE),
    **dict.fromkeys(("o_proj", "out_proj", "o", "out_lin", "attention.output.dense", "attn.c_proj",
                     "self_attention.dense", "attention.dense", "self_attn.dense", "multi_head_attention.dense",
                     "attn.Wo", "attention_out"), Role.OUTPUT),
    # DeBERTa's projections of the relative positions into keys and queries: per head, like keys
    **dict.fromkeys(("pos_key_proj", "pos_query_proj", "pos_proj", "pos_q_proj"), Role.POSITION),
    **dict.fromkeys(("fc1", "fc_in", "c_fc", "up_proj", "gate_proj", "intermediate.dense", "intermediate_dense",
                     "dense_h_to_4h", "lin1", "wi", "wi_0", "wi_1", "w1", "w3", "Wi", "w_in.w_0", "w_in.w_1"), Role.UP),
    **dict.fromkeys(("fc2", "fc_out", "c_proj", "down_proj", "output.dense", "output_dense", "dense_4h_to_h",
                     "lin2", "wo", "w2", "mlp.Wo", "w_out"), Role.DOWN),
}
# The attributes an attention module keeps its head width in.
HEAD_DIM_ATTRIBUTES = ("head_dim", "attention_head_size", "head_size", "key_value_proj_dim", "d_kv", "depth", "dim_head")
# Integers a forward may read that are no head count even when equal to one (a layer's index).
NOT_COUNTS = ("layer_idx", "layer_id", "layer_index", "block_idx")


@dataclass(frozen=True)
class Derived:
    """A tp plan in ``ModelPolicy``'s terms, or why there is none (``refusal``)."""

    tp_plan: dict[str, Style]
    attr_patches: dict[str, str]
    attention: tuple[str, ...] = ()  # the attention modules' patterns (tp-local rng regions)
    refusal: str | None = None
    head_inputs: dict[str, dict] = field(default_factory=dict)  # attention module -> inputs per head (fused.py)


def role_of(path: str) -> Role | None:
    """The role a projection's path names (longest matching suffix of ``ROLES``), or None."""
    parts = path.split(".")
    for length in range(min(3, len(parts)), 0, -1):
        role = ROLES.get(".".join(parts[-length:]))
        if role is not None:
            return role
    return None


def _head_dim(modules: list[nn.Module]) -> int | None:
    for module in modules:
        for name in HEAD_DIM_ATTRIBUTES:
            value = getattr(module, name, None)
            if isinstance(value, int) and not isinstance(value, bool) and value > 0:
                return value
    return None


def _sequential_roles(block: nn.Module, roles: dict[str, Role | None]) -> None:
    """An MLP built as ``nn.Sequential(Linear, activation, Linear)`` (CTRL's ``ffn``) names its layers by
    position only: the first is its up, the last its down, where nothing else in it has parameters."""
    for name, module in block.named_modules():
        if not isinstance(module, nn.Sequential):
            continue
        children = list(module.named_children())
        linear = [c for c, m in children if is_projection(m)]
        others = [m for c, m in children if c not in linear]
        if (len(linear) == 2 and (linear[0], linear[1]) == (children[0][0], children[-1][0])
                and all(position_wise(m) and not any(True for _ in m.parameters()) for m in others)):
            for child, role in zip(linear, (Role.UP, Role.DOWN)):
                if roles.get(join(name, child), Role.UP) is None:
                    roles[join(name, child)] = role


def _common_parent(paths: list[str]) -> str:
    parts = [p.split(".")[:-1] for p in paths]
    common = []
    for items in zip(*parts):
        if len(set(items)) != 1:
            break
        common.append(items[0])
    return ".".join(common)


def _output_of(roles: dict[str, Role | None], parent: str, placed: set[str]) -> tuple[str, list[str]]:
    """The attention output projection(s) under the nearest ancestor of ``parent`` holding one."""
    owner = parent
    while True:
        outputs = [n for n, r in roles.items() if r == Role.OUTPUT and n not in placed
                   and (not owner or n.startswith(owner + "."))]
        if outputs or not owner:
            return owner, outputs
        owner = owner.rpartition(".")[0]


def _patches(holders: dict[str, nn.Module], *, heads: int, kv_heads: int, head_dim: int) -> dict[str, str]:
    """The integers an attention module reads that count its heads, KV heads or query width: patched to
    this rank's share (a single shared KV head stays 1 on every rank)."""
    patches = {}
    for holder_path, holder in holders.items():
        for attr in sorted(int_reads(holder) - set(NOT_COUNTS) - set(HEAD_DIM_ATTRIBUTES)):
            value = getattr(holder, attr)
            local = ("local_kv_groups" if attr == "num_key_value_groups" else None if value == 1
                     else "local_heads" if value == heads else "local_kv_heads" if value == kv_heads
                     else "local_q_width" if value == heads * head_dim else None)
            if local is not None:
                patches[join(holder_path, attr)] = local
    return patches


# the style that splits a fused q|k|v of each layout (fused.py)
FUSED_STYLES = {FusedLayout.PER_HEAD: Style.COLWISE, FusedLayout.PER_KV_GROUP: Style.COLWISE,
                FusedLayout.BLOCKS: Style.COLWISE_PACKED3, FusedLayout.SHARED_KV: Style.COLWISE_SHARED_KV}


def derive_block(block: nn.Module, *, heads_expected: int | None = None, fused: FusedAttention | None = None,
                 config=None, hidden: int | None = None) -> Derived:
    """The rules for one block (paths relative to it), or why none (module docstring). Every attention
    must have ``heads_expected`` heads (the config's, which the patches' values are computed from).
    ``fused``: the architecture's fused q|k|v (fused.py), its layout read off ``config``. ``hidden``: the
    stack's width, for a block of a hybrid stack that has no attention (a state-space or convolution
    mixer beside other blocks' attention): its MLP splits as any, its other projections stay whole."""
    leaves = {name: m for name, m in block.named_modules() if name and is_projection(m)}
    roles = {name: role_of(name) for name in leaves}
    _sequential_roles(block, roles)
    rules: dict[str, Style] = {}
    patches: dict[str, str] = {}
    head_inputs: dict[str, dict] = {}
    attention = []
    placed: set[str] = set()
    # (the queries' projection, its key and value beside it; a fused one's layout)
    groups: list[tuple[str, dict[Role, str], FusedLayout | None]] = []
    if fused is not None and fused.fused.projection in leaves:
        refused = next((why for switch, why in fused.refused_when.items() if getattr(config, switch, False)), None)
        if refused is not None:
            return Derived({}, {}, refusal=refused)
        groups.append((fused.fused.projection, {}, fused.fused.layout_for(config)))
        roles[fused.fused.projection] = None
        head_inputs = {path: dict(inputs) for path, inputs in fused.head_inputs.items()}
    for q in (n for n, r in roles.items() if r == Role.QUERY):
        groups.append((q, {r: n for n, r in roles.items()
                           if r in (Role.KEY, Role.VALUE, Role.POSITION) and n.rpartition(".")[0] == q.rpartition(".")[0]},
                       None))
    if not groups and hidden is None:
        return Derived({}, {}, refusal=NO_ATTENTION)
    rebuilt = next((name for name, m in block.named_modules() if callable(getattr(m, "set_attention_type", None))), None)
    if rebuilt is not None:
        # BigBird's attention swaps its own module for another kind (block-sparse <-> full, by the sequence's
        # length) inside forward: a fresh module at the config's widths, around the split projections
        return Derived({}, {}, refusal=f"{rebuilt or 'the block'} rebuilds its attention module in forward "
                                       f"(set_attention_type), which would undo the split")
    hidden = in_out_features(leaves[groups[0][0]])[0] if groups else hidden  # the block's width: its queries' input
    for q, group, layout in groups:
        parent = q.rpartition(".")[0]
        if layout is None and (Role.KEY not in group or Role.VALUE not in group):
            return Derived({}, {}, refusal=f"{q} has no key and value projection beside it")
        owner, outputs = _output_of(roles, parent, placed)
        if len(outputs) != 1:
            return Derived({}, {}, refusal=f"the attention around {q} has no one output projection qn_hf can tell")
        module_path = _common_parent([q, outputs[0]]) if owner != parent else parent
        modules = [block.get_submodule(module_path) if module_path else block, block.get_submodule(parent)]
        o_in, o_out = in_out_features(leaves[outputs[0]])
        # a module that keeps no head width (OpenAI-GPT's splits by x.size(-1) // n_head): the config's heads
        head_dim = _head_dim(modules) or (o_in // heads_expected if heads_expected and not o_in % heads_expected
                                          else None)
        if head_dim is None or o_in % head_dim or o_out != hidden:
            return Derived({}, {}, refusal=f"the attention around {q} (output {o_in}->{o_out}) does not read as heads")
        heads = o_in // head_dim
        local = next((w for m in modules if (w := width_read_off_input(m)) is not None), None)
        if local is not None:
            return Derived({}, {}, refusal=(f"the attention around {q} reshapes its output by {local}, the width its "
                                            f"forward reads off its input's size, which is whole on every rank"))
        if heads_expected is not None and heads != heads_expected:
            return Derived({}, {}, refusal=(f"the attention around {q} has {heads} heads, the config "
                                            f"num_attention_heads={heads_expected}"))
        q_out = in_out_features(leaves[q])[1]
        if layout is None:
            kv_out = in_out_features(leaves[group[Role.KEY]])[1]
            if q_out != heads * head_dim or kv_out % head_dim or in_out_features(leaves[group[Role.VALUE]])[1] != kv_out:
                return Derived({}, {}, refusal=f"the queries, keys and values of {q} do not read as heads of {head_dim}")
            kv_heads = kv_out // head_dim
            # heads paired across the two halves (pairs_heads): a rank holds its share of each half, of the
            # queries, keys and values alike (kept whole, rules.py refuses a tp that does not split each half)
            paired = any(pairs_heads(m) for m in modules)
            rules[q] = Style.COLWISE_PACKED2 if paired else Style.COLWISE
            for name in (group[Role.KEY], group[Role.VALUE]):
                rules[name] = (Style.COLWISE_PACKED2 if paired else Style.COLWISE if kv_heads == heads
                               else Style.COLWISE_KV)
            if Role.POSITION in group:
                rules[group[Role.POSITION]] = Style.COLWISE
        else:  # a fused q|k|v: (heads + 2 kv_heads) x head_dim rows
            if q_out % head_dim or (q_out // head_dim - heads) % 2:
                return Derived({}, {}, refusal=f"the fused {q} ({q_out} outputs) does not read as heads of {head_dim}")
            kv_heads = (q_out // head_dim - heads) // 2
            rules[q] = FUSED_STYLES[layout]
        rules[outputs[0]] = Style.ROWWISE
        placed |= {q, *group.values(), outputs[0]}
        patches.update(_patches({module_path: modules[0], parent: modules[1]}, heads=heads, kv_heads=kv_heads,
                                head_dim=head_dim))
        for name, table in (modules[0].named_modules() if module_path else block.named_modules()):
            if (position_wise(table) and any(True for _ in table.parameters())
                    and all(p.shape[-1] == head_dim for p in table.parameters())):
                # a norm over each head (Persimmon's q and k norms): whole on every rank, each applying it to
                # its own heads only, so its gradients are summed over tp
                rules[join(module_path, name)] = Style.REPLICATE_GRAD_SUM
            if isinstance(table, nn.Embedding) and table.embedding_dim == heads and heads > 1:
                # a per-head table (T5's relative attention bias): this rank's heads' columns, looked up
                # by the unchanged module (its output is this rank's heads, what its attention adds)
                rules[join(module_path, name, "weight")] = Style.PARAM_ROWWISE
        for name, param in modules[0].named_parameters(recurse=False):
            per_head, per_width = param.dim() == 1 and param.shape[0] == heads and heads > 1, param.shape[-1] == head_dim
            if per_head and per_width:  # as many heads as a head's width: what it counts, its __init__ says
                sized = sized_by(modules[0], name)
                per_head = any(s.endswith("_heads") for s in sized)  # num_attention_heads, num_heads, n_heads
                per_width = any(s in HEAD_DIM_ATTRIBUTES for s in sized)
                if per_head == per_width:
                    return Derived({}, {}, refusal=(f"{join(module_path, name)} holds {heads} values, as many as the heads "
                                                    f"and as a head's width, and its module's __init__ does not say "
                                                    f"which it counts"))
            if per_head:
                rules[join(module_path, name)] = Style.PARAM_COLWISE  # one value per head (gpt-oss's sinks)
            elif per_width:
                # a weight over a head's width that every head uses (DiffLlama's lambda vectors): whole on every
                # rank, each applying it to its own heads only, so its gradients are summed over tp
                rules[join(module_path, name)] = Style.REPLICATE_GRAD_SUM
        for name, inner in (modules[0].named_modules() if module_path else ()):
            full = join(module_path, name)
            if (name and not is_projection(inner) and heads > 1
                    and not any(r == full or r.startswith(full + ".") for r in rules)
                    and any(heads in p.shape for p in inner.parameters(recurse=False))):
                # a module inside the attention with weights over its heads that no rule here splits
                # (Nystromformer's depthwise convolution over the heads' values): whole, it would not fit a
                # rank's heads, and how it reads them is its own
                return Derived({}, {}, refusal=f"{full} ({type(inner).__name__}) holds weights over the {heads} heads, "
                                               f"which qn_hf cannot split with them")
        for name, leaf in leaves.items():
            if (name not in rules and (not module_path or name.startswith(module_path + "."))
                    and in_out_features(leaf) == (hidden, heads) and heads > 1):
                rules[name] = Style.COLWISE  # a gate per head (LFM3's g_proj): this rank's heads' gates
                placed.add(name)
        attention.append(module_path)
    ups = [n for n, r in roles.items() if r == Role.UP and n not in placed]
    # an output projection left over is an MLP's down (GPT-2's mlp.c_proj); beside no attention, a mixer's
    # (LFM3's conv.out_proj), which stays whole with the rest of the mixer
    downs = [n for n, r in roles.items() if (r == Role.DOWN or r == Role.OUTPUT and groups) and n not in placed]
    for up in ups:
        rules[up] = Style.COLWISE
    for down in downs:
        rules[down] = Style.ROWWISE
    mlp = _common_parent(ups + downs) if ups and downs else ""
    if len(ups) == 1 and len(downs) == 1 and in_out_features(leaves[ups[0]])[1] == 2 * in_out_features(leaves[downs[0]])[0] \
            and halves(block.get_submodule(mlp) if mlp else block):
        # the gate and the value side by side in one up projection (ModernBERT's Wi, Moshi's fc1): each half
        # split alike, so a rank's gate meets its own values
        rules[ups[0]] = Style.COLWISE_PACKED2
    widths = {in_out_features(leaves[n])[1] // (2 if rules[n] == Style.COLWISE_PACKED2 else 1) for n in ups} \
        | {in_out_features(leaves[n])[0] for n in downs}
    if ups or downs:
        if any(in_out_features(leaves[n])[0] != hidden for n in ups) or any(in_out_features(leaves[n])[1] != hidden for n in downs) \
                or len(widths) != 1 or not ups or not downs:
            return Derived({}, {}, refusal=(f"the MLP of {', '.join(ups + downs)} does not read as hidden -> inner -> "
                                            f"hidden"))
        others = [n for n in leaves if n not in ups + downs and (not mlp or n.startswith(mlp + "."))]
        if not groups and others:
            # beside no attention the up and down must be a module of their own (or the block: XLM's ffns): a
            # mixer's projections named alike (an up, a recurrence, a down) would not split as an MLP does
            return Derived({}, {}, refusal=f"{NO_ATTENTION}, nor an MLP module of its own ({', '.join(ups + downs)})")
    for name in _residual_adapters(leaves, rules, hidden=hidden, attention=attention) if groups else ():
        rules[name] = Style.REPLICATE
    for name in leaves:
        if name not in rules and not groups:
            # a mixer without heads, on the whole residual stream every tp rank holds: computed whole on
            # each, its gradients alike on each (under sequence parallelism a whole region, gathered along
            # the sequence: tensor_parallel/sequence_parallel.py)
            rules[name] = Style.REPLICATE
        elif name not in rules:
            in_f, out_f = in_out_features(leaves[name])
            return Derived({}, {}, refusal=(f"{name} ({type(leaves[name]).__name__} {in_f}->{out_f}) is no projection "
                                            f"qn_hf can place"))
    return Derived(rules, patches, attention=tuple(attention), head_inputs=head_inputs)


def _residual_adapters(leaves: dict[str, nn.Module], rules: dict[str, Style], *, hidden: int,
                       attention: list[str]) -> list[str]:
    """The projections no rule placed that, module by module, chain the block's width back to itself
    outside its attention (X-MOD's per-language bottleneck adapters, hidden -> r -> hidden, run on the
    MLP's output after its row-parallel projection summed it): kept whole on every rank, computed on
    the whole residual stream. Where one reads a rank's share instead (its width equal to a split's),
    its gradient differs between the ranks, and the first step's check refuses it
    (tensor_parallel/replica_check.py)."""
    by_parent: dict[str, list[str]] = {}
    for name in leaves:
        if name not in rules and not any(a == "" or name.startswith(a + ".") for a in attention):
            by_parent.setdefault(name.rpartition(".")[0], []).append(name)
    chained = []
    for names in by_parent.values():
        widths = [in_out_features(leaves[n]) for n in names]
        if (widths[0][0] == hidden and widths[-1][1] == hidden
                and all(out == nxt for (_, out), (nxt, _) in zip(widths, widths[1:]))):
            chained += names
    return chained


NO_ATTENTION = "no attention qn_hf can read (query, key, value and output projections)"
