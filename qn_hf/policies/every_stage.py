"""Modules a pipeline keeps on every stage, read from the base forward's source.

Some base models compute, before their blocks, something besides the hidden states that every block
reads: Gemma 4 looks up per-layer embeddings (``embed_tokens_per_layer``), projects the token
embedding into them (``per_layer_model_projection``, ``per_layer_projection_norm``) and hands block
``i`` part ``i`` (``per_layer_inputs[:, :, i, :]``). transformers' pp plan places none of them. A
stage cannot receive them with the hidden states, but it can compute them: it holds them (and the
token embedding they read) as the plain model does, runs the base forward before its blocks, and its
first block takes the received activation in place of the hidden states. Each copy's gradient is its
own blocks' share; the sum over the stages is the plain model's (``StagePlan.every_stage``).

A module qualifies when the forward uses it only before its loop over the blocks, directly or in a
method of the base model the forward calls (``self.get_per_layer_inputs(...)``); anything used after
the blocks too is left unplaced (and refused). A module whose output the forward (or such a method)
reshapes with ``self.config.num_hidden_layers`` as the second-to-last size packs one part per block:
a stage whose loop starts at block s must see the parts rotated by s (``pp_per_block_outputs``).
Anything else the loop indexes by its position (a local tensor, not the config's per-layer lists,
which a stage's config copy cuts) is a refusal: a stage would hand its blocks the first blocks' parts.
"""

from __future__ import annotations

import ast
import inspect
import textwrap

from torch import nn

from .entries import forward_tree, self_path, self_references

_LAYER_COUNT = "config.num_hidden_layers"


def _method_trees(base: nn.Module, tree: ast.FunctionDef) -> list[tuple[int, ast.FunctionDef]]:
    """The base model's own methods the forward calls as ``self.<method>(...)``: (the call's line, its
    source tree), one level deep."""
    children = {name for name, _ in base.named_children()}
    found = []
    for node in ast.walk(tree):
        if not isinstance(node, ast.Call):
            continue
        name = self_path(node.func)
        if name is None or "." in name or name in children:
            continue
        method = getattr(type(base), name, None)
        if not inspect.isfunction(method):
            continue
        try:
            parsed = ast.parse(textwrap.dedent(inspect.getsource(method))).body[0]
        except (OSError, TypeError, SyntaxError):
            continue
        if isinstance(parsed, ast.FunctionDef):
            found.append((node.lineno, parsed))
    return found


def every_stage_children(base: nn.Module, *, layers: str, placed: set[str]) -> list[str]:
    """Children with parameters that the pp plan does not place and that the base forward uses only
    before its first mention of the blocks, directly or through the methods it calls there."""
    tree = forward_tree(base)
    if tree is None:
        return []
    uses = {child: [line for line, _ in found] for child, found in self_references(tree).items()}
    if not uses.get(layers):
        return []
    for line, method in _method_trees(base, tree):
        for child in self_references(method):
            uses.setdefault(child, []).append(line)  # used where the forward calls the method
    first_block = min(uses[layers])
    return [name for name, module in base.named_children()
            if name not in placed and name != layers and any(True for _ in module.parameters())
            and uses.get(name) and max(uses[name]) < first_block]


def per_block_outputs(base: nn.Module, *, candidates: list[str]) -> list[str]:
    """Of ``candidates`` (children), those whose output the forward or a method it calls reshapes
    to ``(..., self.config.num_hidden_layers, part)``: directly (``self.m(x).reshape(...)``) or
    through a name assigned from an expression that calls it."""
    tree = forward_tree(base)
    if tree is None:
        return []
    found: set[str] = set()
    for function in [tree, *(method for _, method in _method_trees(base, tree))]:
        for node in ast.walk(function):
            if not (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)
                    and node.func.attr in ("reshape", "view") and len(node.args) >= 2
                    and self_path(node.args[-2]) == _LAYER_COUNT):
                continue
            receiver = node.func.value
            sources = (_value_at(function, receiver.id, line=node.lineno) if isinstance(receiver, ast.Name)
                       else [receiver])
            for source in sources:
                found |= {path for call in ast.walk(source) if isinstance(call, ast.Call)
                          and (path := self_path(call.func)) in candidates}
    return [name for name in candidates if name in found]


def _value_at(function: ast.FunctionDef, name: str, *, line: int) -> list[ast.expr]:
    """The expressions ``name`` holds at ``line``: its last plain assignment before it, and the
    augmented ones (``x *= scale``) between the two."""
    writes = sorted((node for node in ast.walk(function)
                     if isinstance(node, (ast.Assign, ast.AnnAssign, ast.AugAssign)) and node.lineno < line
                     and any(isinstance(t, ast.Name) and t.id == name
                             for t in (node.targets if isinstance(node, ast.Assign) else [node.target]))),
                    key=lambda node: node.lineno)
    values: list[ast.expr] = []
    for node in reversed(writes):
        if node.value is not None:
            values.append(node.value)
        if not isinstance(node, ast.AugAssign):
            break
    return values
