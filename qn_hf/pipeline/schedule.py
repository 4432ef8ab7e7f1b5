"""Pipeline schedules as pure data: (stages, microbatches, schedule) -> each stage's ordered actions.

Nothing here communicates. The runtime only executes these lists, and tests check them without any
process: forward before backward, warm-up counts, how many microbatches hold activations at once,
and that the lists cannot deadlock when sends are asynchronous and receives block.

An action is ``(op, mb)``. ``FWD``/``BWD`` compute; ``RECV_FWD`` receives microbatch ``mb``'s input
activation from the previous stage and ``SEND_FWD`` passes its output on; ``RECV_BWD`` receives the
gradient of its output from the next stage and ``SEND_BWD`` passes the gradient of its input back.
``format_grid`` prints a whole schedule as a step x stage table, e.g. pp=2, 2 microbatches, 1F1B::

    step  stage 0  stage 1
       0  F0       rF0
       1  sF0      F0
       2  F1       B0
       3  sF1      sB0
       4  rB0     >rF1<
       ...

(``>rF1<`` marks a cell: the action that failed, or where a deadlocked stage waits.)
"""

from __future__ import annotations

import enum
from collections.abc import Collection
from dataclasses import dataclass

from ..arguments import check_choice, check_positive_int

SCHEDULES = ("1f1b", "gpipe")


class Op(str, enum.Enum):
    """What an action does. The values are the historical strings: recorded timelines and callers
    that compare ``op == "fwd"`` read the same as before."""

    FWD = "fwd"
    BWD = "bwd"
    RECV_FWD = "recv_fwd"
    SEND_FWD = "send_fwd"
    RECV_BWD = "recv_bwd"
    SEND_BWD = "send_bwd"

    def __str__(self) -> str:
        return self.value  # messages and f-strings keep showing "fwd", not "Op.FWD"

    @property
    def short(self) -> str:
        """The compact form used in grids: F, B, rF, sF, rB, sB."""
        return _SHORT[self]


_SHORT = {Op.FWD: "F", Op.BWD: "B", Op.RECV_FWD: "rF", Op.SEND_FWD: "sF", Op.RECV_BWD: "rB", Op.SEND_BWD: "sB"}
# Which op on the neighbour produces what a receive waits for, and in which direction it lives.
_MATCH = {Op.RECV_FWD: (Op.SEND_FWD, -1), Op.RECV_BWD: (Op.SEND_BWD, +1)}


@dataclass(frozen=True)
class Action:
    """One op on one microbatch; prints compactly as ``F3`` (forward of microbatch 3), ``rB0`` ..."""

    op: Op
    mb: int

    def __post_init__(self) -> None:
        # Accept the op's string value too (``Action("fwd", 0)``), so equality and hashing only
        # ever see Op members.
        object.__setattr__(self, "op", Op(self.op))

    def __repr__(self) -> str:
        return f"{self.op.short}{self.mb}"


def check_schedule_args(*, stages: int, microbatches: int, schedule: str) -> None:
    """The one home of the schedule-name and stage/microbatch-count checks."""
    check_choice("schedule", schedule, SCHEDULES)
    check_positive_int("stages", stages)
    check_positive_int("microbatches", microbatches)


def _forward(stage: int, stages: int, mb: int) -> list[Action]:
    return ([Action(Op.RECV_FWD, mb)] if stage > 0 else []) + [Action(Op.FWD, mb)] + (
        [Action(Op.SEND_FWD, mb)] if stage < stages - 1 else []
    )


def _backward(stage: int, stages: int, mb: int) -> list[Action]:
    return ([Action(Op.RECV_BWD, mb)] if stage < stages - 1 else []) + [Action(Op.BWD, mb)] + (
        [Action(Op.SEND_BWD, mb)] if stage > 0 else []
    )


def warmup_forwards(*, stage: int, stages: int, microbatches: int) -> int:
    """Forwards a 1F1B stage runs before its first backward (besides the one it pairs with it)."""
    return min(stages - stage - 1, microbatches)


def stage_actions(*, stage: int, stages: int, microbatches: int, schedule: str, backward: bool = True) -> list[Action]:
    """The ordered actions of one stage. ``backward=False`` gives the forward-only (eval) list."""
    check_schedule_args(stages=stages, microbatches=microbatches, schedule=schedule)
    if not 0 <= stage < stages:
        raise ValueError(f"stage={stage} is outside 0..{stages - 1}")
    fwd = [_forward(stage, stages, mb) for mb in range(microbatches)]
    bwd = [_backward(stage, stages, mb) for mb in range(microbatches)]
    if not backward:
        return [a for f in fwd for a in f]
    if schedule == "gpipe":
        return [a for f in fwd for a in f] + [a for b in bwd for a in b]
    # 1F1B: fill the pipe, then alternate one forward and one backward, then drain.
    warm = warmup_forwards(stage=stage, stages=stages, microbatches=microbatches)
    order: list[list[Action]] = fwd[:warm]
    for i in range(microbatches - warm):
        order += [fwd[warm + i], bwd[i]]
    order += bwd[microbatches - warm :]
    return [a for group in order for a in group]


def schedule_actions(*, stages: int, microbatches: int, schedule: str, backward: bool = True) -> list[list[Action]]:
    return [
        stage_actions(stage=s, stages=stages, microbatches=microbatches, schedule=schedule, backward=backward)
        for s in range(stages)
    ]


def peak_in_flight(actions: list[Action]) -> int:
    """Most microbatches whose forward ran and whose backward has not (activations held)."""
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


def simulate(all_actions: list[list[Action]]) -> list[tuple[int, Action]]:
    """Execute every stage's list with asynchronous sends and blocking receives; return the global
    order of execution, or raise ``RuntimeError`` naming the stuck actions on a deadlock."""
    done: list[set[Action]] = [set() for _ in all_actions]
    pos = [0] * len(all_actions)
    trace: list[tuple[int, Action]] = []
    while any(p < len(acts) for p, acts in zip(pos, all_actions)):
        progressed = False
        for s, acts in enumerate(all_actions):
            while pos[s] < len(acts):
                action = acts[pos[s]]
                if action.op in _MATCH:
                    send_op, direction = _MATCH[action.op]
                    peer = s + direction
                    if Action(send_op, action.mb) not in done[peer]:
                        break
                done[s].add(action)
                trace.append((s, action))
                pos[s] += 1
                progressed = True
        if not progressed:
            stuck = {s: acts[pos[s]] for s, acts in enumerate(all_actions) if pos[s] < len(acts)}
            grid = format_grid(all_actions, marks=[(s, pos[s]) for s in stuck])
            raise RuntimeError(f"pipeline schedule deadlocks; stages wait at {stuck}:\n{grid}")
    return trace
