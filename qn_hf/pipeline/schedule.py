"""Pipeline schedules as pure data: (stages, microbatches, schedule, virtual_stages) -> each rank's
ordered actions.

Nothing here communicates. The runtime only executes these lists; ``schedule_check.py`` proves them
without any process (no deadlock, FIFO order on every link, peaks, a timed bubble). This file holds
the vocabulary (``Op``, ``Action``, ``chunk_of``, ``rank_of_chunk``), the argument checks and the
allowed-microbatch rule, the four generators, what the runtime asks of a list (``final_actions``,
``deferred``), ``peak_in_flight`` and ``format_grid``.

Schedules (``SCHEDULES``), for pp ranks and M microbatches:

* ``gpipe``: every forward, then every backward.
* ``1f1b``: rank r runs ``min(pp-1-r, M)`` warm-up forwards, then one forward and one backward
  alternately, then drains the backwards; it holds at most ``min(pp-r, M)`` microbatches.
* ``interleaved_1f1b``: the model is cut into pp*V chunks and rank r holds chunks r, r+pp, r+2pp ...
  (V = ``virtual_stages`` >= 2); activations travel around the ranks as a ring. Microbatches run in
  ``max(1, M // pp)`` rounds of equal size (other M are refused, naming the nearest allowed ones).
  The k-th forward of a rank runs local chunk ``(k // per_round) % V`` on the next microbatch of that
  round (depth first); backwards visit the chunks in reverse in the same way; warm-up is
  ``min(V*M, (V-1)*per_round + 2*(pp-1-r))`` forwards, then 1F1B pairs, then drain.
* ``zb_h1`` (zero bubble, Qi et al. 2024): 1F1B whose backward is split into B (input gradients,
  which the previous rank waits for) and W (weight gradients, which nobody waits for). Rank r runs
  no W after its first r backwards and one W after each later one, then the leftover W's: the W's
  fill 1F1B's drain bubble, so with equal F, B, W costs the bubble is (pp-1)/(3M+pp-1) for M >= pp
  (1F1B's is (pp-1)/(M+pp-1)). F->B peaks are 1F1B's; rank r also keeps up to r W stashes more.

An action is ``Action(op, mb, chunk=None)``. ``FWD``/``BWD``/``WGT`` compute; ``RECV_FWD`` receives
the chunk's input activation, ``SEND_FWD`` passes its output on, ``RECV_BWD`` receives the gradient
of its output and ``SEND_BWD`` passes the gradient of its input back. A ``BWD`` whose (chunk, mb) has
a ``WGT`` in the same list computes only the input gradient and the gradients of parameters that
are not deferred (``deferred``); the ``WGT`` computes the deferred weight gradients. ``chunk`` is the
global chunk index 0..pp*V-1, filled in interleaved lists only; None means the rank's only chunk
(chunk == stage). An action prints as ``F3`` (forward of microbatch 3) when its chunk is None and as
``2:F3`` (chunk 2) when set. A receive of chunk c comes from the send of chunk c-1 (activation) or
c+1 (gradient) on rank ``rank_of_chunk``.

``format_grid`` prints a whole schedule as a step x stage table, e.g. pp=2, 2 microbatches, 1F1B::

    step  stage 0  stage 1
       0  F0       rF0
       1  sF0      F0
       2  F1       B0
       3  sF1      sB0
       4  rB0     >rF1<
       ...

(``>rF1<`` marks a cell: the action that failed, or where a deadlocked stage waits.) The grid of
interleaved_1f1b at pp=2, V=2, M=4 is written out in tests/test_schedule.py.
"""

from __future__ import annotations

from collections.abc import Collection
from dataclasses import dataclass

from ..arguments import Choice
from ..config.schedule import Schedule, check_schedule_args, interleaved_rounds


class Op(Choice):
    """What an action does. A member equals its string, so recorded timelines (JSON) read back as
    the same ops; code compares members."""

    FWD = "fwd"
    BWD = "bwd"
    RECV_FWD = "recv_fwd"
    SEND_FWD = "send_fwd"
    RECV_BWD = "recv_bwd"
    SEND_BWD = "send_bwd"
    WGT = "wgt"  # the deferred weight-gradient pass of a microbatch (zb_h1)

    @property
    def short(self) -> str:
        """The compact form used in grids: F, B, rF, sF, rB, sB, W."""
        return _SHORT[self]


_SHORT = {
    Op.FWD: "F", Op.BWD: "B", Op.RECV_FWD: "rF", Op.SEND_FWD: "sF", Op.RECV_BWD: "rB", Op.SEND_BWD: "sB",
    Op.WGT: "W",
}
COMPUTE_OPS = frozenset({Op.FWD, Op.BWD, Op.WGT})


