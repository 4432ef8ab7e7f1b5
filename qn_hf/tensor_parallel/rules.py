"""A policy rule against the module it names: the exact type its style reproduces, sizes tp divides,
and the KV heads each attention module really holds. Reads the model only (no communication).
"""

from __future__ import annotations

from torch import nn
from transformers.pytorch_utils import Conv1D

from ..policies.embedding_types import adapter_for
from ..policies.entries import forward_tree, self_references
from ..policies.heads import HeadLayout, attention_layout, divisors
from ..policies.module_kinds import in_out_features, is_projection, plain_linear, position_wise
from ..policies.styles import (
    COLUMN_STYLES,
    EMBEDDING_STYLES,
    LINEAR_STYLES,
    PARAM_STYLES,
    VOCAB_ROWS,
    Style,
    packed_parts,
    param_shard_dim,
)


def check_rule(model: nn.Module, name: str, style: Style, layout: HeadLayout, tp: int) -> None:
    """A rule's module has the exact type its style reproduces, and tp divides what it splits."""
    if style in PARAM_STYLES:
        owner, _, pname = name.rpartition(".")
        param = getattr(model.get_submodule(owner), pname)
        dim = param_shard_dim(style, param.dim())
        parts = packed_parts(style)
        if dim is not None and param.shape[dim] % (parts * tp):
            raise ValueError(f"tp={tp} does not divide the {parts} part(s) of {name} along dim {dim} "
                             f"(shape {tuple(param.shape)}); use a tp that divides {param.shape[dim] // parts}")
        return
    if style not in EMBEDDING_STYLES and style not in LINEAR_STYLES:
        return  # kept whole, or hooks on an unchanged module: nothing to split
    module = model.get_submodule(name)
    if style in EMBEDDING_STYLES:
        if adapter_for(module) is None:
            raise ValueError(
                f"rule {style!r} on {name}: {type(module).__name__} is not nn.Embedding nor a subclass whose forward "
                f"qn_hf reproduces (qn_hf.policies.embedding_types); swapping it would drop what it adds. Keep it whole with "
                f"'replicate' in a policy, or use tp=1")
        width = module.embedding_dim if style == Style.EMBEDDING_COLWISE else None
        if width is not None and width % tp:
            raise ValueError(f"tp={tp} does not divide embedding_dim={width} of {name}")
        return
    if not plain_linear(module):
        raise ValueError(
            f"rule {style!r} on {name}: {type(module).__name__} is not exactly nn.Linear or Conv1D (nor a subclass whose "
            f"forward is x @ W.T + b); qn_hf swaps exact types only, so that nothing a subclass adds is lost. Keep it "
            f"whole with 'replicate' in a policy, or use tp=1")
    if isinstance(module, Conv1D):
        in_f, out_f = module.nx, module.nf
    else:
        in_f, out_f = module.in_features, module.out_features
    if style.startswith("rowwise"):
        if in_f % tp:
            raise ValueError(f"tp={tp} does not divide in_features={in_f} of {name}")
    elif style == Style.COLWISE_SHARED_KV:
        here = attention_layout(model.get_submodule(name.rpartition(".")[0]), layout)
        if out_f != (here.heads + 2) * here.head_dim:
            raise ValueError(f"{name} has {out_f} outputs, not (num_attention_heads + 2) * head_dim = "
                             f"({here.heads} + 2) * {here.head_dim} (every head's queries, one key and one value)")
    elif style == Style.COLWISE_KV:
        here = attention_layout(model.get_submodule(name.rpartition(".")[0]), layout)  # a layer's own heads
        if out_f != here.kv_heads * here.head_dim:
            raise ValueError(
                f"{name} has {out_f} outputs, not num_key_value_heads*head_dim = {here.kv_heads}*{here.head_dim}"
            )
    elif style.startswith("colwise"):
        parts = packed_parts(style)
        if out_f % (parts * tp):
            raise ValueError(f"tp={tp} does not divide the {parts} output part(s) of {name} (out_features={out_f})")
        head_dim = getattr(model.get_submodule(name.rpartition(".")[0]), "head_dim", None)
        if parts > 1 and isinstance(head_dim, int) and head_dim > 0 and out_f // parts % (tp * head_dim):
            # an attention's projection packed in parts of heads (DiffLlama's paired halves): each rank's share of
            # each part must be whole heads
            per_part = out_f // parts // head_dim
            raise ValueError(f"tp={tp} does not divide the {per_part} heads of each of the {parts} parts of {name} "
                             f"(out_features={out_f}, head_dim={head_dim}); use a tp among {divisors(per_part)}")


def split_kv_per_module(model: nn.Module, rules: dict[str, str], layout: HeadLayout) -> dict[str, str]:
    """``colwise_kv`` stays where the attention holds the config's KV heads; where it holds its own
    number (``attention_layout``) and tp divides it, a plain column split keeps whole heads."""
    out = dict(rules)
    for name, style in rules.items():
        if style != Style.COLWISE_KV:
            continue
        here = attention_layout(model.get_submodule(name.rpartition(".")[0]), layout)
        if here.kv_heads != layout.kv_heads:
            if here.kv_replicas > 1:
                raise ValueError(f"tp={layout.tp} exceeds the {here.kv_heads} KV heads of {name.rpartition('.')[0]}, unlike "
                                 f"the config's {layout.kv_heads}; use a tp that divides {here.kv_heads}")
            out[name] = "colwise"
    return out


