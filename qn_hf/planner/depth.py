"""A deep model's forward recorded from three of its blocks: what the planner's traces cost grows with
the blocks (about two seconds for an 80-block 70B config on the meta device, and a search at a
thousand GPUs records some fifty of them: per micro-batch size, context-parallel degree and
recomputation), while a model's blocks are most often alike.

``shortened_recording`` runs the forward with the block list cut to its first, second and last block
(the list put back after), and lays the recording out as the whole model's: the second block's
entries (module calls, bytes kept, ops, collectives, in the order they ran) repeated for every block
between the first and the last, renamed. Three blocks and not two, so that each repeated block is one
whose output the next block takes (the last one's goes to the final norm, which may keep it
differently): each block of the whole model is then recorded as one of the same kind of position.

That holds when the blocks are alike: the same modules and sizes, no behaviour chosen by a block's
index at run time, nothing outside the blocks run once per block. Nothing here assumes it:
``Planner`` records one forward in full too and compares it with its shortened layout
(``Recording`` equality: every field, exact), and records every forward in full for a model where
they differ (Gemma 3's sliding and global layers, Qwen3-MoE's dense layers, a shared block run
between layers) or where the cut forward fails.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import replace

from torch import nn

from .trace import Recording

MIN_BLOCKS = 6  # fewer: recording the whole forward costs little more than three blocks and the check


class Recorder:
    """Records a planner's forwards from three blocks where that gives the whole forward's recording:
    the first time, in full too and compared (exact, in order); from then on shortened if they were
    the same, in full if not."""

    def __init__(self) -> None:
        self.same: bool | None = None  # None: not compared yet

    def record(self, model: nn.Module, layers: str, record: Callable[[nn.Module], Recording], *,
               shortened: bool) -> Recording:
        """``record(model)``; ``shortened`` False where the stand-ins read block indices (sequence
        parallelism's stage edges)."""
        if not shortened or self.same is False:
            return record(model)
        short = shortened_recording(model, layers, record)
        if short is None:
            return record(model)
        if self.same is None:
            whole = record(model)
            self.same = same_recording(short, whole)
            return whole
        return short


def shortened_recording(model: nn.Module, layers: str, record: Callable[[nn.Module], Recording]) -> Recording | None:
    """``record(model)`` run with ``model``'s ``layers`` list cut to its first, second and last block, laid
    out as the whole model's (module docstring); None when the list is short, or the cut forward fails."""
    blocks = model.get_submodule(layers)
    count = len(blocks)
    if not isinstance(blocks, nn.ModuleList) or count < MIN_BLOCKS:
        return None
    parent_name, _, attr = layers.rpartition(".")
    parent = model.get_submodule(parent_name)
    setattr(parent, attr, nn.ModuleList([blocks[0], blocks[1], blocks[count - 1]]))
    try:
        short = record(model)
    except (IndexError, KeyError, ValueError, RuntimeError):  # a forward that indexes blocks by the config's count
        return None
    finally:
        setattr(parent, attr, blocks)
    return expand(short, layers=layers, count=count)


def expand(short: Recording, *, layers: str, count: int) -> Recording:
    """A recording of blocks 0, 1 and ``count - 1`` (named 0, 1, 2) as one of ``count`` blocks: block 1's
    entries repeated as blocks 2 .. count-2, block 2's as block count-1."""
    middle = range(1, count - 1)

    @functools.cache
    def names(name: str) -> tuple[str, ...]:
        """The whole model's names for a name of the short recording."""
        index = _block_index(name, layers)
        if index is None or index == 0:
            return (name,)
        rest = name[len(layers) + 1 + len(str(index)):]
        return tuple(f"{layers}.{i}{rest}" for i in (middle if index == 1 else (count - 1,)))

    def keyed(mapping: dict, key: Callable = lambda k: k, rename: Callable = lambda k, n: n) -> dict:
        """Block-major, as the whole forward inserts them: a run of the second block's entries is
        laid out once per block it stands for, in block order."""
        items, out, i = list(mapping.items()), {}, 0
        while i < len(items):
            j = i + 1
            if _block_index(key(items[i][0]), layers) == 1:
                while j < len(items) and _block_index(key(items[j][0]), layers) == 1:
                    j += 1
                for copy in range(len(middle)):
                    for k, v in items[i:j]:
                        out[rename(k, names(key(k))[copy])] = v
            else:
                for n in names(key(items[i][0])):
                    out[rename(items[i][0], n)] = items[i][1]
            i = j
        return out

    def ordered(calls: tuple) -> tuple:
        out, i = [], 0
        while i < len(calls):
            j = i + 1
            if _block_index(calls[i].module, layers) == 1:
                while j < len(calls) and _block_index(calls[j].module, layers) == 1:
                    j += 1
                for copy in range(len(middle)):
                    out.extend(replace(c, module=names(c.module)[copy]) for c in calls[i:j])
            else:
                out.extend(replace(calls[i], module=n) for n in names(calls[i].module))
            i = j
        return tuple(out)

    def pair(k: tuple, n: str) -> tuple:
        return (n, k[1])

    # ticks order a block's events (its saves, its modules' outputs); each block has as many, so the
    # whole forward's block i runs the second block's ticks shifted by (i - 1) blocks' worth
    period = _period(short, layers)

    def shifted(name: str, whole: str, tick: int) -> int:
        index = _block_index(name, layers)
        return tick + (_block_index(whole, layers) - index) * period if index else tick

    done = {}
    for (module, new), (block, tick) in keyed(short.done, rename=lambda k, n: (k, n)).items():
        done[new] = (names(block)[names(module).index(new)], shifted(module, new, tick))
    last_save = {new: shifted(block, new, tick)
                 for (block, new), tick in keyed(short.last_save, rename=lambda k, n: (k, n)).items()}
    return Recording(
        io=keyed(short.io),
        alive=keyed(short.alive, key=lambda k: k[0], rename=pair),
        offloaded=keyed(short.offloaded, key=lambda k: k[0], rename=pair),
        done=done,
        last_save=last_save,
        boundary_numel=short.boundary_numel,
        logits_rows=short.logits_rows,
        tokens=short.tokens,
        sequence=ordered(short.sequence),
        ring=ordered(short.ring),
        experts=ordered(short.experts),
        repeated_inputs=frozenset(n for name in short.repeated_inputs for n in names(name)),
        linears=frozenset(n for name in short.linears for n in names(name)),
        ops=keyed(short.ops, key=lambda k: k[0], rename=pair),
    )


def _period(short: Recording, layers: str) -> int:
    """Ticks a block's events take: from a module's output in the second block to the same module's in
    the last (0 when no module inside them was recorded)."""
    second, last = f"{layers}.1", f"{layers}.2"
    for module, (block, tick) in sorted(short.done.items(), key=lambda item: item[1][1]):
        if block == second:
            same = last + module[len(second):]
            return short.done[same][1] - tick if same in short.done else 0
    return short.last_save.get(last, 0) - short.last_save.get(second, 0)


def _block_index(name: str, layers: str) -> int | None:
    """The index of the block ``name`` is (or is inside) in the ``layers`` list, else None."""
    if not name.startswith(layers + "."):
        return None
    head = name[len(layers) + 1:].split(".", 1)[0]
    return int(head) if head.isdigit() else None


def same_recording(a: Recording, b: Recording) -> bool:
    """Equal in every field, and every mapping in the same order (the estimate sums some of them in
    floating point in their order, so the same order gives the same figures to the last bit)."""
    return a == b and all(list(getattr(a, f).items()) == list(getattr(b, f).items())
                          for f in ("io", "alive", "offloaded", "done", "last_save", "ops"))
