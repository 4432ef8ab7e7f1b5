"""Every rank agrees on a step's batches before the step's first collective.

Each rank checks its own batch (keys, sizes, the model's inputs) on the host. A rank whose check
fails must not simply raise: the others would go on into the step's collectives and wait for it
until the timeout (ten minutes by default), and ranks of one replica given batches of different
shapes would not even fail cleanly (gloo aborts the process on an all-reduce of unequal sizes, a
pipeline stage waits for an activation of another length). So every step the hosts exchange, in one
max-reduction over a gloo group of the whole world (``comm.host_max_``: log2(world) hops; host memory, so
this never waits for the device's queue), whether any rank's check failed and each replica's layout (a digest of its
keys, shapes and dtypes, the same on every rank of a replica when they were given the same dict) and
of its contents: a CRC-32 of the bytes of every tensor in host memory (tens of microseconds for a
batch of token ids), since ranks of one replica given different contents would train silently wrong
(at tp=2 a loss of neither rank's batch). Then every rank raises the same ``ValueError``, naming the
ranks that differ, or none does. Tensors already on a device are not read here (that would wait for
the device): their contents are the first step's check (``batch.check_same_batch``, every step on
request). ``pm.agree_batch_contents = False`` leaves the host's contents out too.
"""

from __future__ import annotations

import zlib
from collections.abc import Callable, Mapping

import torch
import torch.distributed as dist
from torch.distributed import ProcessGroup

from ..comm import host_max_

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


def contents_digest(batch: Mapping[str, torch.Tensor]) -> int:
    """A CRC-32 of the bytes of the batch's tensors in host memory, by sorted key (device tensors left out)."""
    crc = 0
    for key in sorted(batch):
        value = batch[key]
        if isinstance(value, torch.Tensor) and value.device.type == "cpu":
            crc = zlib.crc32(value.detach().contiguous().reshape(-1).view(torch.uint8).numpy(), crc)
    return crc


def agree_on_batch(checks: Callable[[], int], batch: Mapping[str, torch.Tensor], *, replica: int, replicas: int,
                   group: ProcessGroup | None, contents: bool = True, same_shapes: str | None = None) -> int:
    """``checks()`` (this rank's checks of ``batch``, returning its size), agreed with every rank of
    ``group``'s world: the same ``ValueError`` (or ``IndexError``) on every rank when any rank's checks failed (the
    lowest such rank's message, naming it) or when the ranks of one replica hold batches of different layouts
    or, with ``contents``, host contents (naming those ranks); with ``same_shapes`` (why, and the fix), when any two
    ranks of the world hold batches of different layouts. One host max-reduction (``comm.host_max_``); a
    second call (an object broadcast) only to spread a failure."""
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
    # one row per rank (its replica, layout and contents digests; _NONE elsewhere, so the MAX gathers them) and
    # one more whose first entry names the lowest failing rank
    votes = torch.full((world + 1, 3), _NONE, dtype=torch.int64)
    if problem is None:
        compare = contents and replicas < world  # a replica of one rank has nobody to differ from
        votes[rank] = torch.tensor([replica, layout_digest(batch), contents_digest(batch) if compare else 0])
    else:
        votes[world, 0] = world - rank  # the MAX names the lowest failing rank
    host_max_(votes, group=group)  # an all-reduce in log2(world) hops (comm.py says why not gloo's)
    # Read as numpy: host memory by construction (a gloo group's tensor), which numpy() enforces (a
    # device tensor would raise), and no aten op that a sync counter would take for a device read
    votes = votes.numpy()
    failing = int(votes[world, 0])
    if failing != _NONE:
        source = world - failing
        message = [problem]
        dist.broadcast_object_list(message, src=dist.get_global_rank(group, source), group=group)
        kind, text = message[0]
        raise _REFUSALS[_NAMES.index(kind)](f"rank {source}'s batch: {text}")
    first: dict[int, int] = {}  # replica -> its lowest rank, whose batch the others are held to
    for r in range(world):
        first.setdefault(int(votes[r, 0]), r)
    for column, what in ((1, "shapes (keys, sizes or dtypes)"), (2, "contents")):
        differ = [r for r in range(world) if votes[r, column] != votes[first[int(votes[r, 0])], column]]
        if differ:
            held = sorted({first[int(votes[r, 0])] for r in differ})
            raise ValueError(f"rank(s) {', '.join(map(str, differ))} were given batches of other {what} than rank(s) "
                             f"{', '.join(map(str, held))} of the same data-parallel replica: every tp rank, pipeline "
                             f"stage and cp rank of a replica must get the same dict each step (slice a global batch "
                             f"by pm.coords['dp'] only)")
    differ = [r for r in range(world) if votes[r, 1] != votes[0, 1]] if same_shapes else []
    if differ:
        raise ValueError(f"rank(s) {', '.join(map(str, differ))} were given batches of other shapes (keys, sizes or "
                         f"dtypes) than rank 0: {same_shapes}")
    return size
