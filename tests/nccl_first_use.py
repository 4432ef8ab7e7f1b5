"""NCCL's first-use rule, emulated on gloo: a rank's first point-to-point operation on a process
group's pair of ranks waits on the host until the peer makes its own first operation there.

ProcessGroupNCCL creates the communicator of a pair lazily, at its first ``isend``/``irecv``, and the
host of that call blocks until the peer's first call on the same communicator (NCCL's lazy connection
does the same). gloo has no such rule, so a pipeline whose first step hangs on a GPU passes on CPU.
Inside ``with FirstUseRule():`` each rank's first p2p call on a (group, pair) first exchanges a token
with the peer on that group (a tag no step uses) and waits for the peer's token, with a timeout: a
rank whose peer never arrives raises ``FirstUseHang`` naming the group, instead of hanging as NCCL
would. Groups made with ``backend="gloo"`` stay gloo on a NCCL world (the hosts' exchange, ``comm.host_max_``):
no rule there. Batched operations (``batch_isend_irecv``: ring attention) go to NCCL on the group's own
communicator, created with the group when the default group is bound to a device
(``qn_hf.mesh.init_distributed``), so they pass through unchanged. Test instrumentation only.
"""

from __future__ import annotations

import datetime
import functools
import inspect

import torch
import torch.distributed as dist

from tests.dist_patches import P2P, Patches

HANDSHAKE_TAG = 2**30 + 1  # neither a step's tags nor the warm-up's (qn_hf.pipeline.p2p.WARM_UP_TAG)
_PEER = {"isend": ("dst", "group_dst"), "send": ("dst", "group_dst"), "irecv": ("src", "group_src"),
         "recv": ("src", "group_src")}


class FirstUseHang(RuntimeError):
    """A rank's first operation on a communicator waited for a peer that never made its own there:
    under NCCL the job would hang."""


class FirstUseRule:
    def __init__(self, *, timeout_s: float = 20.0) -> None:
        self.timeout = datetime.timedelta(seconds=timeout_s)
        self.first_uses: list[str] = []  # communicators this rank created, in order
        self._known: set[tuple[str, int, int]] = set()
        self._gloo: set[str] = set()  # groups made with backend="gloo", which stay gloo on a NCCL world
        self._batched = 0
        self._patches = Patches()

    @staticmethod
    def _peer(bound: inspect.BoundArguments, name: str) -> tuple[dist.ProcessGroup, int]:
        group = bound.arguments.get("group")
        group = group if group is not None else dist.group.WORLD
        key, group_key = _PEER[name]
        peer = bound.arguments.get(key)
        return group, peer if peer is not None else dist.get_global_rank(group, bound.arguments[group_key])

    def _handshake(self, group: dist.ProcessGroup, peer: int, *, isend, irecv) -> None:
        token, reply = torch.zeros(1), torch.empty(1)
        sent = isend(token, dst=peer, group=group, tag=HANDSHAKE_TAG)
        try:
            irecv(reply, src=peer, group=group, tag=HANDSHAKE_TAG).wait(self.timeout)
            sent.wait(self.timeout)
        except RuntimeError as e:
            raise FirstUseHang(f"rank {dist.get_rank()}: first use of group {group.group_name} with rank {peer} "
                               f"waited {self.timeout.total_seconds():.0f} s for the peer's first use there; "
                               f"under NCCL this hangs (communicators this rank had used: "
                               f"{self.first_uses})") from e

    def _wrap(self, name: str, fn, originals: dict):
        signature = inspect.signature(fn)

        @functools.wraps(fn)
        def wrapper(*args, **kwargs):
            if not self._batched:
                group, peer = self._peer(signature.bind(*args, **kwargs), name)
                if group.group_name in self._gloo:  # gloo under NCCL too (the hosts' exchange): no such rule
                    return fn(*args, **kwargs)
                me = dist.get_rank()
                key = (group.group_name, min(me, peer), max(me, peer))
                if key not in self._known:
                    self._handshake(group, peer, isend=originals["isend"], irecv=originals["irecv"])
                    self._known.add(key)
                    self.first_uses.append(f"{key[0]}:{key[1]}-{key[2]}")
            return fn(*args, **kwargs)

        return wrapper

    def _batch(self, fn):
        @functools.wraps(fn)
        def wrapper(*args, **kwargs):
            self._batched += 1
            try:
                return fn(*args, **kwargs)
            finally:
                self._batched -= 1

        return wrapper

    def __enter__(self) -> FirstUseRule:
        originals = {name: getattr(dist, name) for name in P2P}
        for name in P2P:
            self._patches.replace_dist(name, lambda fn, name=name: self._wrap(name, fn, originals))
        self._patches.replace_dist("batch_isend_irecv", self._batch)
        self._patches.replace_dist("new_group", self._created)
        return self

    def _created(self, fn):
        @functools.wraps(fn)
        def wrapper(*args, **kwargs):
            group = fn(*args, **kwargs)
            if isinstance(group, dist.ProcessGroup) and kwargs.get("backend") == "gloo":
                self._gloo.add(group.group_name)
            return group

        return wrapper

    def __exit__(self, *exc: object) -> None:
        self._patches.undo()
