"""What a module's forward reads, from its source, for the derivation (structure.py, stack_cut.py):
the integer attributes it reads (head counts and widths to patch), a width it unpacks off its input
and reshapes with (which no patch reaches), an up projection it cuts in halves, heads it pairs, and what an
encoder-decoder's forward reads off the encoder's output."""

from __future__ import annotations

import ast
import inspect
import textwrap

from torch import nn
from transformers.modeling_outputs import BaseModelOutput

from .entries import forward_tree, method_tree, self_path


def _in_slice(node: ast.AST, parents: dict) -> bool:
    """Whether ``node`` is read as a slice's bound (``q[..., : self.rotary_ndims]``): a width within a
    head, never a count of heads, though its value may equal one (StableLM's rotary_ndims)."""
    while node in parents:
        node = parents[node]
        if isinstance(node, ast.Slice):
            return True
        if isinstance(node, ast.stmt):
            return False
    return False


def int_reads(module: nn.Module) -> set[str]:
    """The attributes of ``module`` its forward (and the methods of its own it calls, one level) reads
    as integers, other than as a slice's bound."""
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
        parents = {child: parent for parent in ast.walk(tree) for child in ast.iter_child_nodes(parent)}
        for node in ast.walk(tree):
            path = self_path(node) if isinstance(node, ast.Attribute) else None
            if path and "." not in path and not _in_slice(node, parents):
                value = getattr(module, path, None)
                if isinstance(value, int) and not isinstance(value, bool):
                    found.add(path)
    return found


def halves(module: nn.Module) -> bool:
    """Whether ``module``'s forward cuts a tensor into two halves of its last dim (``x.chunk(2, dim=-1)``,
    ``x.view(b, s, 2, -1)``): a gated MLP whose up projection holds the gate and the value side by side."""
    tree = forward_tree(module)
    for node in ast.walk(tree) if tree is not None else ():
        if not (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)):
            continue
        values = [a.value if isinstance(a, ast.Constant) else -a.operand.value
                  if isinstance(a, ast.UnaryOp) and isinstance(a.op, ast.USub) and isinstance(a.operand, ast.Constant)
                  else None for a in node.args]
        if node.func.attr == "chunk" and values[:1] == [2] and all(
                k.arg != "dim" or (isinstance(k.value, ast.UnaryOp) and k.value.operand.value == 1) for k in node.keywords):
            return True
        if node.func.attr in ("view", "reshape") and values[-2:] == [2, -1]:
            return True
    return False


def pairs_heads(module: nn.Module) -> bool:
    """Whether ``module``'s forward cuts a tensor into two halves along the heads' axis (``torch.chunk(x, 2,
    dim=1)`` of ``(batch, heads, seq, head_dim)``, ``dim=2`` of ``(batch, seq, heads, head_dim)``): DiffLlama's
    differential attention pairs head i of the first half with head i of the second (and the values' first
    half of KV heads with their second). A rank holding a contiguous share of the heads would pair its own
    heads with each other; holding the same share of each half, it pairs them as the whole model does."""
    tree = forward_tree(module)
    for node in ast.walk(tree) if tree is not None else ():
        if not (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr == "chunk"):
            continue
        parts = [a.value for a in node.args if isinstance(a, ast.Constant)]
        dims = [k.value.value for k in node.keywords if k.arg == "dim" and isinstance(k.value, ast.Constant)]
        if parts[:1] == [2] and dims in ([1], [2]):
            return True
    return False


def sized_by(module: nn.Module, parameter: str) -> set[str]:
    """The names the ``__init__`` of ``module`` sizes its parameter ``parameter`` with (``self.sinks =
    nn.Parameter(torch.empty(config.num_attention_heads))``: ``config``, ``num_attention_heads``, ...): what it
    counts where its shape alone cannot tell (as many heads as a head's width)."""
    tree = method_tree(module, "__init__")
    for node in ast.walk(tree) if tree is not None else ():
        if isinstance(node, ast.Assign) and any(self_path(t) == parameter for t in node.targets):
            return {n.id for n in ast.walk(node.value) if isinstance(n, ast.Name)} | \
                {n.attr for n in ast.walk(node.value) if isinstance(n, ast.Attribute)}
    return set()


