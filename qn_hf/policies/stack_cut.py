"""Where a pipeline cuts a model transformers gives no pp plan for: its list of blocks at any depth
(BERT's ``encoder.layer``, OPT's ``decoder.layers``, BLOOM's ``h``), read from the forwards' source.

A pipeline stage runs the base model's own forward over its blocks (``pipeline/stage.py``). At every
level from the base model down to the module that loops over the blocks, the forward's source must
say plainly what runs where. Each child holding parameters is used only before the call that leads
to the blocks, or only after it (a final norm, a pooler: the last stage's, a pass-through elsewhere).
Before it, the input embedding is the entry; any other module there must compute the blocks' input
from it (its result flows, through the forward's assignments, into the argument that reaches the
blocks: a position table added to it, a norm, a same-width projection), never a side input a block
reads besides the hidden states, which a later stage would get wrong. Then either:

* the blocks take the entry's output as it is (BERT: the base hands ``self.embeddings(...)``'s output
  to ``self.encoder``, which loops over its blocks with its own first argument): later stages
  receive in the entry's place, and no other module may run before the blocks; or
* the forward changes the embedding before the blocks (BLOOM's norm, GPT-Neo's and OPT's position
  tables): later stages receive at their first block (``pp_receive_at_blocks``), the entry (an
  ``nn.Embedding``) giving zeros of its shape, the modules before the blocks pass-throughs or zeros
  that keep the widths (what they compute there is never read).

Anything else is a refusal naming it.
"""

from __future__ import annotations

import ast
from dataclasses import dataclass

from torch import nn

from .cuts import StackCut, StandIn
from .derive import block_call, called_past_hooks, loop_indexed
from .entries import children_reached, forward_tree, own_methods, self_path, self_references
from .indexed_lists import indexed_lists_call
from .layout_moves import layout_move, undone_around
from .looped import looped_call
from .module_kinds import position_wise
from .patterns import join


@dataclass(frozen=True)
class _Level:
    """One module on the way from the base model to the blocks, and the call that leads down."""

    path: str  # from the base ('' for the base itself)
    holder: nn.Module
    tree: ast.FunctionDef
    down: str  # the child that leads to the blocks (the list itself at the last level)
    call: ast.Call  # the call of ``down`` (at the last level, the call of a block in the loop)
    bound: int  # assignments before this line lead into the call
    loop: ast.For | None = None  # at the last level, the loop over the blocks
    count: str | None = None  # at the last level, the config key a loop calling one shared module counts to (looped.py)
    siblings: tuple[str, ...] = ()  # at the last level, the other lists a written-out body indexes (indexed_lists.py)


def _has_parameters(module: nn.Module) -> bool:
    return any(True for _ in module.parameters())


def _down_call(tree: ast.FunctionDef, down: str, *, last: bool) -> dict | None:
    """The one call leading down (a block's call in the one loop over ``down``, or one shared module's
    call in a loop over a config count, or ``self.<down>(...)``) and the line before which what it takes
    is computed: ``_Level``'s fields."""
    if last:
        found = block_call(tree, down)
        if found:
            return {"call": found[1], "bound": found[0].lineno, "loop": found[0]}
        looped = looped_call(tree, down)
        return ({"call": looped.call, "bound": looped.loop.lineno, "loop": looped.loop, "count": looped.count}
                if looped else None)
    calls = [n for n in ast.walk(tree) if isinstance(n, ast.Call) and self_path(n.func) == down]
    return {"call": calls[0], "bound": calls[0].lineno} if len(calls) == 1 else None


def _first_argument(call: ast.Call) -> ast.expr | None:
    return call.args[0] if call.args else (call.keywords[0].value if call.keywords else None)


def _assignments(tree: ast.FunctionDef, bound: int, *, unpacked: bool = True) -> dict[str, list[ast.expr]]:
    """name -> the values assigned to it before line ``bound``; a name unpacked from a tuple gets the
    whole value, or with ``unpacked=False`` a marker that it is only a part of it (``_PART``)."""
    found: dict[str, list[ast.expr]] = {}
    for node in ast.walk(tree):
        if isinstance(node, ast.Assign) and node.lineno < bound:
            for target in node.targets:
                whole = isinstance(target, ast.Name)
                for name in ast.walk(target):
                    if isinstance(name, ast.Name):
                        found.setdefault(name.id, []).append(node.value if whole or unpacked else _PART)
    return found


