"""Moving rows of tokens between ranks, as autograd functions: the all-to-all that carries tokens to
the rank holding their expert and back, and the uneven split/gather of a tp group's shared tokens.

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
