"""Moving rows of tokens between ranks, as autograd functions: the all-to-all that carries tokens to
the rank holding their expert and back (or, for ``expert_dispatch="all_gather"``, the all-gather of
every member's tokens and the sum of the partial outputs back), and the uneven split/gather of a tp
group's shared tokens.

Rows are the first dim of a ``[rows, hidden]`` tensor. Counts differ from rank to rank and step to
step (they follow the router), so every function takes the row counts explicitly; a rank may send
or receive none. The first docstring line of each autograd function states its forward and backward
collective.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.distributed as dist
from torch.distributed import ProcessGroup

from ..comm import group_rank, group_size
from ..compat import all_gather_single


def _all_to_all(x: torch.Tensor, *, out_rows: Sequence[int], in_rows: Sequence[int], group: ProcessGroup) -> torch.Tensor:
    out = x.new_empty((sum(out_rows), *x.shape[1:]))
    dist.all_to_all_single(out, x.contiguous(), output_split_sizes=list(out_rows), input_split_sizes=list(in_rows),
                           group=group)
    return out


class _AllToAll(torch.autograd.Function):
    """All-to-all of rows forward (``in_rows[j]`` rows to member j, ``out_rows[j]`` from it), the
    reverse all-to-all backward: a row's gradient returns to the rank that sent the row."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, out_rows: list[int], in_rows: list[int], group: ProcessGroup) -> torch.Tensor:
        ctx.out_rows, ctx.in_rows, ctx.group = out_rows, in_rows, group
        return _all_to_all(x, out_rows=out_rows, in_rows=in_rows, group=group)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return _all_to_all(grad, out_rows=ctx.in_rows, in_rows=ctx.out_rows, group=ctx.group), None, None, None


def all_to_all_rows(x: torch.Tensor, *, out_rows: Sequence[int], in_rows: Sequence[int],
                    group: ProcessGroup) -> torch.Tensor:
    """Send ``x``'s rows in consecutive blocks of ``in_rows[j]`` to member j; receive ``out_rows[j]``
    rows from member j, concatenated in member order."""
    if group_size(group) == 1:
        return x
    return _AllToAll.apply(x, list(out_rows), list(in_rows), group)


def _gather_blocks(x: torch.Tensor, group: ProcessGroup) -> torch.Tensor:
    out = x.new_empty((group_size(group) * x.shape[0], *x.shape[1:]))
    all_gather_single(out, x.contiguous(), group=group)
    return out


