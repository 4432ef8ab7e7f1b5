"""Every rank agrees on a step's batches before the step's first collective.

Each rank checks its own batch (keys, sizes, the model's inputs) on the host. A rank whose check
fails must not simply raise: the others would go on into the step's collectives and wait for it
until the timeout (ten minutes by default), and ranks of one replica given batches of different
shapes would not even fail cleanly (gloo aborts the process on an all-reduce of unequal sizes, a
pipeline stage waits for an activation of another length). So every step the hosts exchange, in one
all-reduce over a gloo group of the whole world (``mesh.host_group``: host memory, so this never waits
for the device's queue), whether any rank's check failed and each replica's layout (a digest of its
keys, shapes and dtypes, the same on every rank of a replica when they were given the same dict). Then
every rank raises the same ``ValueError``, or none does. Contents are not compared here: that needs
the tensors, possibly on the device, so it stays the first step's check (``batch.check_same_batch``,
every step on request).
"""

from __future__ import annotations

import zlib
from collections.abc import Callable, Mapping

import torch
import torch.distributed as dist
from torch.distributed import ProcessGroup

_NONE = torch.iinfo(torch.int64).min  # what a replica with no rank here contributes to the MAX
# What the checks raise: a ValueError, or an IndexError where the plain model raises one (ids
# outside the vocabulary); every rank raises the same type
_REFUSALS = (ValueError, IndexError)
_NAMES = tuple(t.__name__ for t in _REFUSALS)


def layout_digest(batch: Mapping[str, torch.Tensor]) -> int:
    """A digest of the batch's sorted keys, shapes and dtypes (never its contents or device)."""
    layout = repr(sorted((k, tuple(v.shape), str(v.dtype)) for k, v in batch.items()
                         if isinstance(v, torch.Tensor)))
    return zlib.crc32(layout.encode())


def agree_on_batch(checks: Callable[[], int], batch: Mapping[str, torch.Tensor], *, replica: int, replicas: int,
                   group: ProcessGroup | None) -> int:
    """``checks()`` (this rank's checks of ``batch``, returning its size), agreed with every rank of
    ``group``'s world: the same ``ValueError`` (or ``IndexError``) on every rank when any rank's checks failed (the
    lowest such rank's message, naming it) or when the ranks of one replica hold batches of different layouts.
    One host all-reduce; a second call (an object broadcast) only to spread a failure."""
    problem, size = None, 0
    try:
        size = checks()
    except _REFUSALS as error:
        problem = (type(error).__name__, str(error))
    if group is None or dist.get_world_size(group) == 1:
        if problem is not None:
            raise _REFUSALS[_NAMES.index(problem[0])](problem[1])
        return size
    rank, world = dist.get_rank(group), dist.get_world_size(group)
    votes = torch.full((replicas + 1, 2), _NONE, dtype=torch.int64)
    if problem is None:
        digest = layout_digest(batch)
        votes[replica] = torch.tensor([digest, -digest])  # the MAX gives max and -min over the replica
    else:
        votes[replicas, 0] = world - rank  # the MAX names the lowest failing rank
    dist.all_reduce(votes, op=dist.ReduceOp.MAX, group=group)
    # Read as numpy: host memory by construction (a gloo group's tensor), which numpy() enforces (a
    # device tensor would raise), and no aten op that a sync counter would take for a device read
    votes = votes.numpy()
    failing = int(votes[replicas, 0])
    if failing != _NONE:
        source = world - failing
        message = [problem]
        dist.broadcast_object_list(message, src=dist.get_global_rank(group, source), group=group)
        kind, text = message[0]
        raise _REFUSALS[_NAMES.index(kind)](f"rank {source}'s batch: {text}")
    differ = [r for r in range(replicas) if votes[r, 0] != _NONE and votes[r, 0] != -votes[r, 1]]
    if differ:
        raise ValueError(f"the ranks of data-parallel replica(s) {differ} were given batches of different shapes "
                         f"(keys, sizes or dtypes): every tp rank, pipeline stage and cp rank of a replica must get "
                         f"the same dict each step (slice a global batch by pm.coords['dp'] only)")
    return size
