"""Collectives as autograd functions, and flat (coalesced) collectives on lists of tensors.

Every function takes its process group explicitly; a group of one member makes each of them a no-op,
so ``tp=1`` runs the same code without communication. The first docstring line of each autograd
function states its forward and backward collective.

Inside the autograd functions the collectives are torch's functional collectives
(``torch.ops._c10d_functional``: a new output tensor, then ``wait_tensor``), not ``dist.*`` on a
buffer: ``torch.compile`` traces them into a block's graph (inductor then reuses buffers where it
can prove them dead), and selective recomputation can keep their outputs, which the output of an
in-place collective cannot be (recompute.py). The one copy an out-of-place collective costs is
skipped in eager where it is provably safe: the forward all-reduce of an intermediate result
(``_ReduceFromGroup``) overwrites its input when no dispatch mode (selective recomputation's cache)
can be holding it.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch
import torch.distributed as dist
from torch.distributed import ProcessGroup
from torch.utils._python_dispatch import _get_current_dispatch_mode_stack

_functional = torch.ops._c10d_functional


def group_size(group: ProcessGroup) -> int:
    return dist.get_world_size(group)


def group_rank(group: ProcessGroup) -> int:
    return dist.get_rank(group)


def _all_reduce(x: torch.Tensor, group: ProcessGroup) -> torch.Tensor:
    """The sum over the group, in a new tensor."""
    return _functional.wait_tensor(_functional.all_reduce(x, "sum", group.group_name))


def _gather_front(x: torch.Tensor, group: ProcessGroup) -> torch.Tensor:
    """The members' ``x`` concatenated along dim 0, in group-rank order, in a new tensor."""
    gathered = _functional.all_gather_into_tensor(x.contiguous(), group_size(group), group.group_name)
    return _functional.wait_tensor(gathered)


def _reduce_scatter_front(x: torch.Tensor, group: ProcessGroup) -> torch.Tensor:
    """This member's block of dim 0 of the sum over the group, in a new tensor."""
    return _functional.wait_tensor(
        _functional.reduce_scatter_tensor(x.contiguous(), "sum", group_size(group), group.group_name))


def _all_gather_last(x: torch.Tensor, group: ProcessGroup) -> torch.Tensor:
    n = group_size(group)
    if n == 1:
        return x
    stacked = _gather_front(x, group).view(n, *x.shape)  # member-major
    return stacked.movedim(0, -2).reshape(*x.shape[:-1], n * x.shape[-1])


def _split_last(x: torch.Tensor, group: ProcessGroup) -> torch.Tensor:
    n = group_size(group)
    if n == 1:
        return x
    if x.shape[-1] % n:
        raise ValueError(f"last dim {x.shape[-1]} is not divisible by the group size {n}")
    return x.chunk(n, dim=-1)[group_rank(group)].contiguous()


def _overwritable(x: torch.Tensor) -> bool:
    """Whether an eager all-reduce may write the sum into ``x`` itself rather than into a new tensor.

    Only for an intermediate result (a leaf is the caller's), contiguous (what the collective writes),
    outside ``torch.compile`` (inductor reuses buffers itself, on what it proves dead), and with no
    dispatch mode on this thread: selective recomputation's cache is one, and it may hold ``x`` (a
    matrix product's output) to hand to the recomputation unreduced. The callers pass a tensor
    nothing else reads afterwards (a row layer's partial product, a masked embedding lookup, a
    partial-sum module's output); a tensor autograd saved would fail its version check loudly."""
    if torch.compiler.is_compiling():
        return False
    return x.grad_fn is not None and x.is_contiguous() and not _get_current_dispatch_mode_stack()


class _CopyToGroup(torch.autograd.Function):
    """Identity forward, all-reduce (sum) backward: enters a region whose ranks each use the full input."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, group: ProcessGroup) -> torch.Tensor:
        ctx.group = group
        return x

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        # Out of place: autograd may hand the same gradient tensor to another branch as well (an add's
        # backward passes its gradient to both inputs).
        return _all_reduce(grad, ctx.group), None


class _ReduceFromGroup(torch.autograd.Function):
    """All-reduce (sum) forward, identity backward: leaves a region of partial sums."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, group: ProcessGroup) -> torch.Tensor:
        if _overwritable(x):
            ctx.mark_dirty(x)
            dist.all_reduce(x, group=group)
            return x
        return _all_reduce(x, group)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return grad, None


