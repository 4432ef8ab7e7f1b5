"""Checking whole schedules as data, without any process.

* ``simulate``: runs every rank's list with asynchronous sends and blocking receives (what the
  runtime does) and raises ``RuntimeError`` with the grid on a deadlock or when a link is not FIFO;
* ``check_order``: per rank, each (chunk, mb) has one forward, at most one backward and at most one
  weight pass, in that order, each wrapped in its receive before and its send after, on its own rank;
* ``timed``: the same run with a cost per compute op -> each rank's busy time, the makespan and the
  bubble fraction per rank;
* ``peaks``: per rank list, the most (chunk, mb)es alive from forward to backward (activations) and
  from forward to the weight pass (activations plus the W stash of zb_h1).

These checks model gloo: sends never block and messages match by tag. ``nccl_replay.py`` replays the
recorded calls of real steps under NCCL's rules instead (one FIFO stream per communicator, sends and
receives that block until matched, host reads that wait for the device); the tests run it for every
schedule.

Peers come from chunks: a receive of chunk c comes from chunk c-1 (activation) or c+1 (gradient)
on ``rank_of_chunk``, so interleaved lists run around a ring (rank pp-1 sends chunk pp-1's output to
rank 0). In one-chunk lists the chunk is the stage and the peers are the neighbours.
"""

from __future__ import annotations

from collections import Counter, defaultdict
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from .schedule import COMPUTE_OPS, Action, Op, chunk_of, deferred, format_grid, rank_of_chunk

# A message is (kind, receiving chunk, mb): unique in a step, as gloo's tags make it.
Message = tuple[str, int, int]


def _message(action: Action, *, stage: int, stages: int) -> tuple[int, int, Message] | None:
    """For a send or a receive: (source rank, destination rank, message); None for compute."""
    chunk = chunk_of(action, stage=stage)
    if action.op is Op.SEND_FWD:
        return stage, rank_of_chunk(chunk + 1, stages=stages), ("act", chunk + 1, action.mb)
    if action.op is Op.SEND_BWD:
        return stage, rank_of_chunk(chunk - 1, stages=stages), ("grad", chunk - 1, action.mb)
    if action.op is Op.RECV_FWD:
        return rank_of_chunk(chunk - 1, stages=stages), stage, ("act", chunk, action.mb)
    if action.op is Op.RECV_BWD:
        return rank_of_chunk(chunk + 1, stages=stages), stage, ("grad", chunk, action.mb)
    return None


def _walk(all_actions: list[list[Action]]) -> list[tuple[int, Action]]:
    """Every rank runs its list as far as it can; a receive blocks until its send ran anywhere."""
    stages = len(all_actions)
    sent: set[Message] = set()
    pos = [0] * stages
    trace: list[tuple[int, Action]] = []
    # each action's message once (a blocked receive is looked at again on every pass)
    links = [[_message(a, stage=s, stages=stages) for a in acts] for s, acts in enumerate(all_actions)]
    while any(p < len(acts) for p, acts in zip(pos, all_actions)):
        progressed = False
        for s, acts in enumerate(all_actions):
            while pos[s] < len(acts):
                action = acts[pos[s]]
                link = links[s][pos[s]]
                if action.op in (Op.RECV_FWD, Op.RECV_BWD):
                    if link[2] not in sent:
                        break
                elif link is not None:
                    sent.add(link[2])
                trace.append((s, action))
                pos[s] += 1
                progressed = True
        if not progressed:
            stuck = {s: acts[pos[s]] for s, acts in enumerate(all_actions) if pos[s] < len(acts)}
            grid = format_grid(all_actions, marks=[(s, pos[s]) for s in stuck])
            raise RuntimeError(f"pipeline schedule deadlocks; stages wait at {stuck}:\n{grid}")
    return trace


