"""Reading any box of a global tensor from the saved pieces that overlap it: how a rank gets its
shard at another mesh, and how the converters assemble whole tensors or new shards, in chunks of
bounded size whatever the size the index declares."""

from __future__ import annotations

import math
import os
from collections.abc import Iterator

import torch
from safetensors import safe_open

from ..tensor_parallel.shard import ShardSpec
from .files import FileChecks
from .format import DTYPES, Box, CheckpointError, boxes, dtype_name, global_shape, safetensors_code

CHUNK_BYTES = 64 << 20  # what a converter holds of one tensor at a time


def read_box(directory: str, entry: dict, name: str, target_box: Box, out: torch.Tensor,
             handles: dict[str, object] | None = None, checks: FileChecks | None = None) -> None:
    """Fill ``out`` (shaped like ``target_box``) from the saved pieces that overlap it. ``handles``
    keeps files open across calls (a converter reads thousands of pieces from a few files)."""
    for piece in entry["pieces"]:
        box = piece["box"]
        overlap = [[max(a[0], b[0]), min(a[1], b[1])] for a, b in zip(box, target_box)]
        if any(lo >= hi for lo, hi in overlap) and overlap:
            continue
        file = os.path.join(directory, piece["file"])
        if checks is not None:
            try:
                checks.verify(piece["file"])
            except CheckpointError as e:
                raise CheckpointError(f"{e} (reading {name})") from None
        try:
            f = handles.get(file) if handles is not None else None
            if f is None:
                f = safe_open(file, framework="pt")
                if handles is not None:
                    handles[file] = f
            sl = f.get_slice(piece["key"])
            if sl.get_dtype() != safetensors_code(DTYPES[entry["dtype"]]):  # else values would be read as another type
                raise CheckpointError(f"{file}: {piece['key']} is stored as {sl.get_dtype()}, "
                                      f"the index says {entry['dtype']}")
            lead = piece.get("lead", 0)  # leading dims of extent 1 the stored tensor leaves out (one expert)
            if list(sl.get_shape()) != [b - a for a, b in box[lead:]] or any(b - a != 1 for a, b in box[:lead]):
                raise CheckpointError(f"{file}: {piece['key']} has shape {sl.get_shape()}, the index says box {box}")
            src = sl[tuple(slice(lo - a[0], hi - a[0]) for (lo, hi), a in zip(overlap[lead:], box[lead:]))] \
                if overlap[lead:] else sl[...]
            src = src.reshape([hi - lo for lo, hi in overlap]) if lead else src
        except CheckpointError:
            raise
        except FileNotFoundError:
            raise CheckpointError(f"{file} (tensor {name}) is missing") from None
        except Exception as e:  # safetensors raises its own errors for truncated or corrupt files
            raise CheckpointError(f"{file} (tensor {name}) cannot be read: {e}") from None
        dst = out
        for d, ((lo, hi), t) in enumerate(zip(overlap, target_box)):
            dst = dst.narrow(d, lo - t[0], hi - lo)
        dst.copy_(src.to(out.dtype) if src.dtype != out.dtype else src)


def read_chunks(directory: str, entry: dict, name: str, box: Box, *,
                checks: FileChecks | None = None) -> Iterator[torch.Tensor]:
    """``box`` of the tensor ``name`` in consecutive row-major chunks of at most ``CHUNK_BYTES``, so
    a converter's memory stays bounded whatever size the index declares."""
    dtype = DTYPES[entry["dtype"]]
    shape = [b - a for a, b in box]
    numel, step = math.prod(shape), max(1, CHUNK_BYTES // dtype.itemsize)
    for start in range(0, numel, step):
        for run, _ in flat_runs(shape, start, min(start + step, numel)):
            part = [[a + lo, a + hi] for (a, _), (lo, hi) in zip(box, run)]
            buf = torch.empty([hi - lo for lo, hi in run], dtype=dtype)
            # Files stay open for one chunk only: a mapping kept open would count every page read so
            # far as resident memory.
            read_box(directory, entry, name, part, buf, handles={}, checks=checks)
            yield buf


def flat_runs(shape: list[int] | torch.Size, start: int, stop: int) -> list[tuple[Box, int]]:
    """The boxes of a tensor of ``shape`` that its flat (row-major) range ``[start, stop)`` covers,
    each contiguous in memory, with the flat offset where each begins: how a ZeRO-1 piece of a
    parameter is stored (at most two partial rows per dimension and one block of whole rows)."""
    if start >= stop:
        return []
    if len(shape) == 0:
        return [([], start)]
    inner = 1
    for n in shape[1:]:
        inner *= n
    first, last = start // inner, (stop - 1) // inner

    def within(row: int, lo: int, hi: int) -> list[tuple[Box, int]]:
        return [([[row, row + 1], *box], row * inner + at) for box, at in flat_runs(shape[1:], lo, hi)]

    if first == last:
        return within(first, start - first * inner, stop - first * inner)
    full_from = first if start % inner == 0 else first + 1
    full_to = last + 1 if stop % inner == 0 else last
    runs = within(first, start - first * inner, inner) if full_from > first else []
    if full_to > full_from:
        runs.append(([[full_from, full_to], *([0, n] for n in shape[1:])], full_from * inner))
    if full_to <= last:
        runs += within(last, 0, stop - last * inner)
    return runs


def read_local(directory: str, index: dict, saved_name: str, like: torch.Tensor, spec: ShardSpec | None,
               tp_rank: int, *, shape: list[int] | None = None, checks: FileChecks | None = None,
               cast: bool = False) -> torch.Tensor:
    """This rank's shard of ``saved_name``, read on the CPU, checked against the model's tensor.
    ``cast``: a floating-point tensor saved in another floating-point dtype is converted (mixed
    precision reads float32 masters from a bfloat16 directory and the other way round)."""
    entry = index["tensors"].get(saved_name)
    if entry is None:
        raise CheckpointError(f"{directory}: the checkpoint has no tensor {saved_name!r}; "
                              f"was it saved from another architecture?")
    local_shape = list(like.shape) if shape is None else shape
    expected = global_shape(local_shape, spec)
    if entry["shape"] != expected:
        raise CheckpointError(f"{directory}: {saved_name} has shape {entry['shape']}, the model needs {expected}")
    saved = DTYPES[entry["dtype"]]
    if saved != like.dtype and not (cast and saved.is_floating_point and like.dtype.is_floating_point):
        raise CheckpointError(f"{directory}: {saved_name} is {entry['dtype']}, the model holds {dtype_name(like.dtype)}")
    buf = torch.zeros(local_shape, dtype=like.dtype)  # padding rows stay zero
    for box, at in boxes(torch.Size(local_shape), spec, tp_rank):
        part = buf if spec is None else buf.narrow(spec.dim, at, box[spec.dim][1] - box[spec.dim][0])
        read_box(directory, entry, saved_name, box, part, checks=checks)
    return buf
