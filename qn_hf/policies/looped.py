"""A stack whose loop calls one shared module once per layer: ALBERT's encoder holds one layer group
(``albert_layer_groups``, ``num_hidden_groups=1``) and calls it ``config.num_hidden_layers`` times:

    for i in range(self.config.num_hidden_layers):
        group_idx = int(i / (self.config.num_hidden_layers / self.config.num_hidden_groups))
        hidden_states = self.albert_layer_groups[group_idx](hidden_states, attention_mask, **kwargs)

A pipeline cuts the iterations, not the list: every stage holds the shared module (its gradient, each
stage's share, summed over the pipeline as for any module real on every stage) and its copy of the loop's
config counts its own iterations. Only a one-module list is cut so: whatever index the loop computes, it
picks that module; with several, the index comes from the layer count a stage's copy changes.
"""

from __future__ import annotations

import ast
from dataclasses import dataclass

from .entries import self_path


@dataclass(frozen=True)
class LoopedCall:
    loop: ast.For
    call: ast.Call  # the one call of ``self.<list>[index](...)``
    count: str  # the config key the loop counts to (``num_hidden_layers``)


def looped_call(tree: ast.FunctionDef, layers: str) -> LoopedCall | None:
    """``for i in range(self.config.<count>): ... self.<layers>[index](...)``: the forward's only mention
    of the list, in its only loop over that count, called once; else None."""
    mentions = [n for n in ast.walk(tree) if isinstance(n, ast.Attribute) and self_path(n) == layers]
    loops = [n for n in ast.walk(tree) if isinstance(n, ast.For) and any(m in list(ast.walk(n)) for m in mentions)]
    if len(mentions) != 1 or len(loops) != 1:
        return None
    loop = loops[0]
    span = loop.iter
    if not (isinstance(span, ast.Call) and isinstance(span.func, ast.Name) and span.func.id == "range"
            and len(span.args) == 1 and not span.keywords):
        return None
    counted = self_path(span.args[0])
    if counted is None or not counted.startswith("config.") or counted.count(".") != 1:
        return None
    calls = [n for n in ast.walk(loop) if isinstance(n, ast.Call) and isinstance(n.func, ast.Subscript)
             and n.func.value is mentions[0]]
    if len(calls) != 1:
        return None
    return LoopedCall(loop=loop, call=calls[0], count=counted.partition(".")[2])