def check_links(all_actions: list[list[Action]]) -> None:
    """FIFO per directed link: for every ordered pair of ranks (a, b), a's sends to b (activations
    and gradients together, in a's list order) must be b's receives from a in b's list order.
    NCCL matches point-to-point operations between two ranks by order and ignores tags, so any
    other order hands b the wrong tensor (silently when the shapes agree)."""
    stages = len(all_actions)
    sends: dict[tuple[int, int], list[tuple[int, Message]]] = defaultdict(list)
    recvs: dict[tuple[int, int], list[tuple[int, Message]]] = defaultdict(list)
    for s, acts in enumerate(all_actions):
        for i, action in enumerate(acts):
            link = _message(action, stage=s, stages=stages)
            if link is not None:
                side = sends if action.op in (Op.SEND_FWD, Op.SEND_BWD) else recvs
                side[link[0], link[1]].append((i, link[2]))
    for a, b in sorted(set(sends) | set(recvs)):
        out, into = sends[a, b], recvs[a, b]
        k = next((k for k, (x, y) in enumerate(zip(out, into)) if x[1] != y[1]), min(len(out), len(into)))
        if k == len(out) == len(into):
            continue
        marks = ([(a, out[k][0])] if k < len(out) else []) + ([(b, into[k][0])] if k < len(into) else [])
        sent = repr(all_actions[a][out[k][0]]) if k < len(out) else "nothing"
        got = repr(all_actions[b][into[k][0]]) if k < len(into) else "nothing"
        raise RuntimeError(
            f"pipeline schedule breaks FIFO order on link rank {a} -> rank {b}: message {k} sent is {sent} "
            f"but message {k} received is {got}; NCCL matches by order, not tags, so rank {b} would get "
            f"the wrong tensor:\n{format_grid(all_actions, marks=marks)}"
        )


def simulate(all_actions: list[list[Action]]) -> list[tuple[int, Action]]:
    """Execute every rank's list with asynchronous sends and blocking receives; return the global
    order of execution, or raise ``RuntimeError`` naming the stuck actions on a deadlock, or the
    first out-of-order message when a link is not FIFO (``check_links``)."""
    trace = _walk(all_actions)
    check_links(all_actions)
    return trace


