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
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch.distributed import ProcessGroup


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
