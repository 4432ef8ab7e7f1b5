"""Point-to-point transfers between pipeline stages: one communicator per direction of a link.

Why not one communicator for both directions (the world group, as a first version had): NCCL runs
all operations between two ranks of a communicator on one stream, in the order they were posted,
and matches sends with receives by that order, never by tag. A receive at the head of the stream,
or a send too large to go eagerly, holds up everything queued behind it until the peer posts the
matching half. Stage 0 of a pipeline posts the receive of microbatch 0's gradient early (to overlap
it with compute) and then sends the activation that stage 1 needs before it can ever send that
gradient: on one shared stream the send waits behind the receive, which waits for stage 1, which
waits for the send. Two remedies exist: batching each step's sends and receives into one NCCL group
(``batch_isend_irecv``, as torch's ``pipelining`` and Megatron do) or giving each direction of a
neighbour pair a communicator of its own. qn_hf does the second: a link's stream then carries
messages one way only, in the order both ends agree on (``schedule_check.check_links`` proves that
order for every schedule), so a posted receive waits only for sends of its own direction, and the
executor can keep posting the next receive early. ``nccl_replay`` replays the recorded calls of real
steps through a model of these semantics; the tests run it for every schedule.

A directed link is a two-rank process group created for that direction only; with pp=2 and a ring
(interleaved schedules) the link to the next stage and the link to the previous one are the same
directed pair, hence the same group, and ``check_links`` covers their shared order too. Tags stay:
gloo matches on them, NCCL ignores them.

**The first use of a link blocks the host.** ProcessGroupNCCL creates a point-to-point communicator
lazily, at the first ``isend``/``irecv`` of a pair, and NCCL connects the pair lazily too; either
way the host of the first call waits until the peer makes its own first call on that communicator
(PyTorch issues 136248, 152220, 160210; NCCL issue 783). A pipeline's first step uses its links in
an order no rank agrees on with its neighbours: stage 0 posts the receive of its first gradient (on
the link from stage 1) right after its first forward, while stage 1 waits on the link from stage 0
for the activation header; each host blocks on a link the other has not touched yet, and 1F1B,
GPipe and ZB-H1 hang at step one. So ``warm_up`` makes one tiny transfer on every directed link when
the groups are built, walking the links in one global order that every rank knows
(``directed_pairs``): each transfer involves exactly two ranks, and each rank takes its transfers in
that order, so the earliest transfer not yet done always has both ends waiting on it (both have
finished everything before it) and the walk cannot deadlock. Batching the first step's operations
into one NCCL group, as torch's ``pipelining`` does, would also avoid the hang but ties every
transfer of a step to one group call, which this executor's early-posted receives (above) exist to
avoid. ``nccl_replay`` models the first-use rule, and its tests show the recorded steps hang without
the warm-up. The pipeline's links are qn_hf's only point-to-point communicators: ring attention
batches each exchange with both neighbours (``batch_isend_irecv``), which NCCL runs on the cp
group's own communicator, made with the group and entered by every cp rank at the same point.
"""

from __future__ import annotations

import datetime
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch.distributed import ProcessGroup

from ..comm import member_groups

# The warm-up's transfers carry a tag no step uses (steps tag from 0 up: ``runtime.StageExecutor._tag``),
# so that under gloo, which matches by tag, they can never pair with a step's message.
WARM_UP_TAG = 2**30


@dataclass(frozen=True)
class Link:
    """One direction between this rank and a neighbouring stage: the peer's global rank and the
    process group that carries this direction's messages only."""

    peer: int
    group: ProcessGroup

    def send(self, tensor: torch.Tensor, *, tag: int) -> dist.Work:
        """Post an asynchronous send of ``tensor`` (which must stay alive until the work completes)."""
        return dist.isend(tensor, dst=self.peer, group=self.group, tag=tag)

    def recv(self, tensor: torch.Tensor, *, tag: int) -> dist.Work:
        """Post an asynchronous receive into ``tensor``."""
        return dist.irecv(tensor, src=self.peer, group=self.group, tag=tag)