def check_order(all_actions: list[list[Action]]) -> None:
    """Raise ``ValueError`` with the grid unless every rank's list is well formed: each (chunk, mb)
    on its own rank (``rank_of_chunk``) has one FWD, at most one BWD and at most one WGT (only with
    a BWD), in that order; each receive comes right before its compute and each send right after it,
    except at the two ends of the pipeline."""
    stages = len(all_actions)
    labelled = [chunk_of(a, stage=s) for s, acts in enumerate(all_actions) for a in acts if a.chunk is not None]
    last = stages - 1 if not labelled else stages * (max(labelled) // stages + 1) - 1

    def fail(stage: int, step: int, why: str) -> None:
        raise ValueError(f"rank {stage} step {step} ({all_actions[stage][step]!r}): {why}:\n"
                         f"{format_grid(all_actions, mark=(stage, step))}")

    for s, acts in enumerate(all_actions):
        seen: Counter[tuple[Op, int, int]] = Counter()
        for i, a in enumerate(acts):
            chunk = chunk_of(a, stage=s)
            if rank_of_chunk(chunk, stages=stages) != s:
                fail(s, i, f"chunk {chunk} lives on rank {rank_of_chunk(chunk, stages=stages)}")
            if a.op in COMPUTE_OPS:
                seen[a.op, chunk, a.mb] += 1
                if seen[a.op, chunk, a.mb] > 1:
                    fail(s, i, "runs twice")
                before = {Op.BWD: Op.FWD, Op.WGT: Op.BWD}.get(a.op)
                if before is not None and not seen[before, chunk, a.mb]:
                    fail(s, i, f"runs before its {before}")
            wrapped = {Op.RECV_FWD: (Op.FWD, +1, chunk > 0), Op.SEND_FWD: (Op.FWD, -1, chunk < last),
                       Op.RECV_BWD: (Op.BWD, +1, chunk < last), Op.SEND_BWD: (Op.BWD, -1, chunk > 0)}
            for comm, (compute, step, needed) in wrapped.items():
                if a.op is comm and not needed:
                    fail(s, i, "an end of the pipeline neither receives nor sends there")
                if a.op is compute and needed:
                    j = i - step
                    if not (0 <= j < len(acts) and acts[j] == Action(comm, a.mb, a.chunk)):
                        fail(s, i, f"not wrapped by its {comm}")


@dataclass(frozen=True)
class Timing:
    """A timed run: each rank's busy time (sum of its compute costs) and the makespan."""

    busy: tuple[float, ...]
    makespan: float

    @property
    def bubble(self) -> tuple[float, ...]:
        """Per rank, the fraction of the makespan it idles."""
        return tuple(1 - b / self.makespan if self.makespan else 0.0 for b in self.busy)


@dataclass(frozen=True)
class Run:
    """A valid execution of every rank's lists (``simulate``'s order: each send before its receive),
    kept so that it can be timed at many costs without walking and checking the lists again: per
    step, (rank, compute op or None, the message a send posts or a receive waits for, numbered; -1
    for compute, with ``sends`` telling the two apart), and each rank's compute ops."""

    stages: int
    steps: tuple[tuple[int, Op | None, int], ...]
    sends: frozenset[int]  # the steps (by index) that are sends
    ops: tuple[frozenset[Op], ...]


def run_of(all_actions: list[list[Action]]) -> Run:
    """The lists' ``Run``; raises like ``simulate``."""
    stages = len(all_actions)
    numbers: dict[Message, int] = {}
    steps, sends = [], set()
    for s, action in simulate(all_actions):
        if action.op in COMPUTE_OPS:
            steps.append((s, action.op, -1))
            continue
        message = _message(action, stage=s, stages=stages)[2]
        if action.op in (Op.SEND_FWD, Op.SEND_BWD):
            sends.add(len(steps))
        steps.append((s, None, numbers.setdefault(message, len(numbers))))
    ops = tuple(frozenset(a.op for a in acts if a.op in COMPUTE_OPS) for acts in all_actions)
    return Run(stages=stages, steps=tuple(steps), sends=frozenset(sends), ops=ops)


def timed(all_actions: list[list[Action]] | Run, *,
          costs: Mapping[Op, float] | Sequence[Mapping[Op, float]]) -> Timing:
    """Run the lists (or their ``Run``) with each compute op taking ``costs[op]``, or
    ``costs[rank][op]`` with one mapping per rank (every compute op used must have a cost); sends
    and receives take no time, and a receive waits until the sender's matching send, i.e. the end of
    the compute before it. Raises like ``simulate`` first."""
    run = all_actions if isinstance(all_actions, Run) else run_of(all_actions)
    stages = run.stages
    per_rank = [costs] * stages if isinstance(costs, Mapping) else list(costs)
    for used, rank_costs in zip(run.ops, per_rank):
        missing = used - set(rank_costs)
        if missing:
            raise ValueError(f"costs has no entry for {sorted(map(str, missing))}")
    clock = [0.0] * stages
    busy = [0.0] * stages
    sent_at: dict[int, float] = {}
    sends = run.sends
    for i, (s, op, message) in enumerate(run.steps):
        if op is not None:
            cost = per_rank[s][op]
            clock[s] += cost
            busy[s] += cost
        elif i in sends:
            sent_at[message] = clock[s]
        else:
            clock[s] = max(clock[s], sent_at[message])
    return Timing(busy=tuple(busy), makespan=max(clock, default=0.0))


@dataclass(frozen=True)
class Peaks:
    """The most (chunk, mb)es a rank holds at once: ``f_to_b`` from forward to backward (full
    activations), ``f_to_w`` from forward to the last gradient pass (its W if deferred, else its B)."""

    f_to_b: int
    f_to_w: int


def peaks(actions: list[Action]) -> Peaks:
    """``Peaks`` of one rank's list."""
    with_w = deferred(actions)
    f_to_b = f_to_w = peak_b = peak_w = 0
    for a in actions:
        if a.op is Op.FWD:
            f_to_b, f_to_w = f_to_b + 1, f_to_w + 1
        elif a.op is Op.BWD:
            f_to_b -= 1
            if (a.chunk, a.mb) not in with_w:
                f_to_w -= 1
        elif a.op is Op.WGT:
            f_to_w -= 1
        peak_b, peak_w = max(peak_b, f_to_b), max(peak_w, f_to_w)
    return Peaks(f_to_b=peak_b, f_to_w=peak_w)
