"""Pipeline schedules as pure data: (stages, microbatches, schedule) -> each stage's ordered actions.

Nothing here communicates. The runtime only executes these lists, and tests check them without any
process: forward before backward, warm-up counts, how many microbatches hold activations at once,
and that the lists cannot deadlock when sends are asynchronous and receives block.

An action is ``(op, mb)``. ``fwd``/``bwd`` compute; ``recv_fwd`` receives microbatch ``mb``'s input
activation from the previous stage and ``send_fwd`` passes its output on; ``recv_bwd`` receives the
gradient of its output from the next stage and ``send_bwd`` passes the gradient of its input back.
"""

from __future__ import annotations

from dataclasses import dataclass

SCHEDULES = ("1f1b", "gpipe")
COMPUTE = ("fwd", "bwd")
# Which op on the neighbour produces what a receive waits for, and in which direction it lives.
_MATCH = {"recv_fwd": ("send_fwd", -1), "recv_bwd": ("send_bwd", +1)}


@dataclass(frozen=True)
class Action:
    op: str
    mb: int

    def __repr__(self) -> str:
        return f"{self.op}({self.mb})"


def check_schedule_args(*, stages: int, microbatches: int, schedule: str) -> None:
    if schedule not in SCHEDULES:
        raise ValueError(f"schedule={schedule!r} is unknown; use one of {SCHEDULES}")
    for name, value in (("stages", stages), ("microbatches", microbatches)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ValueError(f"{name}={value!r} must be a positive integer")


def _forward(stage: int, stages: int, mb: int) -> list[Action]:
    return ([Action("recv_fwd", mb)] if stage > 0 else []) + [Action("fwd", mb)] + (
        [Action("send_fwd", mb)] if stage < stages - 1 else []
    )


def _backward(stage: int, stages: int, mb: int) -> list[Action]:
    return ([Action("recv_bwd", mb)] if stage < stages - 1 else []) + [Action("bwd", mb)] + (
        [Action("send_bwd", mb)] if stage > 0 else []
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
        alive += {"fwd": 1, "bwd": -1}.get(a.op, 0)
        peak = max(peak, alive)
    return peak


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
            raise RuntimeError(f"pipeline schedule deadlocks; stages wait at {stuck}")
    return trace
