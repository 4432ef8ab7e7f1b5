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

import ast
import inspect
import textwrap
from dataclasses import dataclass

from torch import nn
from transformers.pytorch_utils import Conv1D

from ..arguments import Choice
from .entries import forward_tree, self_path
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
    **dict.fromkeys(("q_proj", "query", "q", "q_lin", "query_proj"), Role.QUERY),
    **dict.fromkeys(("k_proj", "key", "k", "k_lin", "key_proj"), Role.KEY),
    **dict.fromkeys(("v_proj", "value", "v", "v_lin", "value_proj"), Role.VALUE),
    **dict.fromkeys(("o_proj", "out_proj", "o", "out_lin", "attention.output.dense", "attn.c_proj"), Role.OUTPUT),
    # DeBERTa's projections of the relative positions into keys and queries: per head, like keys
    **dict.fromkeys(("pos_key_proj", "pos_query_proj", "pos_proj", "pos_q_proj"), Role.POSITION),
    **dict.fromkeys(("fc1", "fc_in", "c_fc", "up_proj", "gate_proj", "intermediate.dense", "intermediate_dense",
                     "dense_h_to_4h", "lin1", "wi", "wi_0", "wi_1", "w1", "w3"), Role.UP),
    **dict.fromkeys(("fc2", "fc_out", "c_proj", "down_proj", "output.dense", "output_dense", "dense_4h_to_h",
                     "lin2", "wo", "w2"), Role.DOWN),
}
# The attributes an attention module keeps its head width in.
HEAD_DIM_ATTRIBUTES = ("head_dim", "attention_head_size", "head_size", "key_value_proj_dim", "d_kv")
# Integers a forward may read that are no head count even when equal to one (a layer's index).
NOT_COUNTS = ("layer_idx", "layer_id", "layer_index", "block_idx")


@dataclass(frozen=True)
class Derived:
    """A tp plan in ``ModelPolicy``'s terms, or why there is none (``refusal``)."""

    tp_plan: dict[str, Style]
    attr_patches: dict[str, str]
    attention: tuple[str, ...] = ()  # the attention modules' patterns (tp-local rng regions)
    refusal: str | None = None


def _in_out(module: nn.Module) -> tuple[int, int]:
    return (module.nx, module.nf) if isinstance(module, Conv1D) else (module.in_features, module.out_features)


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


def _int_reads(module: nn.Module) -> set[str]:
    """The attributes of ``module`` its forward (and the methods of its own it calls, one level) reads
    as integers."""
    trees = [forward_tree(module)]
    if trees[0] is None:
        return set()
    for node in ast.walk(trees[0]):
        path = self_path(node.func) if isinstance(node, ast.Call) else None
        method = getattr(type(module), path, None) if path and "." not in path else None
        if inspect.isfunction(method):
            try:
                trees.append(ast.parse(textwrap.dedent(inspect.getsource(method))).body[0])
            except (OSError, TypeError, SyntaxError):
                continue
    found = set()
    for tree in trees:
        for node in ast.walk(tree):
            path = self_path(node) if isinstance(node, ast.Attribute) else None
            if path and "." not in path:
                value = getattr(module, path, None)
                if isinstance(value, int) and not isinstance(value, bool):
                    found.add(path)
    return found


def _common_parent(paths: list[str]) -> str:
    parts = [p.split(".")[:-1] for p in paths]
    common = []
    for items in zip(*parts):
        if len(set(items)) != 1:
            break
        common.append(items[0])
    return ".".join(common)