def _sum_blocks(x: torch.Tensor, group: ProcessGroup) -> torch.Tensor:
    """Block j of every member's ``x`` (equal blocks along dim 0), summed, on member j. A reduce-scatter,
    written as an equal all-to-all and a sum here: the sum runs in float32 whatever the rows' dtype (NCCL's
    reduce-scatter adds in the dtype it is given, one rounding per member in bf16; float64 stays float64), in
    member order on every backend, so a run gives the same bits on gloo and NCCL."""
    size = group_size(group)
    received = torch.empty_like(x)
    dist.all_to_all_single(received, x.contiguous(), group=group)
    blocks = received.view(size, x.shape[0] // size, *x.shape[1:])
    if not x.is_floating_point():
        return blocks.sum(0)
    return blocks.sum(0, dtype=torch.promote_types(x.dtype, torch.float32)).to(x.dtype)


class _GatherBlocks(torch.autograd.Function):
    """Every member's rows concatenated in member order forward (an all-gather of equal blocks); each
    member's block of the gradient summed over the members backward (``_sum_blocks``), or the reverse
    (``gather=False``)."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, group: ProcessGroup, gather: bool) -> torch.Tensor:
        ctx.group, ctx.gather = group, gather
        return _gather_blocks(x, group) if gather else _sum_blocks(x, group)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return (_sum_blocks(grad, ctx.group) if ctx.gather else _gather_blocks(grad, ctx.group)), None, None


def _blocks(x: torch.Tensor, group: ProcessGroup, *, gather: bool) -> torch.Tensor:
    if group_size(group) == 1:
        return x
    if not x.requires_grad:  # integers (the choices), or no autograd: the collective alone
        return _gather_blocks(x, group) if gather else _sum_blocks(x, group)
    return _GatherBlocks.apply(x, group, gather)


def gather_blocks(x: torch.Tensor, *, group: ProcessGroup) -> torch.Tensor:
    """Every member's ``x`` (the same shape on each), concatenated along dim 0 in member order; the
    gradient of this member's block comes back summed over every member's use of it."""
    return _blocks(x, group, gather=True)


def sum_blocks(x: torch.Tensor, *, group: ProcessGroup) -> torch.Tensor:
    """The inverse of ``gather_blocks``: ``x`` holds one equal block per member along dim 0; member j
    gets the sum of every member's block j (float32 sums, ``_sum_blocks``)."""
    return _blocks(x, group, gather=False)


def exchange_counts(counts: torch.Tensor, *, group: ProcessGroup) -> torch.Tensor:
    """``counts[j]`` (a row of equal length per member) to member j; returns what each member sent
    here, row j from member j (no autograd: counts are integers)."""
    if group_size(group) == 1:
        return counts
    out = torch.empty_like(counts)
    dist.all_to_all_single(out, counts.contiguous(), group=group)
    return out


def row_split(rows: int, parts: int) -> list[int]:
    """``torch.tensor_split``'s sizes: the first ``rows % parts`` parts take one row more."""
    return [rows // parts + (i < rows % parts) for i in range(parts)]


def _gather_rows(x: torch.Tensor, sizes: list[int], group: ProcessGroup) -> torch.Tensor:
    # gloo and NCCL gather equal sizes: pad every part to the largest, then drop the padding
    most = max(sizes)
    padded = torch.cat([x, x.new_zeros((most - x.shape[0], *x.shape[1:]))]) if x.shape[0] < most else x.contiguous()
    out = x.new_empty((most * len(sizes), *x.shape[1:]))
    all_gather_single(out, padded, group=group)
    return torch.cat([part[:n] for part, n in zip(out.split(most), sizes)])


def _take_rows(x: torch.Tensor, sizes: list[int], rank: int) -> torch.Tensor:
    return x.split(sizes)[rank].contiguous()


class _RowsCollective(torch.autograd.Function):
    """This rank's rows forward and all-gather backward (``split``), or the reverse (``gather``)."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, sizes: list[int], group: ProcessGroup, split: bool) -> torch.Tensor:
        ctx.sizes, ctx.group, ctx.split = sizes, group, split
        return _take_rows(x, sizes, group_rank(group)) if split else _gather_rows(x, sizes, group)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        if ctx.split:
            return _gather_rows(grad, ctx.sizes, ctx.group), None, None, None
        return _take_rows(grad, ctx.sizes, group_rank(ctx.group)), None, None, None


def split_rows(x: torch.Tensor, *, group: ProcessGroup) -> torch.Tensor:
    """This rank's ``row_split`` share of rows every member holds alike (forward), the whole gradient
    gathered from every member's share (backward): a replicated activation, divided up."""
    if group_size(group) == 1:
        return x
    sizes = row_split(x.shape[0], group_size(group))
    if not x.requires_grad:
        return _take_rows(x, sizes, group_rank(group))
    return _RowsCollective.apply(x, sizes, group, True)


def gather_rows(x: torch.Tensor, *, rows: int, group: ProcessGroup) -> torch.Tensor:
    """The whole ``rows`` rows from every member's ``row_split`` share (forward), this rank's share of
    the gradient (backward): the inverse of ``split_rows``, back to a replicated activation."""
    if group_size(group) == 1:
        return x
    sizes = row_split(rows, group_size(group))
    if not x.requires_grad:
        return _gather_rows(x, sizes, group)
    return _RowsCollective.apply(x, sizes, group, False)