def check_ties(model: nn.Module, rules: dict[str, str]) -> None:
    """Parameters tied by identity (an LM head sharing the embedding) must be split the same way,
    or the swap would untie them (one side becomes a new sharded parameter)."""
    by_id: dict[int, list[str]] = {}
    for name, param in model.named_parameters(remove_duplicate=False):
        by_id.setdefault(id(param), []).append(name)
    # a module registered under several names (T5's shared embedding is also each stack's embed_tokens)
    # takes the rule given to any of them: the swap replaces it under all (apply.py)
    paths: dict[int, list[str]] = {}
    for path, module in model.named_modules(remove_duplicate=False):
        paths.setdefault(id(module), []).append(path)
    ruled = {alias: rules[path] for same in paths.values() for path in same if path in rules for alias in same}
    # a parameter also registered on a module with children (BERT's head keeps its decoder's bias as its
    # own ``bias``) is no layer using it there: the swap points that registration at the new shard
    leaves = {path for path, module in model.named_modules(remove_duplicate=False) if not list(module.children())}
    for names in by_id.values():
        names = [n for n in names if n.rpartition(".")[0] in leaves or n in rules] or names
        styles = {rules.get(n, ruled.get(n.rpartition(".")[0], "whole")) for n in names}
        styles = {"vocabulary rows" if s in VOCAB_ROWS else s for s in styles}
        if len(names) > 1 and len(styles) > 1:
            raise ValueError(f"tied parameters {names} would be split differently ({sorted(styles)}); give their "
                             f"modules the same kind of rule (e.g. vocab_embedding with vocab_colwise) or keep both whole")


def check_split_norms(model: nn.Module, rules: dict[str, str]) -> None:
    """A norm with parameters that the forward of a row-parallel layer's module runs between that
    module's column layers and the row layer, over the whole width the row layer takes (BitNet's
    ``attn_sub_norm`` on the attention's output, its ``ffn_sub_norm`` in the MLP): at tp each rank holds
    a slice of those features there, so the norm would see a slice and its weight would not fit. A norm
    over each head is a rule of its own (its width the head's); one after the row layer (BERT's) sees
    the summed output. Read from the module's forward: the lines it first names each child on."""
    for name, style in rules.items():
        if style != Style.ROWWISE or "." not in name:
            continue
        layer = model.get_submodule(name)
        if not is_projection(layer):
            continue
        width = in_out_features(layer)[0]
        parent, _, row = name.rpartition(".")
        tree = forward_tree(model.get_submodule(parent))
        uses = self_references(tree) if tree is not None else {}
        first = {child: min(line for line, _ in found) for child, found in uses.items() if found}
        columns = [first[n[len(parent) + 1:].partition(".")[0]] for n, s in rules.items()
                   if n.startswith(parent + ".") and s in COLUMN_STYLES and n[len(parent) + 1:].partition(".")[0] in first]
        if row not in first or not columns:
            continue
        for sub, module in model.get_submodule(parent).named_modules():
            full = f"{parent}.{sub}" if sub else parent
            params = list(module.parameters(recurse=False))
            line = first.get(sub.partition(".")[0])
            if (sub and full not in rules and not is_projection(module) and position_wise(module) and params
                    and all(p.shape[-1] == width for p in params) and line is not None
                    and min(columns) < line < first[row]):
                raise ValueError(f"{full} ({type(module).__name__}) normalizes over the {width} features {name} "
                                 f"takes, which tp splits across ranks; use tp=1 (data and pipeline parallelism "
                                 f"still apply)")


def check_head_tables(model: nn.Module, rules: dict[str, str], layout: HeadLayout, *, head_inputs: bool) -> None:
    """An embedding table with one column per attention head that no rule reaches (a relative position bias
    looked up once before the blocks and added to every layer's scores, where the attention takes it under
    no argument qn_hf knows): at tp each rank's attention holds a share of the heads, and the whole bias would
    not fit its scores. T5 keeps its table inside the attention, where the heads' rules reach it; ``head_inputs``
    (a policy's inputs given per head, which slice such a bias where the attention takes it: MPNet's and
    CpmAnt's, policies/stacks.py) vouch for the rest."""
    if head_inputs or layout.heads < 2:
        return
    for name, module in model.named_modules():
        holder = name.rpartition(".")[0]
        if (isinstance(module, nn.Embedding) and module.embedding_dim == layout.heads and name not in rules
                and not any(name.startswith(r + ".") or r.startswith(name + ".") for r in rules)
                and any(r.startswith(holder + ".") for r in rules)  # beside blocks tp splits (not an audio tower's)
                and module is not model.get_input_embeddings()):
            raise ValueError(f"{name} ({type(module).__name__}) holds a value per attention head ({layout.heads}) that is "
                             f"added to every layer's attention scores, which tp splits across ranks by head; use tp=1 "
                             f"(data and pipeline parallelism still apply)")