_PART = ast.Constant(value=None)  # a part of an unpacked value: not the value itself


def _chain(level: _Level) -> tuple[set[str], list[ast.expr]]:
    """The names whose values flow into the first argument of the call leading down (through the
    forward's assignments before it), and every expression assigned along the way."""
    first = _first_argument(level.call)
    if first is None:
        return set(), []
    assigned = _assignments(level.tree, level.bound)
    names, values = set(), [first]
    todo = [n.id for n in ast.walk(first) if isinstance(n, ast.Name)]
    while todo:
        name = todo.pop()
        if name in names:
            continue
        names.add(name)
        for value in assigned.get(name, []):
            values.append(value)
            todo += [n.id for n in ast.walk(value) if isinstance(n, ast.Name)]
    return names, values


# methods that move or lay out a tensor without changing its values (``pos_embeds.to(device)``)
_MOVES = ("to", "contiguous", "type_as")


def _moved(node: ast.expr) -> ast.expr:
    """``node`` without the value-keeping method calls around it."""
    while (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr in _MOVES
           and self_path(node.func) is None):
        node = node.func.value
    return node


def _plain_chain(level: _Level, entry: str | None) -> dict[str, StandIn] | None:
    """Whether what the call leading down takes is, through the forward's assignments before it, the
    entry's output (``self.<entry>(...)``; ``entry=None``: the holder's own first argument) with only
    modules applied to it in turn (a norm, a projection, dropout) and lookups of ``nn.Embedding``
    children added to it (position tables): then it is the received activation itself on a later
    stage once each such module passes its input through and each table gives zeros. Returns those
    modules (children of the holder) and their stand-ins, or None when the chain is anything else (a
    product, a concatenation, a part of a tuple, another argument)."""
    first = _first_argument(level.call)
    if not isinstance(first, ast.Name):
        return None
    holder = level.holder
    assigned = _assignments(level.tree, level.bound, unpacked=False)  # a part of a tuple is not the value
    own = level.tree.args.args[1].arg if len(level.tree.args.args) > 1 else None
    children = dict(holder.named_children())

    def table(node: ast.expr, seen: frozenset[str] = frozenset()) -> str | None:
        """The nn.Embedding child whose lookup ``node`` is (directly, or a name holding only that)."""
        node = _moved(node)
        if isinstance(node, ast.Name):
            if node.id in seen:  # a name assigned from itself (hidden = hidden + ...): no lookup alone
                return None
            found = {table(v, seen | {node.id}) for v in assigned.get(node.id, [])}
            return found.pop() if len(found) == 1 and None not in found else None
        path = self_path(node.func) if isinstance(node, ast.Call) else None
        return path if path in children and path != entry and isinstance(children[path], nn.Embedding) else None

    stand_ins: dict[str, StandIn] = {}
    seen, todo = set(), [first.id]
    while todo:
        name = todo.pop()
        if name in seen:
            continue
        seen.add(name)
        values = assigned.get(name, [])
        if not values:
            if entry is not None or name != own:
                return None  # an argument of the forward that is not what reaches the blocks
            continue
        for value in map(_moved, values):
            path = self_path(value.func) if isinstance(value, ast.Call) else None
            if isinstance(value, ast.Name):
                todo.append(value.id)
            elif entry is not None and path == entry:
                continue
            elif path in children and value.args and isinstance(value.args[0], ast.Name):
                stand_ins[path] = StandIn.IDENTITY  # a module applied to the chain: runs on the first stage
                todo.append(value.args[0].id)
            elif ((moved := layout_move(value)) is not None and level.loop is not None
                  and undone_around(level.tree, level.loop, first.id)):
                todo.append(moved)  # channels-first around the blocks and back (layout_moves.py)
            elif isinstance(value, ast.BinOp) and isinstance(value.op, ast.Add):
                tables = [t for t in (table(value.left), table(value.right)) if t is not None]
                rest = [side for side in (value.left, value.right) if table(side) is None]
                if len(tables) != 1 or len(rest) != 1 or not isinstance(rest[0], ast.Name):
                    return None
                stand_ins[tables[0]] = StandIn.ZEROS
                todo.append(rest[0].id)
            else:
                return None
    return stand_ins


