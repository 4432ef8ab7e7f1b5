"""A stack whose loop body is written out in the forward over parallel lists of modules indexed by the loop's
position: XLM's and Flaubert's

    for i in range(self.n_layers):
        attn = self.attentions[i](tensor, attn_mask, ...)[0]
        tensor = self.layer_norm1[i](tensor + attn)          # (written over a few lines)
        tensor = tensor + self.ffns[i](tensor)
        tensor = self.layer_norm2[i](tensor)
        tensor *= mask

Block k is the k-th module of every list. There is no block module whose input a stage can replace: the loop
carries ``tensor`` itself. A stage keeps every list at its full length, its own positions real and the others
parameter-free pass-throughs, and the loop runs over all of them; what the other positions compute is never
used, because the received activation enters as the output of the *last* module of the body whose result
becomes the carried value (``layer_norm2[start - 1]``: an injector that returns it), and a stage sends what
that module returns at its last position (``layer_norm2[stop - 1]``); what follows it in the body (the mask)
runs on the receiving stage, as in the plain model. Branches of the body on the holder's own flags
(Flaubert's ``if not self.pre_norm``) are read for the holder at hand; a body with no such module on its path
(Flaubert with ``pre_norm=True``: every module's result is added) is none of these.
"""

from __future__ import annotations

import ast
from dataclasses import dataclass

from torch import nn

from .entries import self_path


@dataclass(frozen=True)
class IndexedLists:
    loop: ast.For
    call: ast.Call  # the capture module's call: its first argument is what reaches the blocks
    capture: str  # the list whose module's result becomes the carried value last in the body
    siblings: tuple[str, ...]  # the other lists the body indexes


def _flag(test: ast.expr, holder: nn.Module) -> bool | None:
    """``self.<flag>`` or ``not self.<flag>`` read on ``holder`` (a bool); None for anything else."""
    negated = isinstance(test, ast.UnaryOp) and isinstance(test.op, ast.Not)
    path = self_path(test.operand if negated else test)
    if path is None:
        return None
    value = holder
    for part in path.split("."):
        value = getattr(value, part, None)
    if not isinstance(value, bool):
        return None
    return value != negated


def _taken(body: list[ast.stmt], holder: nn.Module) -> list[ast.stmt] | None:
    """The statements of ``body`` that run, with each branch on a flag of the holder resolved; None where a
    branch that assigns the carried value depends on anything else."""
    out: list[ast.stmt] = []
    for stmt in body:
        if isinstance(stmt, ast.If):
            flag = _flag(stmt.test, holder)
            if flag is None:
                if any(isinstance(n, ast.Call) and isinstance(n.func, ast.Subscript) for n in ast.walk(stmt)):
                    return None  # a module call under a condition this cannot read
                out.append(stmt)
                continue
            inner = _taken(stmt.body if flag else stmt.orelse, holder)
            if inner is None:
                return None
            out += inner
        else:
            out.append(stmt)
    return out


def _indexed(call: ast.AST, index: str) -> str | None:
    """The list ``self.<list>[index](...)`` calls, or None."""
    if isinstance(call, ast.Call) and isinstance(call.func, ast.Subscript):
        target = call.func.slice
        if isinstance(target, ast.Name) and target.id == index:
            return self_path(call.func.value)
    return None


def indexed_lists_call(tree: ast.FunctionDef, holder: nn.Module, lists: list[str]) -> IndexedLists | None:
    """The forward's one loop ``for i in range(...)`` whose body calls ``self.<L>[i](...)`` once for two or more
    of ``lists`` (sibling ``ModuleList``s of ``holder`` of one length), and the capture list (module
    docstring); else None."""
    loops = [n for n in ast.walk(tree) if isinstance(n, ast.For) and isinstance(n.target, ast.Name)
             and isinstance(n.iter, ast.Call) and isinstance(n.iter.func, ast.Name) and n.iter.func.id == "range"]
    found = []
    for loop in loops:
        called = [_indexed(n, loop.target.id) for n in ast.walk(loop)]
        if len({c for c in called if c in lists}) >= 2:
            found.append(loop)
    if len(found) != 1:
        return None
    loop, index = found[0], found[0].target.id
    taken = _taken(loop.body, holder)
    if taken is None:
        return None
    calls: dict[str, list[ast.Call]] = {}
    for stmt in taken:
        for node in ast.walk(stmt):
            name = _indexed(node, index)
            if name is not None:
                calls.setdefault(name, []).append(node)
    if not set(calls) <= set(lists) or any(len(c) != 1 for c in calls.values()) or len(calls) < 2:
        return None
    lengths = {len(getattr(holder, name)) for name in calls}
    if len(lengths) != 1:
        return None
    # the carried value: the name the body assigns from itself (tensor = tensor + attn)
    carried = {t.id for stmt in taken if isinstance(stmt, ast.Assign) for t in stmt.targets if isinstance(t, ast.Name)
               and any(isinstance(n, ast.Name) and n.id == t.id for n in ast.walk(stmt.value))}
    capture = None
    for stmt in taken:  # the last whole assignment of the carried value from a listed module's call
        if (isinstance(stmt, ast.Assign) and len(stmt.targets) == 1 and isinstance(stmt.targets[0], ast.Name)
                and stmt.targets[0].id in carried and _indexed(stmt.value, index) in calls):
            capture = (_indexed(stmt.value, index), stmt.value)
    if capture is None:
        return None
    # after the capture call, the body may only scale or mask the carried value in place: anything assigned
    # to it anew by a listed module would come after
    later = [s for s in taken if s.lineno > capture[1].lineno]
    if any(_indexed(n, index) is not None for s in later for n in ast.walk(s)):
        return None
    return IndexedLists(loop=loop, call=capture[1], capture=capture[0],
                        siblings=tuple(sorted(set(calls) - {capture[0]})))