@dataclass(frozen=True)
class Action:
    """One op on one microbatch of one chunk; prints as ``F3`` (chunk None) or ``2:F3`` (chunk 2)."""

    op: Op
    mb: int
    chunk: int | None = None

    def __post_init__(self) -> None:
        # Accept the op's string value too (``Action("fwd", 0)``), so equality and hashing only
        # ever see Op members (a member kept as it is: a search builds millions of actions).
        if type(self.op) is not Op:
            object.__setattr__(self, "op", Op(self.op))

    def __repr__(self) -> str:
        text = f"{self.op.short}{self.mb}"
        return text if self.chunk is None else f"{self.chunk}:{text}"


def chunk_of(action: Action, *, stage: int) -> int:
    """The global chunk an action runs on: its own ``chunk``, or the stage's only chunk."""
    return stage if action.chunk is None else action.chunk


def rank_of_chunk(chunk: int, *, stages: int) -> int:
    """Chunks are dealt round-robin: rank r holds chunks r, r+pp, r+2pp ..."""
    return chunk % stages


def chunks_of(*, stage: int, stages: int, virtual_stages: int = 1) -> tuple[int, ...]:
    """The global chunks rank ``stage`` holds, in model order."""
    return tuple(range(stage, stages * virtual_stages, stages))


def warmup_forwards(*, stage: int, stages: int, microbatches: int, virtual_stages: int = 1) -> int:
    """Forwards a stage runs before its first forward/backward pair: 1F1B's (and zb_h1's) at
    ``virtual_stages=1``, interleaved_1f1b's above (counted in chunk forwards)."""
    if virtual_stages == 1:
        return min(stages - stage - 1, microbatches)
    per_round = microbatches // interleaved_rounds(stages=stages, microbatches=microbatches)
    return min(virtual_stages * microbatches, (virtual_stages - 1) * per_round + 2 * (stages - 1 - stage))


def _forward(*, mb: int, index: int, last: int, chunk: int | None) -> list[Action]:
    """A forward wrapped in its receive and send; ``index`` is the position (stage or chunk) in
    the pipeline and ``last`` the last position, where nothing is received or sent."""
    return ([Action(Op.RECV_FWD, mb, chunk)] if index > 0 else []) + [Action(Op.FWD, mb, chunk)] + (
        [Action(Op.SEND_FWD, mb, chunk)] if index < last else []
    )


def _backward(*, mb: int, index: int, last: int, chunk: int | None) -> list[Action]:
    return ([Action(Op.RECV_BWD, mb, chunk)] if index < last else []) + [Action(Op.BWD, mb, chunk)] + (
        [Action(Op.SEND_BWD, mb, chunk)] if index > 0 else []
    )


def _pairs(*, count: int, warm: int) -> list[tuple[str, int]]:
    """1F1B's order over a rank's ``count`` forwards and ``count`` backwards, as (FWD | BWD, index):
    ``warm`` forwards, then one forward and one backward alternately, then the remaining backwards."""
    order = [(Op.FWD, k) for k in range(warm)]
    for i in range(count - warm):
        order += [(Op.FWD, warm + i), (Op.BWD, i)]
    return order + [(Op.BWD, i) for i in range(count - warm, count)]