def _calls_in(values: list[ast.expr], name: str) -> bool:
    return any(isinstance(n, ast.Call) and self_path(n.func) == name for v in values for n in ast.walk(v))


def _entry_reads(entry: nn.Module, uses: list[tuple[int, str]]) -> set[str]:
    """The attributes (a weight's dtype) the forward reads off the entry besides calling it."""
    reads = set()
    for _, rest in uses:
        holder, kept = entry, []
        for attr in rest.split(".") if rest else []:
            kept.append(attr)
            holder = getattr(holder, attr, None)
            if not isinstance(holder, nn.Module):
                break
        if kept and not isinstance(holder, nn.Module) and not callable(holder):
            reads.add(".".join(kept))
    return reads


def _levels(base: nn.Module, parts: list[str]) -> list[_Level] | str:
    levels = []
    for depth, down in enumerate(parts):
        path = ".".join(parts[:depth])
        holder = base.get_submodule(path) if path else base
        tree = forward_tree(holder)
        if tree is None:
            return f"{type(holder).__name__}'s forward cannot be read"
        found = _down_call(tree, down, last=depth == len(parts) - 1)
        if found is None and depth == len(parts) - 1:
            lists = [n for n, c in holder.named_children() if isinstance(c, nn.ModuleList)]
            indexed = indexed_lists_call(tree, holder, lists) if down in lists else None
            if indexed is not None and down in (indexed.capture, *indexed.siblings):
                found = {"call": indexed.call, "bound": indexed.loop.lineno, "loop": indexed.loop,
                         "siblings": indexed.siblings}
                down = indexed.capture  # the stages cut by the list whose module's result they send
        if found is None:
            what = f"loop once over {down}, calling each block once" if depth == len(parts) - 1 else f"call {down} once"
            return f"{type(holder).__name__}'s forward does not {what}"
        if found.get("count") is not None and len(getattr(holder, down)) != 1:
            return (f"{type(holder).__name__}'s forward calls one of the {len(getattr(holder, down))} modules of {down} "
                    f"in each of config.{found['count']} iterations, picked by a position computed from that count, "
                    f"which a stage's cut changes")
        levels.append(_Level(path=path, holder=holder, tree=tree, down=down, **found))
    return levels


def stack_cut(base: nn.Module, *, layers: str, embeddings: str | None) -> StackCut | str:
    """The cut points of ``base`` around its blocks ``layers`` (a path, at any depth), or why there are
    none (module docstring). ``embeddings``: the input embedding's path in ``base``."""
    if embeddings is None:
        return "no input embedding was found (get_input_embeddings)"
    levels = _levels(base, layers.split("."))
    if isinstance(levels, str):
        return levels
    cut = _cut(base, levels, layers=layers, embeddings=embeddings)
    if isinstance(cut, StackCut) and cut.receive_at_blocks and called_past_hooks(levels[-1].call):
        # a later stage's first block takes the received activation through a hook on it
        return (f"{type(levels[-1].holder).__name__}'s forward runs each block by its forward method, past the hooks "
                f"through which a later stage's first block would take the activation received (what reaches the "
                f"blocks is not the input embedding's output as it is)")
    return cut


