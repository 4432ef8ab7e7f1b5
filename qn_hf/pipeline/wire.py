"""What a tensor between stages is announced with: a small int64 header, then the tensor.

The header is ``[dtype code, ndim, *shape]`` padded to ``HEADER_INTS`` values, so the receiver can
allocate before the data arrives. A training step sends one per link and batch shape (its first
activation's); generation at pp > 1 one per tensor; ``broadcast_announced`` one per broadcast.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

# codes are positions: new dtypes go at the end
WIRE_DTYPES = (torch.float32, torch.bfloat16, torch.float16, torch.float64, torch.int64, torch.int32, torch.bool)
HEADER_INTS = 8  # int64 values: room for [dtype, ndim, *shape] of up to 6 dims


def header_of(x: torch.Tensor) -> torch.Tensor:
    values = [WIRE_DTYPES.index(x.dtype), x.dim(), *x.shape]
    if len(values) > HEADER_INTS:
        raise ValueError(f"tensors of {x.dim()} dims cannot be sent between stages (at most {HEADER_INTS - 2})")
    header = torch.zeros(HEADER_INTS, dtype=torch.int64, device=x.device)
    header[: len(values)] = torch.tensor(values)
    return header


def read_header(header: torch.Tensor) -> tuple[tuple[int, ...], torch.dtype]:
    """The shape and dtype a header announces."""
    code, ndim, *shape = header.tolist()
    return tuple(shape[:ndim]), WIRE_DTYPES[code]


def empty_header(device: torch.device) -> torch.Tensor:
    return torch.empty(HEADER_INTS, dtype=torch.int64, device=device)


def broadcast_announced(x: torch.Tensor | None, *, src: int, group: dist.ProcessGroup, device: torch.device) -> torch.Tensor:
    """Group member ``src``'s ``x`` (None on the others, which learn its shape and dtype from a header
    broadcast first: one host read there) on every member."""
    source = dist.get_global_rank(group, src)
    header = header_of(x) if x is not None else empty_header(device)
    dist.broadcast(header, src=source, group=group)
    if x is None:
        shape, dtype = read_header(header)
        x = torch.empty(shape, dtype=dtype, device=device)
    x = x.contiguous()
    dist.broadcast(x, src=source, group=group)
    return x