def derive_block(block: nn.Module, *, heads_expected: int | None = None) -> Derived:
    """The rules for one block (paths relative to it), or why none (module docstring). Every attention
    must have ``heads_expected`` heads (the config's, which the patches' values are computed from)."""
    leaves = {name: m for name, m in block.named_modules() if name and isinstance(m, (nn.Linear, Conv1D))}
    roles = {name: role_of(name) for name in leaves}
    queries = [n for n, r in roles.items() if r == Role.QUERY]
    if not queries:
        return Derived({}, {}, refusal="no attention qn_hf can read (query, key, value and output projections)")
    hidden = _in_out(leaves[queries[0]])[0]  # the block's width: what its queries take
    rules: dict[str, Style] = {}
    patches: dict[str, str] = {}
    attention = []
    placed: set[str] = set()
    for q in queries:
        parent = q.rpartition(".")[0]
        group = {r: n for n, r in roles.items()
                 if r in (Role.KEY, Role.VALUE, Role.POSITION) and n.rpartition(".")[0] == parent}
        if Role.KEY not in group or Role.VALUE not in group:
            return Derived({}, {}, refusal=f"{q} has no key and value projection beside it")
        # the output projection: the one under the nearest ancestor of the queries' module holding one
        owner, outputs = parent, []
        while True:
            outputs = [n for n, r in roles.items() if r == Role.OUTPUT and n not in placed
                       and (not owner or n.startswith(owner + "."))]
            if outputs or not owner:
                break
            owner = owner.rpartition(".")[0]
        if len(outputs) != 1:
            return Derived({}, {}, refusal=f"the attention around {q} has no one output projection qn_hf can tell")
        module_path = _common_parent([q, outputs[0]]) if owner != parent else parent
        modules = [block.get_submodule(module_path) if module_path else block, block.get_submodule(parent)]
        head_dim = _head_dim(modules)
        q_in, q_out = _in_out(leaves[q])
        o_in, o_out = _in_out(leaves[outputs[0]])
        if head_dim is None or q_out % head_dim or o_in != q_out or o_out != hidden:
            return Derived({}, {}, refusal=(f"the attention around {q} ({q_in}->{q_out}, output {o_in}->{o_out}) does not "
                                            f"read as heads of one width"))
        heads = q_out // head_dim
        if heads_expected is not None and heads != heads_expected:
            return Derived({}, {}, refusal=(f"the attention around {q} has {heads} heads, the config "
                                            f"num_attention_heads={heads_expected}"))
        kv_out = _in_out(leaves[group[Role.KEY]])[1]
        if kv_out % head_dim or _in_out(leaves[group[Role.VALUE]])[1] != kv_out:
            return Derived({}, {}, refusal=f"the keys and values beside {q} do not read as heads of {head_dim}")
        kv_heads = kv_out // head_dim
        rules[q] = Style.COLWISE
        for name in (group[Role.KEY], group[Role.VALUE]):
            rules[name] = Style.COLWISE if kv_heads == heads else Style.COLWISE_KV
        if Role.POSITION in group:
            rules[group[Role.POSITION]] = Style.COLWISE
        rules[outputs[0]] = Style.ROWWISE
        placed |= {q, *group.values(), outputs[0]}
        for holder_path, holder in {module_path: modules[0], parent: modules[1]}.items():
            for attr in sorted(_int_reads(holder) - set(NOT_COUNTS) - set(HEAD_DIM_ATTRIBUTES)):
                value = getattr(holder, attr)
                local = ("local_kv_groups" if attr == "num_key_value_groups" else "local_heads" if value == heads
                         else "local_kv_heads" if value == kv_heads else "local_q_width" if value == heads * head_dim
                         else None)
                if local is not None:
                    patches[join(holder_path, attr)] = local
        for name, table in (modules[0].named_modules() if module_path else block.named_modules()):
            if isinstance(table, nn.Embedding) and table.embedding_dim == heads and heads > 1:
                # a per-head table (T5's relative attention bias): this rank's heads' columns, looked up
                # by the unchanged module (its output is this rank's heads, what its attention adds)
                rules[join(module_path, name, "weight")] = Style.PARAM_ROWWISE
        attention.append(module_path)
    ups = [n for n, r in roles.items() if r == Role.UP and n not in placed]
    downs = [n for n, r in roles.items() if r in (Role.DOWN, Role.OUTPUT) and n not in placed]
    for up in ups:
        rules[up] = Style.COLWISE
    for down in downs:
        rules[down] = Style.ROWWISE
    widths = {_in_out(leaves[n])[1] for n in ups} | {_in_out(leaves[n])[0] for n in downs}
    if ups or downs:
        if any(_in_out(leaves[n])[0] != hidden for n in ups) or any(_in_out(leaves[n])[1] != hidden for n in downs) \
                or len(widths) != 1 or not ups or not downs:
            return Derived({}, {}, refusal=(f"the MLP of {', '.join(ups + downs)} does not read as hidden -> inner -> "
                                            f"hidden"))
    for name in leaves:
        if name not in rules:
            in_f, out_f = _in_out(leaves[name])
            return Derived({}, {}, refusal=(f"{name} ({type(leaves[name]).__name__} {in_f}->{out_f}) is no projection "
                                            f"qn_hf can place"))
    return Derived(rules, patches, attention=tuple(attention))


def derive_structure(base: nn.Module, *, stacks: list[str], heads: int | None) -> Derived:
    """The tp rules of every list of blocks in ``stacks`` (paths in ``base``), each from its first block
    and applied to all (``{stack}.*.{rule}``); every block of a list must be of one class."""
    tp_plan: dict[str, Style] = {}
    patches: dict[str, str] = {}
    attention: list[str] = []
    for stack in stacks:
        blocks = list(base.get_submodule(stack))
        if len({type(b) for b in blocks}) != 1:
            return Derived({}, {}, refusal=f"the blocks of {stack} are not of one class")
        derived = derive_block(blocks[0], heads_expected=heads)
        if derived.refusal is not None:
            return Derived({}, {}, refusal=f"{stack}.0: {derived.refusal}")
        tp_plan.update({f"{stack}.*.{n}": s for n, s in derived.tp_plan.items()})
        patches.update({f"{stack}.*.{n}": v for n, v in derived.attr_patches.items()})
        attention += [f"{stack}.*.{n}" if n else f"{stack}.*" for n in derived.attention]
    return Derived(tp_plan, patches, attention=tuple(attention))