def _cut(base: nn.Module, levels: list[_Level], *, layers: str, embeddings: str) -> StackCut | str:
    entry, entry_level, first, last, reads, side = None, None, {}, {}, set(), []
    for index, level in enumerate(levels):
        direct = self_references(level.tree)
        uses = {name: list(found) for name, found in direct.items()}
        start, stop = level.bound, max(line for line, _ in uses[level.down])
        methods = own_methods(level.holder, level.tree)
        for method, reached in methods.items():  # a child a method reads is used where the forward calls it
            for name in reached - {level.down}:
                uses.setdefault(name, []).extend((line, "") for line, _ in direct[method])
        _, chain_values = _chain(level)
        for name, child in level.holder.named_children():
            full = join(level.path, name)
            if name == level.down or name in level.siblings or not _has_parameters(child):
                continue  # rotary tables, dropout, activations: parameter-free, every stage runs them
            lines = [line for line, _ in uses.get(name, [])]
            where = f"{type(level.holder).__name__}'s forward"
            if not lines:
                if children_reached(level.holder, level.tree) is None:
                    return (f"{full} holds parameters {where} never names, and it hands self on (a call whose "
                            f"source does not say what it runs), which may run it")
                # no stage runs it (ESM's contact head, for its predict_contacts): the last stage holds it
                last[full] = StandIn.IDENTITY
                continue
            if min(lines) > stop:
                last[full] = StandIn.IDENTITY
                continue
            if max(lines) >= start:
                return f"{full} runs both before and after the blocks in {where}"
            if embeddings == full or embeddings.startswith(full + "."):
                entry, entry_level = full, index
                reads |= _entry_reads(child, uses[name])
                continue
            if _calls_in(chain_values, name) or any(_calls_in(chain_values, m) for m, kids in methods.items()
                                                    if name in kids):
                # a position table added to the embedding, or a module applied to it: the first stage's
                first[full] = StandIn.ZEROS if isinstance(child, nn.Embedding) else StandIn.IDENTITY
            else:  # something else every block reads (RoFormer's sinusoidal table, MPNet's position bias)
                side.append(full)
    if entry is None:
        return f"the input embedding ({embeddings}) does not run before the blocks"
    if levels[-1].count is not None:  # the shared module is on every stage, and with it what runs before it
        return _every_stage(levels, entry=entry, first=first, side=side, last=last, reads=reads,
                            why=f"{layers} is one module called config.{levels[-1].count} times")
    if side:
        return _every_stage(levels, entry=entry, first=first, side=side, last=last, reads=reads,
                            why=f"{', '.join(side)} computes something besides the blocks' input before them")
    # later stages receive in the entry's place when what reaches the blocks is the entry's output with
    # modules applied in turn and tables added (each then a pass-through or zeros), level by level
    chains = [_plain_chain(level, entry.rpartition(".")[2] if index == entry_level else None)
              for index, level in enumerate(levels) if index >= entry_level]
    # a written-out body's stand-ins compute on whatever precedes them: the activation must enter at the capture
    if all(chain is not None for chain in chains) and not levels[-1].siblings:
        stand_ins = {join(level.path, name): kind
                     for level, chain in zip(levels[entry_level:], chains) for name, kind in chain.items()}
        # a stand-in must not be used after the blocks too (T5's dropout runs on both sides): there the
        # last stage needs the real module
        after = {join(level.path, name) for level in levels for name, lines in self_references(level.tree).items()
                 if lines and max(line for line, _ in lines) > max(line for line, _ in self_references(level.tree)[level.down])}
        if set(first) <= set(stand_ins) and not set(stand_ins) & after:
            return StackCut(entry=entry, first=stand_ins, last=last, entry_reads=tuple(sorted(reads)))
    if not isinstance(base.get_submodule(entry), nn.Embedding):
        return _every_stage(levels, entry=entry, first=first, side=side, last=last, reads=reads,
                            why=f"the forward changes the embedding ({entry}, a "
                                f"{type(base.get_submodule(entry)).__name__}) before the blocks take it")
    for name, kind in first.items():  # later stages compute on zeros here, discarded at the first block
        module = base.get_submodule(name)
        if kind is StandIn.IDENTITY and not (position_wise(module) or (isinstance(module, nn.Linear)
                                                                      and module.in_features == module.out_features)):
            return _every_stage(levels, entry=entry, first=first, side=side, last=last, reads=reads,
                                why=f"{name} ({type(module).__name__}) runs before the blocks and changes the width "
                                    f"of what they take")
    return StackCut(entry=entry, first=first, last=last, entry_reads=tuple(sorted(reads)), receive_at_blocks=True,
                    **_written_out(levels[-1]))


