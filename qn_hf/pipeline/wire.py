"""What a tensor between stages is announced with: a small int64 header, then the tensor.

The header is ``[dtype code, ndim, *shape]`` padded to ``HEADER_INTS`` values, so the receiver can
allocate before the data arrives. A training step sends one per link and step (its rows and the
trailing shape); generation at pp > 1 one per tensor.
"""

from __future__ import annotations

import torch

WIRE_DTYPES = (torch.float32, torch.bfloat16, torch.float16, torch.float64)
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