def width_read_off_input(module: nn.Module) -> str | None:
    """The local name ``module``'s forward unpacks its input's width into (``bsz, tgt_len, embed_dim =
    hidden_states.size()``) and then reshapes with (TrOCR's ``attn_output.reshape(bsz, tgt_len,
    embed_dim)``), or hands a record of sizes by keyword (PegasusX's ``DimensionInfo(hidden_dim=
    token_hidden_states.shape[2])``, reshaping by ``dim.hidden_dim``): the whole width, where a rank's
    heads hold a share. No patch reaches a local name or a record the forward builds."""
    tree = forward_tree(module)
    if tree is None or len(tree.args.args) < 2:
        return None
    arg = tree.args.args[1].arg
    widths, fields = set(), set()
    for node in ast.walk(tree):
        if isinstance(node, ast.keyword) and node.arg and _last_size_of(node.value, arg):
            fields.add(node.arg)
        if (isinstance(node, ast.Assign) and len(node.targets) == 1 and isinstance(node.targets[0], ast.Tuple)
                and node.targets[0].elts and isinstance(node.targets[0].elts[-1], ast.Name)):
            value = node.value.func if isinstance(node.value, ast.Call) else node.value
            if (isinstance(value, ast.Attribute) and value.attr in ("size", "shape")
                    and isinstance(value.value, ast.Name) and value.value.id == arg):
                widths.add(node.targets[0].elts[-1].id)
    for node in ast.walk(tree):
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr in ("view", "reshape"):
            used = [a.id for a in node.args if isinstance(a, ast.Name) and a.id in widths]
            used += [f"{a.value.id}.{a.attr}" for a in node.args if isinstance(a, ast.Attribute)
                     and a.attr in fields and isinstance(a.value, ast.Name)]
            if used:
                return used[0]
    return None


def _last_size_of(node: ast.AST, arg: str) -> bool:
    """Whether ``node`` reads ``arg``'s width: ``arg.shape[2]``, ``arg.shape[-1]``, ``arg.size(2)`` or ``arg.size(-1)``
    (a hidden-states input of three dimensions)."""
    if isinstance(node, ast.Subscript) and isinstance(node.value, ast.Attribute) and node.value.attr == "shape":
        base, index = node.value.value, node.slice
    elif isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr == "size" and node.args:
        base, index = node.func.value, node.args[0]
    else:
        return False
    value = index.value if isinstance(index, ast.Constant) else -index.operand.value \
        if isinstance(index, ast.UnaryOp) and isinstance(index.op, ast.USub) and isinstance(index.operand, ast.Constant) \
        else None
    return isinstance(base, ast.Name) and base.id == arg and value in (2, -1)


def encoder_output_reads(model: nn.Module, base: nn.Module) -> list[str]:
    """What the task and base forwards read off ``encoder_outputs`` besides what the last stage hands
    them (a ``BaseModelOutput`` of the encoder's last hidden state): Switch Transformers' router logits,
    for the router losses its loss adds. A forward that rebuilds what it is given as its own output
    class (LED's, whose global attentions are then None) reads that instead."""
    known = set(BaseModelOutput.__dataclass_fields__)
    reads = set()
    for module in {id(model): model, id(base): base}.values():
        tree = forward_tree(module)
        if tree is None or any(
                isinstance(n, ast.Assign) and isinstance(n.value, ast.Call) and isinstance(n.value.func, ast.Name)
                and any(isinstance(t, ast.Name) and t.id == "encoder_outputs" for t in n.targets)
                for n in ast.walk(tree)):
            continue
        called = {id(n.func) for n in ast.walk(tree) if isinstance(n, ast.Call)}
        for node in ast.walk(tree):
            if (isinstance(node, ast.Attribute) and id(node) not in called and isinstance(node.value, ast.Name)
                    and node.value.id == "encoder_outputs" and node.attr not in known):
                reads.add(node.attr)
    return sorted(reads)