def _interleaved(*, stage: int, stages: int, microbatches: int, virtual_stages: int,
                 backward: bool) -> list[Action]:
    pp, v_count, last = stages, virtual_stages, stages * virtual_stages - 1
    per_round = microbatches // interleaved_rounds(stages=pp, microbatches=microbatches)

    def key(k: int, *, reverse: bool) -> tuple[int, int]:
        # The k-th forward (backward) of this rank: round k // (per_round*V), local chunk
        # (k // per_round) % V (reversed for backwards), microbatch k % per_round of the round.
        local = (k // per_round) % v_count
        local = v_count - 1 - local if reverse else local
        return local * pp + stage, (k // (per_round * v_count)) * per_round + k % per_round

    count = v_count * microbatches
    fwd = [_forward(mb=mb, index=c, last=last, chunk=c) for c, mb in (key(k, reverse=False) for k in range(count))]
    if not backward:
        return [a for f in fwd for a in f]
    bwd = [_backward(mb=mb, index=c, last=last, chunk=c) for c, mb in (key(k, reverse=True) for k in range(count))]
    warm = warmup_forwards(stage=stage, stages=pp, microbatches=microbatches, virtual_stages=v_count)
    return [a for kind, i in _pairs(count=count, warm=warm) for a in (fwd if kind is Op.FWD else bwd)[i]]


def stage_actions(*, stage: int, stages: int, microbatches: int, schedule: str, virtual_stages: int = 1,
                  backward: bool = True) -> list[Action]:
    """The ordered actions of one rank. ``backward=False`` gives the forward-only (eval) list: the
    train list's forward-side actions in the same order."""
    check_schedule_args(stages=stages, microbatches=microbatches, schedule=schedule, virtual_stages=virtual_stages)
    if not 0 <= stage < stages:
        raise ValueError(f"stage={stage} is outside 0..{stages - 1}")
    kind = Schedule(schedule)
    if kind.chunks:
        return _interleaved(stage=stage, stages=stages, microbatches=microbatches, virtual_stages=virtual_stages,
                            backward=backward)
    fwd = [_forward(mb=mb, index=stage, last=stages - 1, chunk=None) for mb in range(microbatches)]
    bwd = [_backward(mb=mb, index=stage, last=stages - 1, chunk=None) for mb in range(microbatches)]
    if not backward:
        return [a for f in fwd for a in f]
    if kind is Schedule.GPIPE:
        return [a for f in fwd for a in f] + [a for b in bwd for a in b]
    warm = warmup_forwards(stage=stage, stages=stages, microbatches=microbatches)
    order = _pairs(count=microbatches, warm=warm)
    if kind is Schedule.ONE_F_ONE_B:
        return [a for kind, i in order for a in (fwd if kind is Op.FWD else bwd)[i]]
    # zb_h1: W's wait in microbatch order. Rank r skips a W after its first r backwards: those W's
    # run later, where 1F1B's rank r would idle waiting for a gradient, and at the end, where the
    # ranks before it still drain their backwards.
    out: list[Action] = []
    done_w = 0
    for kind, i in order:
        out += (fwd if kind is Op.FWD else bwd)[i]
        if kind is Op.BWD and i >= stage:
            out.append(Action(Op.WGT, done_w))
            done_w += 1
    return out + [Action(Op.WGT, mb) for mb in range(done_w, microbatches)]


def schedule_actions(*, stages: int, microbatches: int, schedule: str, virtual_stages: int = 1,
                     backward: bool = True) -> list[list[Action]]:
    """Every rank's list, rank by rank."""
    return [
        stage_actions(stage=s, stages=stages, microbatches=microbatches, schedule=schedule,
                      virtual_stages=virtual_stages, backward=backward)
        for s in range(stages)
    ]


def final_actions(actions: list[Action], *, stage: int) -> dict[tuple[int, Op], int]:
    """For each chunk of the rank: ``(chunk, Op.BWD)`` -> index of its last BWD and, if it has W's,
    ``(chunk, Op.WGT)`` -> index of its last WGT. After these a chunk's gradients are final (the
    non-deferred ones after its BWD, the deferred ones after its WGT), so the runtime arms the
    data-parallel buckets just before them."""
    out: dict[tuple[int, Op], int] = {}
    for i, a in enumerate(actions):
        if a.op is Op.BWD or a.op is Op.WGT:
            out[(chunk_of(a, stage=stage), a.op)] = i  # later ones overwrite
    return out


def deferred(actions: list[Action]) -> set[tuple[int | None, int]]:
    """The ``(action.chunk, action.mb)`` whose BWD defers its weight gradients to a WGT in this list
    (chunk as written in the actions: None in one-chunk lists)."""
    return {(a.chunk, a.mb) for a in actions if a.op is Op.WGT}


def peak_in_flight(actions: list[Action]) -> int:
    """Most (chunk, microbatch)es whose forward ran and whose backward has not (activations held)."""
    alive, peak = 0, 0
    for a in actions:
        alive += {Op.FWD: 1, Op.BWD: -1}.get(a.op, 0)
        peak = max(peak, alive)
    return peak


def format_grid(
    all_actions: list[list[Action]],
    *,
    mark: tuple[int, int] | None = None,
    marks: Collection[tuple[int, int]] = (),
) -> str:
    """Every stage's list side by side: one row per step (index in each list), one column per stage.

    ``mark=(stage, step)`` draws that cell as ``>F3<`` (the action that failed); ``marks`` draws
    several (the actions a deadlock leaves waiting). A stage whose list has ended shows blanks.
    """
    marked = set(marks) | ({mark} if mark is not None else set())
    cells = [[f" {a!r} " for a in acts] for acts in all_actions]
    for stage, step in marked:
        cells[stage][step] = f">{all_actions[stage][step]!r}<"
    headers = [f" stage {s}" for s in range(len(all_actions))]
    widths = [max([len(h), *map(len, col)]) for h, col in zip(headers, cells)]
    steps = max(map(len, all_actions), default=0)
    step_width = max(len("step"), len(str(steps - 1)))
    lines = [" ".join(["step".rjust(step_width), *(h.ljust(w) for h, w in zip(headers, widths))])]
    for i in range(steps):
        row = (col[i] if i < len(col) else "" for col in cells)
        lines.append(" ".join([str(i).rjust(step_width), *(c.ljust(w) for c, w in zip(row, widths))]))
    return "\n".join(line.rstrip() for line in lines)