def _carried(level: _Level) -> list[str]:
    """The names a block's call reads, besides its first argument, that the loop assigns from a block's
    output (through other such names) or from their own last value: what one block hands the next (Swin's
    input_dimensions, halved at each downsampling stage; LUKE's entity_hidden_states). A name the loop makes afresh from its position (the
    config's layer_types[i], cut with the stage's config) is no such thing."""
    loop, call = level.loop, level.call
    first = _first_argument(call)
    hidden = {n.id for n in ast.walk(first) if isinstance(n, ast.Name)} if first is not None else set()
    read = {n.id for n in ast.walk(call) if isinstance(n, ast.Name)} - hidden
    writes = [(node, [t.id for target in (node.targets if isinstance(node, ast.Assign) else [node.target])
                      for t in ast.walk(target) if isinstance(t, ast.Name)])
              for node in ast.walk(loop) if isinstance(node, (ast.Assign, ast.AugAssign, ast.AnnAssign))
              and node.value is not None]
    tainted: set[str] = set()
    grown = True
    while grown:
        grown = False
        for node, targets in writes:
            reads = {n.id for n in ast.walk(node.value) if isinstance(n, ast.Name)}
            # from a block's output, from such a name, or from itself (a value each iteration moves on)
            if any(n is call for n in ast.walk(node.value)) or reads & (tainted | set(targets)):
                if not set(targets) <= tainted:
                    tainted.update(targets)
                    grown = True
    return sorted(read & tainted)


def _every_stage(levels: list[_Level], *, entry: str, first: dict[str, StandIn], side: list[str],
                 last: dict[str, StandIn], reads: set[str], why: str) -> StackCut | str:
    """Where a later stage cannot stand in for what runs before the blocks (``why``), every stage holds it
    and runs it on the batch as the plain model does, and its first block takes the received activation
    (``pp_every_stage``; each copy's gradient is its own stage's share, summed over the stages). Refused
    where the loop over the blocks hands each a part by its position, which a stage counts from its own
    first block."""
    carried = _carried(levels[-1])
    if carried:
        return (f"{why}, and {type(levels[-1].holder).__name__}'s blocks hand each other {', '.join(carried)} besides the "
                f"hidden states (assigned in its loop, read by the next block), which no stage boundary carries")
    indexed = loop_indexed(levels[-1].holder, layers=levels[-1].down)
    if indexed:
        return (f"{why}, and {type(levels[-1].holder).__name__}'s forward hands each block "
                f"{', '.join(indexed)}[..., i, ...] by its position i in the loop, which on a later stage counts from "
                f"that stage's first block")
    looped = levels[-1].count is not None
    shared = (entry, *first, *side, *([join(levels[-1].path, levels[-1].down)] if looped else []))
    # a module of the last stage whose parameters are these modules' (ProphetNet's decoder wrapper holds a
    # word_embeddings of its own, tied to its decoder's) is real on every stage too: a stage that replaced it
    # would name the shared parameters otherwise than the others, which sum them in one order
    base = levels[0].holder
    held = {id(p) for path in shared for p in base.get_submodule(path).parameters()}
    aliases = tuple(path for path in last if {id(p) for p in base.get_submodule(path).parameters()} <= held)
    return StackCut(entry=entry, last={k: v for k, v in last.items() if k not in aliases},
                    entry_reads=tuple(sorted(reads)), receive_at_blocks=True, every_stage=(*shared, *aliases),
                    loop_count=levels[-1].count, **_written_out(levels[-1]))


def _written_out(level: _Level) -> dict:
    """A written-out body's lists (indexed_lists.py), as StackCut takes them: paths from the base."""
    if not level.siblings:
        return {}
    return {"blocks": join(level.path, level.down), "siblings": tuple(join(level.path, n) for n in level.siblings)}