@dataclass(frozen=True)
class Peers:
    """The neighbouring stages of this rank (global ranks; None without a pipeline) and the links to
    and from them. ``prev``/``next`` without links are for single-rank executors only: a pipeline
    that sends anything needs its directed links (see the module docstring)."""

    prev: int | None
    next: int | None
    to_next: Link | None = None
    from_prev: Link | None = None
    to_prev: Link | None = None
    from_next: Link | None = None

    def __post_init__(self) -> None:
        for name, peer in (("to_next", self.next), ("from_next", self.next), ("to_prev", self.prev),
                           ("from_prev", self.prev)):
            link = getattr(self, name)
            if peer is not None and (link is None or link.peer != peer):
                raise ValueError(f"Peers(prev={self.prev}, next={self.next}): {name} must be a Link to rank {peer} "
                                 f"(one process group per direction), got {link}")


def directed_pairs(ring: list[list[int]]) -> list[tuple[int, int]]:
    """Every (source, destination) pair of neighbouring stages, both directions, once each, from the
    global ranks of each pipeline (``ring[i]`` = the ranks of one pipeline, stage order; the last
    stage's next is the first, which interleaved schedules use)."""
    pairs: dict[tuple[int, int], None] = {}
    for ranks in ring:
        n = len(ranks)
        if n < 2:
            continue
        for i, a in enumerate(ranks):
            b = ranks[(i + 1) % n]
            pairs[(a, b)] = None
            pairs[(b, a)] = None
    return list(pairs)


def warm_up(links: Mapping[tuple[int, int], ProcessGroup], order: Sequence[tuple[int, int]], *,
            device: torch.device) -> None:
    """One tiny transfer on each directed link this rank is an end of (``links[src, dst]``), taken in
    ``order``, the same list of (source, destination) pairs on every rank (``directed_pairs``): after
    it every link's communicator exists and its pair is connected, so no later first use blocks the
    host (the module docstring says why this order cannot deadlock). Every rank calls it once, when
    the links are built; the work is waited for on the stream, not on the host."""
    me = dist.get_rank()
    token = torch.zeros(1, device=device)
    for src, dst in order:
        if me == src:
            Link(dst, links[src, dst]).send(token, tag=WARM_UP_TAG).wait()
        elif me == dst:
            Link(src, links[src, dst]).recv(torch.empty_like(token), tag=WARM_UP_TAG).wait()


def build_links(ring: list[list[int]], *, device: torch.device,
                timeout: datetime.timedelta) -> dict[tuple[int, int], ProcessGroup]:
    """This rank's directed links, ``{(source, destination): group}``, over the pipelines ``ring``
    (as ``directed_pairs`` takes it), warmed up. Every rank calls it with the same ``ring``:
    making a group is collective over the whole world, so every rank makes every link's group, in the
    same order (a round of disjoint links at a time: ``link_rounds``), and keeps its own."""
    me = dist.get_rank()
    order = directed_pairs(ring)
    links = {}
    for pairs in link_rounds(order):  # a round's links are made together (comm.member_groups)
        group = member_groups([[src, dst] for src, dst in pairs], timeout=timeout)
        for src, dst in pairs:
            if me in (src, dst):
                links[src, dst] = group
    warm_up(links, order, device=device)
    return links


def link_rounds(order: Sequence[tuple[int, int]]) -> list[list[tuple[int, int]]]:
    """``order``'s directed pairs in rounds of pairs that share no rank (so that one split can make a round's
    groups), assigned greedily in order, the same rounds on every rank. A rank is an end of at most four links
    (to and from each neighbour), so greedy needs at most seven rounds, whatever the number of pipelines."""
    rounds: list[list[tuple[int, int]]] = []
    busy: list[set[int]] = []
    for pair in order:
        for pairs, taken in zip(rounds, busy):
            if not taken.intersection(pair):
                pairs.append(pair)
                taken.update(pair)
                break
        else:
            rounds.append([pair])
            busy.append(set(pair))
    return rounds
