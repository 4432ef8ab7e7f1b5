"""Layout moves a loop over the blocks is wrapped in: SqueezeBERT's encoder turns its input channels-first
(``hidden_states.permute(0, 2, 1)``) before its blocks and back after them. A pipeline stage that receives in
the entry's place runs that same forward over its own blocks, so what one stage returns can go in where the
next stage's input came from only when the moves after the loop undo those before it: proven here from the
moves' constant dims, never assumed."""

from __future__ import annotations

import ast

_MOVES = ("permute", "transpose")


def layout_move(node: ast.expr) -> str | None:
    """The name ``node`` moves (``x.permute(0, 2, 1)``, ``x.transpose(1, 2)``, every dim a constant >= 0),
    or None for anything else."""
    if not (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr in _MOVES
            and isinstance(node.func.value, ast.Name) and node.args and not node.keywords):
        return None
    if not all(isinstance(a, ast.Constant) and type(a.value) is int and a.value >= 0 for a in node.args):
        return None  # a negative dim depends on the rank, which the source does not say
    if node.func.attr == "transpose" and len(node.args) != 2:
        return None
    return node.func.value.id


def _order(moves: list[ast.Call]) -> list[int] | None:
    """Which input dim each dim of the result is after ``moves`` in turn, or None where they do not agree
    on one rank (a permute names every dim; transposes alone are read on the least rank they fit)."""
    dims = [[a.value for a in move.args] for move in moves]
    ranks = {len(d) for move, d in zip(moves, dims) if move.func.attr == "permute"}
    if len(ranks) > 1:
        return None
    rank = ranks.pop() if ranks else max(max(d) for d in dims) + 1
    order = list(range(rank))
    for move, d in zip(moves, dims):
        if max(d) >= rank:
            return None
        if move.func.attr == "permute":
            if sorted(d) != list(range(rank)):
                return None
            order = [order[i] for i in d]
        else:
            a, b = d
            order[a], order[b] = order[b], order[a]
    return order


def undone_around(tree: ast.FunctionDef, loop: ast.For, name: str) -> bool:
    """Whether the forward ``tree`` moves ``name`` (``name = name.permute(...)``, in its own body, not a branch)
    before ``loop`` and moves it back after it: the moves after undo those before, and ``name`` is moved
    nowhere else before the loop (a branch that moves it only sometimes)."""
    before, after = [], []
    for statement in tree.body:
        if (isinstance(statement, ast.Assign) and len(statement.targets) == 1
                and isinstance(statement.targets[0], ast.Name) and statement.targets[0].id == name
                and layout_move(statement.value) == name):
            if statement.lineno < loop.lineno:
                before.append(statement.value)
            elif statement.lineno > loop.end_lineno:
                after.append(statement.value)
    anywhere = [n for n in ast.walk(tree) if isinstance(n, ast.Assign) and n.lineno < loop.lineno
                and layout_move(n.value) is not None]
    if not before or len(anywhere) != len(before):
        return False
    order = _order(before + after)
    return order is not None and order == list(range(len(order)))
