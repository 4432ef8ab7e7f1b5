"""Replaying recorded communication calls through a model of NCCL's semantics, without processes.

``schedule_check`` proves schedules under gloo's rules: a receive blocks its rank, a send never
blocks, messages match by tag. NCCL differs, and a pipeline that runs under gloo can hang at its
first step under NCCL. This module replays what every rank actually called (recorded in a gloo run,
see tests/p2p_recorder.py) under these rules:

* every communicator has one FIFO stream per member rank; an operation starts when it is at the
  head of that stream and the rank's compute stream has passed the point where the host posted it
  (NCCL's stream waits for the tensors it sends or fills);
* a send and its receive complete together, matched by their order between the two ranks on that
  communicator (tags are ignored); until both have started, each holds up its stream. A small send
  may go eagerly in real NCCL; the model treats every send as large, which can only find more
  deadlocks, never fewer;
* a collective completes when every member has started its operation of the same order;
* ``Work.wait()`` makes the compute stream wait for the operation, not the host;
* a host read of device data (``.item()``, ``.tolist()``) blocks the host until the compute stream
  has passed everything enqueued before it.

Point-to-point operations between ranks a and b of a process group use that group's communicator
for the pair {a, b} (ProcessGroupNCCL creates one per peer pair); collectives use the group's own.
Streams of different communicators progress independently, as CUDA streams do.

``replay`` returns the number of operations completed or raises ``NcclDeadlock`` naming, per rank,
where its host stopped and what each blocked stream waits for.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Sequence
from dataclasses import dataclass, field

POST, WAIT, SYNC = "post", "wait", "sync"
SEND, RECV, COLLECTIVE = "send", "recv", "collective"


@dataclass(frozen=True)
class Call:
    """One host-side call of a rank, in program order.

    ``post``: an operation ``op`` (unique per rank) on process group ``group`` (its name, the same on
    every member) of ``kind`` send/recv (``peer``: the other rank, global) or collective (``members``:
    the group's global ranks). ``wait``: the compute stream waits for ``op``. ``sync``: the host reads
    device data."""

    what: str
    op: int = -1
    group: str = ""
    kind: str = ""
    peer: int = -1
    members: tuple[int, ...] = ()
    label: str = ""  # what the caller was doing, for messages

    def to_json(self) -> dict:
        return {k: (list(v) if isinstance(v, tuple) else v) for k, v in self.__dict__.items()
                if v not in (-1, "", ())}

    @staticmethod
    def from_json(d: dict) -> Call:
        return Call(**{k: (tuple(v) if isinstance(v, list) else v) for k, v in d.items()})


class NcclDeadlock(RuntimeError):
    """The replayed calls cannot complete under NCCL's semantics."""


@dataclass
class _Op:
    rank: int
    op: int
    stream: tuple[str, int]  # (communicator, rank)
    kind: str
    peer: int
    match: tuple  # what pairs it with its partners: the same on every partner
    gate: int  # compute-stream items that must be done before it can start
    label: str
    done: bool = False


@dataclass
class _Rank:
    calls: Sequence[Call]
    host: int = 0
    waits: list[_Op] = field(default_factory=list)  # the compute stream's waits, in order
    passed: int = 0  # how many of them the compute stream has passed


def _communicator(call: Call, rank: int) -> str:
    if call.kind == COLLECTIVE:
        return call.group
    low, high = sorted((rank, call.peer))
    return f"{call.group}:{low}-{high}"


def replay(traces: Sequence[Sequence[Call]]) -> int:
    """Run every rank's calls (``traces[r]``) under the model above; return how many operations
    completed, or raise ``NcclDeadlock``."""
    ranks = [_Rank(calls=t) for t in traces]
    ops: dict[tuple[int, int], _Op] = {}
    streams: dict[tuple[str, int], list[_Op]] = defaultdict(list)
    heads: dict[tuple[str, int], int] = defaultdict(int)
    partners: dict[tuple, list[_Op]] = defaultdict(list)
    counters: dict[tuple, int] = defaultdict(int)
    expected: dict[tuple, int] = {}
    completed = 0

    def post(rank: int, call: Call) -> None:
        comm = _communicator(call, rank)
        if call.kind == COLLECTIVE:  # each member's n-th collective on the communicator
            order, counted = (comm,), (comm, rank)
            expected[comm] = len(call.members)
        else:  # the n-th send from a to b with the n-th receive at b from a
            order = (comm, rank, call.peer) if call.kind == SEND else (comm, call.peer, rank)
            counted = (*order, call.kind)
        n = counters[counted]
        counters[counted] += 1
        op = _Op(rank=rank, op=call.op, stream=(comm, rank), kind=call.kind, peer=call.peer, match=(*order, n),
                 gate=len(ranks[rank].waits), label=call.label or f"{call.kind} op {call.op}")
        ops[rank, call.op] = op
        streams[op.stream].append(op)
        partners[op.match].append(op)

    def started(op: _Op) -> bool:
        stream = streams[op.stream]
        return heads[op.stream] < len(stream) and stream[heads[op.stream]] is op and ranks[op.rank].passed >= op.gate

    def complete_what_can() -> bool:
        nonlocal completed
        progressed = False
        for key in list(streams):
            if heads[key] >= len(streams[key]):
                continue
            op = streams[key][heads[key]]
            group = partners[op.match]
            needed = expected[op.match[0]] if op.kind == COLLECTIVE else 2
            if len(group) == needed and all(started(o) for o in group):
                for o in group:
                    o.done = True
                    heads[o.stream] += 1
                completed += len(group)
                progressed = True
        return progressed

    def advance(r: int, state: _Rank) -> bool:
        progressed = False
        while state.passed < len(state.waits) and state.waits[state.passed].done:
            state.passed += 1
            progressed = True
        while state.host < len(state.calls):
            call = state.calls[state.host]
            if call.what == POST:
                post(r, call)
            elif call.what == WAIT:
                state.waits.append(ops[r, call.op])
            elif call.what == SYNC:
                if state.passed < len(state.waits):
                    break
            else:
                raise ValueError(f"rank {r}: unknown call {call!r}")
            state.host += 1
            progressed = True
        return progressed

    while True:
        progressed = any([advance(r, s) for r, s in enumerate(ranks)])
        progressed = complete_what_can() or progressed
        if not progressed:
            break
    if all(s.host == len(s.calls) and s.passed == len(s.waits) for s in ranks) and all(o.done for o in ops.values()):
        return completed
    raise NcclDeadlock(_describe(ranks, streams, heads))


def _describe(ranks: list[_Rank], streams: dict, heads: dict) -> str:
    lines = ["the recorded calls deadlock under NCCL's semantics (one FIFO stream per communicator and rank):"]
    for r, s in enumerate(ranks):
        host = ("finished" if s.host == len(s.calls) else
                f"host blocked at call {s.host} ({s.calls[s.host].what} {s.calls[s.host].label})")
        compute = ("compute stream clear" if s.passed == len(s.waits) else
                   f"compute stream waits for {s.waits[s.passed].label}")
        blocked = [f"{key[0]}: {streams[key][heads[key]].label}" for key in streams
                   if key[1] == r and heads[key] < len(streams[key])]
        lines.append(f"  rank {r}: {host}; {compute}; stream heads: {'; '.join(blocked) or 'none'}")
    return "\n".join(lines)
