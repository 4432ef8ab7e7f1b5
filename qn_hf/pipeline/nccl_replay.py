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
* ``Work.wait()`` (and a functional collective's ``wait_tensor``) makes the compute stream wait for
  the operation, not the host;
* a host read of device data (``.item()``, ``.tolist()``) blocks the host until the compute stream
  has passed everything enqueued before it; ``torch.cuda.synchronize`` (``DEVICE_SYNC``) blocks it
  until every stream of the device is clear: the compute stream and every operation this rank has
  posted, receives still waiting for their peer included;
* **first use** (``first_use=True``): a communicator is created at its first operation, and the host
  of that call blocks until every member has made its own first call there (ProcessGroupNCCL's lazy
  communicators and NCCL's lazy connections; ``pipeline/p2p.py`` says how qn_hf avoids the hang).
  With ``eager=True`` (the default group bound to a device, as ``init_distributed`` binds it), a
  group's collective communicator is created with the group instead (``CREATE``, blocking until
  every member has created it), and one created before the trace began is taken to exist; a pair's
  point-to-point communicator is always created at first use;
* **a shared stream pool** (``pool``): each communicator takes its stream from CUDA's pool of
  low-priority streams when it is created, round-robin; once more communicators exist on a device
  than the pool has streams (32), later ones share a stream with earlier ones and their operations
  queue behind each other. ``streams_before`` counts those taken before the trace (the default
  group's). ``pool=None`` gives every communicator a stream of its own.

Point-to-point operations between ranks a and b of a process group use that group's communicator
for the pair {a, b} (ProcessGroupNCCL creates one per peer pair); collectives use the group's own.
Streams of different communicators progress independently, as CUDA streams do.

``replay`` returns the number of operations completed or raises ``NcclDeadlock`` naming, per rank,
where its host stopped and what each blocked stream waits for.

**A device-wide wait may fall between any two host calls** (``device_waits``): the caching allocator's
retry after an out-of-memory synchronizes the device, as do inductor's autotuning, ``empty_cache`` and
profilers, none of which the program chooses the place of. ``device_waits`` replays the traces once per
place with a ``DEVICE_SYNC`` there (each rank, right after each receive it posts: ``device_waits`` says why
those suffice), and lists the places that deadlock: a receive posted ahead of a send its sender waits for.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Sequence
from dataclasses import dataclass, field

from ..arguments import Choice


class Step(Choice):
    """What a recorded host call does: posts work on a stream, waits for it, or blocks the host."""

    POST = "post"
    WAIT = "wait"
    SYNC = "sync"
    DEVICE_SYNC = "device_sync"
    CREATE = "create"


class Work(Choice):
    """What a posted call runs on its communicator."""

    SEND = "send"
    RECV = "recv"
    COLLECTIVE = "collective"


POST, WAIT, SYNC, DEVICE_SYNC, CREATE = Step
SEND, RECV, COLLECTIVE = Work
CUDA_STREAM_POOL = 32  # low-priority streams per device in c10's pool (kStreamsPerPool)


@dataclass(frozen=True)
class Call:
    """One host-side call of a rank, in program order.

    ``post``: an operation ``op`` (unique per rank) on process group ``group`` (its name, the same on
    every member) of ``kind`` send/recv (``peer``: the other rank, global) or collective (``members``:
    the group's global ranks). ``wait``: the compute stream waits for ``op``. ``sync``: the host reads
    device data. ``device_sync``: the host waits for the whole device. ``create``: process group
    ``group`` of ``members`` is created."""

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
    stream: tuple  # the FIFO it queues on
    kind: str
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
    posted: list[_Op] = field(default_factory=list)
    streams: dict[str, tuple] = field(default_factory=dict)  # communicator -> its stream (once created)
    blocked: str = ""  # why the host waits, when it waits on other ranks' first use


def _communicator(call: Call, rank: int) -> str:
    if call.kind == COLLECTIVE or call.what == CREATE:
        return call.group
    low, high = sorted((rank, call.peer))
    return f"{call.group}:{low}-{high}"


def _members(call: Call, rank: int) -> frozenset[int]:
    return frozenset(call.members) if call.kind == COLLECTIVE or call.what == CREATE else frozenset((rank, call.peer))


def replay(traces: Sequence[Sequence[Call]], *, first_use: bool = True, eager: bool = True,
           pool: int | None = CUDA_STREAM_POOL, streams_before: int = 1) -> int:
    """Run every rank's calls (``traces[r]``) under the model above; return how many operations
    completed, or raise ``NcclDeadlock``."""
    ranks = [_Rank(calls=t) for t in traces]
    ops: dict[tuple[int, int], _Op] = {}
    streams: dict[tuple, list[_Op]] = defaultdict(list)
    heads: dict[tuple, int] = defaultdict(int)
    partners: dict[tuple, list[_Op]] = defaultdict(list)
    counters: dict[tuple, int] = defaultdict(int)
    expected: dict[str, int] = {}
    arrived: dict[str, set[int]] = defaultdict(set)  # communicator -> ranks whose host reached its creation
    created: list[set[str]] = [{t.group for t in trace if t.what == CREATE} if eager else set() for trace in traces]
    completed = 0

    def stream_of(r: int, comm: str) -> tuple:
        state = ranks[r]
        if comm not in state.streams:
            slot = (streams_before + len(state.streams)) % pool if pool else comm
            state.streams[comm] = (r, slot)
        return state.streams[comm]

    def may_go(r: int, call: Call) -> bool:
        """Whether the host may pass a call that creates or first uses a communicator: not while a
        member has yet to arrive there (first use blocks the host)."""
        comm, state = _communicator(call, r), ranks[r]
        if comm in state.streams:
            return True
        blocking = call.what == CREATE or (
            first_use and not (eager and call.kind == COLLECTIVE and comm not in created[r]))
        if not blocking:
            return True
        arrived[comm].add(r)
        missing = sorted(_members(call, r) - arrived[comm])
        state.blocked = f"first use of communicator {comm} waits for rank(s) {missing}" if missing else ""
        return not missing

    def post(r: int, call: Call) -> None:
        comm = _communicator(call, r)
        if call.kind == COLLECTIVE:  # each member's n-th collective on the communicator
            order, counted = (comm,), (comm, r)
            expected[comm] = len(call.members)
        else:  # the n-th send from a to b with the n-th receive at b from a
            order = (comm, r, call.peer) if call.kind == SEND else (comm, call.peer, r)
            counted = (*order, call.kind)
        n = counters[counted]
        counters[counted] += 1
        op = _Op(rank=r, op=call.op, stream=stream_of(r, comm), kind=call.kind, match=(*order, n),
                 gate=len(ranks[r].waits), label=call.label or f"{call.kind} op {call.op} on {comm}")
        ops[r, call.op] = op
        ranks[r].posted.append(op)
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
            if call.what == CREATE and not eager:
                pass  # created at its first use instead
            elif call.what in (POST, CREATE):
                if not may_go(r, call):
                    break
                if call.what == POST:
                    post(r, call)
                else:
                    stream_of(r, call.group)
            elif call.what == WAIT:
                state.waits.append(ops[r, call.op])
            elif call.what == SYNC:
                if state.passed < len(state.waits):
                    break
            elif call.what == DEVICE_SYNC:
                if state.passed < len(state.waits) or not all(o.done for o in state.posted):
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
    lines = ["the recorded calls deadlock under NCCL's semantics (FIFO streams, first use blocks the host):"]
    for r, s in enumerate(ranks):
        if s.host == len(s.calls):
            host = "finished"
        else:
            call = s.calls[s.host]
            why = f": {s.blocked}" if s.blocked else ""
            host = f"host blocked at call {s.host} ({call.what} {call.label}){why}"
        compute = ("compute stream clear" if s.passed == len(s.waits) else
                   f"compute stream waits for {s.waits[s.passed].label}")
        blocked = [f"stream {key[1]}: {streams[key][heads[key]].label}" for key in streams
                   if key[0] == r and heads[key] < len(streams[key])]
        lines.append(f"  rank {r}: {host}; {compute}; stream heads: {'; '.join(blocked) or 'none'}")
    return "\n".join(lines)


def device_waits(traces: Sequence[Sequence[Call]], *, within: Sequence[range] | None = None, every_gap: bool = False,
                 **rules) -> list[tuple[int, int, str]]:
    """(rank, position, the deadlock's description) for every place a device-wide wait deadlocks ``traces``
    (module docstring), ``rules`` as ``replay``'s; ``within[rank]``: those gaps of each rank only.

    One replay per place. Only a receive this rank has posted can hold a device-wide wait on a peer (a send
    posted waits for a receive its peer reaches without this rank, under the schedule checks' rule that sends
    never block; a collective for members that posted it in the same order), and the most a wait can find
    is right after that receive is posted, before any later call of this rank: so the places tried are those
    (every gap with ``every_gap``)."""
    found = []
    for rank, calls in enumerate(traces):
        gaps = within[rank] if within is not None else range(len(calls) + 1)
        places = gaps if every_gap else [i + 1 for i, c in enumerate(calls) if c.kind == RECV and c.what == POST
                                         and i + 1 in gaps]
        for position in places:
            placed = [list(t) for t in traces]
            placed[rank].insert(position, Call(DEVICE_SYNC, label="a device-wide wait (allocator retry, autotuning)"))
            try:
                replay(placed, **rules)
            except NcclDeadlock as e:
                found.append((rank, position, str(e)))
    return found