class _GatherFromGroup(torch.autograd.Function):
    """All-gather along the last dim forward, split (keep this rank's chunk) backward."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, group: ProcessGroup) -> torch.Tensor:
        ctx.group = group
        return _all_gather_last(x, group)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return _split_last(grad, ctx.group), None


class _SplitToGroup(torch.autograd.Function):
    """Split along the last dim (keep this rank's chunk) forward, all-gather backward."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, group: ProcessGroup) -> torch.Tensor:
        ctx.group = group
        return _split_last(x, group)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return _all_gather_last(grad, ctx.group), None


# Sequence parallelism moves activations of shape [batch, sequence, ...] between "whole on every tp
# rank" and "this rank's contiguous slice of the sequence". The collectives run on the sequence dim
# moved to the front, so every rank's slice is one contiguous block of the buffer; results are made
# contiguous again in [batch, sequence, ...] order (a free view when the batch is 1), as pipeline
# sends and HF's views expect.
SEQ_DIM = 1


def _gather_seq(x: torch.Tensor, group: ProcessGroup) -> torch.Tensor:
    return _gather_front(x.movedim(SEQ_DIM, 0), group).movedim(0, SEQ_DIM).contiguous()


def _reduce_scatter_seq(x: torch.Tensor, group: ProcessGroup) -> torch.Tensor:
    return _reduce_scatter_front(x.movedim(SEQ_DIM, 0), group).movedim(0, SEQ_DIM).contiguous()


def _split_seq(x: torch.Tensor, group: ProcessGroup) -> torch.Tensor:
    return x.chunk(group_size(group), dim=SEQ_DIM)[group_rank(group)].contiguous()


class _SequenceCollective(torch.autograd.Function):
    """``forward(x)`` forward and ``backward(grad)`` backward, both functions of (tensor, group) along
    the sequence: the four sequence-parallel transitions are pairs of the three functions above."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, group: ProcessGroup, forward: Callable, backward: Callable) -> torch.Tensor:
        ctx.group, ctx.backward_fn = group, backward
        return forward(x, group)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return ctx.backward_fn(grad, ctx.group), None, None, None


def all_gather_sequence(x: torch.Tensor, *, group: ProcessGroup) -> torch.Tensor:
    """The whole sequence from every rank's slice (no autograd)."""
    return x if group_size(group) == 1 else _gather_seq(x, group)


def split_sequence(x: torch.Tensor, *, group: ProcessGroup) -> torch.Tensor:
    """This rank's slice of the sequence forward, all-gather backward: a replicated activation enters
    the sequence-parallel region."""
    return x if group_size(group) == 1 else _SequenceCollective.apply(x, group, _split_seq, _gather_seq)


def gather_sequence(x: torch.Tensor, *, group: ProcessGroup) -> torch.Tensor:
    """All-gather the sequence forward, this rank's slice backward: leaves the sequence-parallel region
    for consumers that each see the whole (replicated) sequence."""
    return x if group_size(group) == 1 else _SequenceCollective.apply(x, group, _gather_seq, _split_seq)


def gather_sequence_into_region(x: torch.Tensor, *, group: ProcessGroup) -> torch.Tensor:
    """All-gather the sequence forward, reduce-scatter backward: enters a tp region (column layers) from
    the sequence-parallel region; each rank's input gradient is partial (its columns only)."""
    return x if group_size(group) == 1 else _SequenceCollective.apply(x, group, _gather_seq, _reduce_scatter_seq)


def reduce_scatter_sequence(x: torch.Tensor, *, group: ProcessGroup) -> torch.Tensor:
    """Reduce-scatter along the sequence forward, all-gather backward: leaves a tp region of partial sums
    (a row layer) into the sequence-parallel region."""
    return x if group_size(group) == 1 else _SequenceCollective.apply(x, group, _reduce_scatter_seq, _gather_seq)


def gather_rows_into_region(x: torch.Tensor, *, group: ProcessGroup) -> torch.Tensor:
    """All-gather rows (dim 0) forward, reduce-scatter backward: the tokens of every member's slice
    of the sequence, flattened to rows (an MoE experts call), enter a tp region of partial sums. An
    integer tensor (routing indices) is gathered with no autograd."""
    if group_size(group) == 1:
        return x
    if not x.is_floating_point():
        return _gather_front(x, group)
    return _SequenceCollective.apply(x, group, _gather_front, _reduce_scatter_front)


def reduce_scatter_rows(x: torch.Tensor, *, group: ProcessGroup) -> torch.Tensor:
    """Reduce-scatter rows (dim 0) forward, all-gather backward: a partial sum over tp of every
    member's rows returns to each member as the sum of its own rows."""
    return x if group_size(group) == 1 else _SequenceCollective.apply(x, group, _reduce_scatter_front, _gather_front)


def copy_to_group(x: torch.Tensor, *, group: ProcessGroup) -> torch.Tensor:
    """Identity forward, all-reduce backward."""
    return x if group_size(group) == 1 else _CopyToGroup.apply(x, group)


def reduce_from_group(x: torch.Tensor, *, group: ProcessGroup) -> torch.Tensor:
    """All-reduce forward, identity backward. In eager ``x`` may be overwritten with the sum (see
    ``_overwritable``): pass a result nothing else reads afterwards."""
    return x if group_size(group) == 1 else _ReduceFromGroup.apply(x, group)


def gather_from_group(x: torch.Tensor, *, group: ProcessGroup) -> torch.Tensor:
    """All-gather on the last dim forward, split backward."""
    return x if group_size(group) == 1 else _GatherFromGroup.apply(x, group)


def split_to_group(x: torch.Tensor, *, group: ProcessGroup) -> torch.Tensor:
    """Split on the last dim forward, all-gather backward."""
    return x if group_size(group) == 1 else _SplitToGroup.apply(x, group)


# Flat collectives copy many small tensors into one buffer (one call instead of hundreds), but a
# buffer of a whole stage's weights would double their memory (the replicas' broadcast at start-up).
# Runs are cut at this size, and a tensor that fills a run by itself is sent in place, uncopied.
FLAT_BYTES = 64 * 2**20


def flat_runs(nbytes: Sequence[int]) -> list[list[int]]:
    """Indices of tensors of ``nbytes`` each (one dtype, in order) cut into consecutive runs of at
    most ``FLAT_BYTES`` (a larger tensor alone in its run): one collective per run. The planner
    counts calls with this too."""
    runs: list[list[int]] = []
    size = FLAT_BYTES
    for i, n in enumerate(nbytes):
        if size + n > FLAT_BYTES:
            runs.append([])
            size = 0
        runs[-1].append(i)
        size += n
    return runs


def _flat_in_place(tensors: Sequence[torch.Tensor], collective: Callable[[torch.Tensor], object]) -> None:
    """Run ``collective`` on flat buffers (per dtype, ``flat_runs``) and copy the results back into
    each tensor; a run of one contiguous tensor runs on the tensor itself."""
    by_dtype: dict[torch.dtype, list[torch.Tensor]] = {}
    for t in tensors:
        by_dtype.setdefault(t.dtype, []).append(t)
    for same in by_dtype.values():
        for run in flat_runs([t.numel() * t.element_size() for t in same]):
            if len(run) == 1 and same[run[0]].is_contiguous():
                collective(same[run[0]])
                continue
            flat = torch.cat([same[i].reshape(-1) for i in run])
            collective(flat)
            offset = 0
            for i in run:
                t = same[i]
                t.copy_(flat[offset : offset + t.numel()].view_as(t))
                offset += t.numel()


def flat_all_reduce_(tensors: Sequence[torch.Tensor], *, group: ProcessGroup) -> None:
    """Sum each tensor across the group in place, one collective per dtype and ``flat_runs`` run."""
    if group_size(group) > 1 and tensors:
        _flat_in_place(tensors, lambda flat: dist.all_reduce(flat, group=group))


def flat_broadcast_(tensors: Sequence[torch.Tensor], *, src_group_rank: int, group: ProcessGroup) -> None:
    """Overwrite each tensor with the group member ``src_group_rank``'s copy, one collective per dtype and
    ``flat_runs`` run (so the transient copy is at most ``FLAT_BYTES``, not the tensors' total)."""
    if group_size(group) > 1 and tensors:
        src = dist.get_global_rank(group, src_group_rank)
        _flat_in_place(tensors, lambda flat: dist.broadcast(flat, src=src, group=group))


def all_gather_tensors(x: torch.Tensor, *, group: ProcessGroup) -> list[torch.Tensor]:
    """Every member's copy of ``x`` (same shape on every member), in group-rank order."""
    if group_size(group) == 1:
        return [x]
    x = x.contiguous()
    parts = [torch.empty_like(x) for _ in range(group_size(group))]
    dist.all_gather(parts, x, group=group)
    return parts


def barrier(device: torch.device) -> None:
    """A world barrier that NCCL can run without guessing the device."""
    if device.type == "cuda":
        dist.barrier(device_ids=[device.index])
    else:
        dist.barrier()


def failures(message: str | None, *, group: ProcessGroup | None = None) -> list[tuple[int, str]]:
    """Every rank's ``message`` (None: it succeeded), gathered over ``group``: the (rank, message) of
    each that failed, the same list on every rank, so all raise the same error or none does."""
    gathered: list[str | None] = [None] * dist.get_world_size(group)
    dist.all_gather_object(gathered, message, group=group)
    return [(rank, m) for rank, m in enumerate(gathered) if m is not None]


def splits_world() -> bool:
    """Whether each new process group is split from the world's NCCL communicator: the default group is NCCL
    bound to a device (``mesh.init_distributed`` binds it on CUDA), and torch then makes every ``new_group`` an
    ``ncclCommSplit`` that every rank of the world enters, members or not (``perform_nocolor_split``)."""
    world = dist.group.WORLD
    return (hasattr(dist, "split_group") and dist.get_backend() == dist.Backend.NCCL
            and getattr(world, "bound_device_id", None) is not None)


def member_groups(lists: Sequence[Sequence[int]], *, timeout) -> ProcessGroup | None:
    """Every group of ``lists`` (global ranks; no rank in two lists; the same on every rank, every rank calls)
    and this rank's (None: in none). Where new groups are split from the world's communicator (``splits_world``)
    one ``dist.split_group`` makes all of them: one world-wide split instead of one per group, so a job's start
    costs a number of world-wide collectives that does not grow with its size (at 1,024 ranks and pp=16 the
    pipeline's links alone were 2,048). Elsewhere ``new_group`` (gloo, or NCCL created lazily) connects only
    a group's members and costs the other ranks nothing."""
    lists = [sorted(ranks) for ranks in lists]  # group ranks in global order, as new_group numbers them
    if not lists:
        return None
    if splits_world():
        group = dist.split_group(split_ranks=lists, timeout=timeout)
        return group if isinstance(group, ProcessGroup) else None  # torch 2.15: NON_GROUP_MEMBER (-100) outside
    me, mine = dist.get_rank(), None
    for ranks in lists:
        group = dist.new_group(ranks, timeout=timeout)
        if me in ranks:
            mine = group
    return mine


HOST_MAX_TAG = 7101  # the hosts' exchange's transfers (their own tag: nothing else sends on the host group)


def host_max_rounds(world: int) -> int:
    """The rounds ``host_max_`` takes over ``world`` ranks (each a send and a receive per rank)."""
    return (world - 1).bit_length()


def host_max_(values: torch.Tensor, *, group: ProcessGroup) -> torch.Tensor:
    """``dist.all_reduce(values, MAX, group)`` of a host tensor, in place, by dissemination: in round k each rank
    sends what it holds to the rank 2^k after it and takes the max with what the rank 2^k before it sent, so
    after ceil(log2 W) rounds every rank holds the max over all (max is idempotent: ranks counted twice do no
    harm), and every rank makes the same number of transfers. Why not gloo's all-reduce: it runs a ring, about
    4 W sequential transfers (2 W segments each way), which at 1,000 ranks is thousands of host hops for a
    few kilobytes every step; here ceil(log2 W) hops of the whole vector (10 at 1,024 ranks)."""
    world, me = dist.get_world_size(group), dist.get_rank(group)
    incoming = torch.empty_like(values)
    for k in range(host_max_rounds(world)):
        step = 1 << k
        to, frm = dist.get_global_rank(group, (me + step) % world), dist.get_global_rank(group, (me - step) % world)
        sent = dist.isend(values, dst=to, group=group, tag=HOST_MAX_TAG)
        received = dist.irecv(incoming, src=frm, group=group, tag=HOST_MAX_TAG)
        received.wait()
        sent.wait()  # before values change: the send reads them
        torch.maximum(values, incoming, out=values)
    return values
