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
from .dcp.metadata import Span, load_value
from .files import FileChecks
from .format import DTYPES, Box, CheckpointError, boxes, dtype_name, global_shape, safetensors_code

CHUNK_BYTES = 64 << 20  # what a converter holds of one tensor at a time


def read_box(directory: str, entry: dict, name: str, target_box: Box, out: torch.Tensor,
             handles: dict[str, object] | None = None, checks: FileChecks | None = None) -> None:
    """Fill ``out`` (shaped like ``target_box``) from the saved pieces that overlap it. ``handles``
    keeps files open across calls (a converter reads thousands of pieces from a few files), and the
    DCP chunks decoded so far."""
    if entry.get("rows") is not None:
        _read_reordered(directory, entry, name, target_box, out, handles, checks)
        return
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
        if piece.get("span") is not None:
            src = _dcp_chunk(directory, piece, entry, name, handles)
            src = src[tuple(slice(lo - a[0], hi - a[0]) for (lo, hi), a in zip(overlap, box))]
            _place(out, overlap, target_box, src)
            continue
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
        _place(out, overlap, target_box, src)


def _place(out: torch.Tensor, overlap: Box, target_box: Box, src: torch.Tensor) -> None:
    dst = out
    for d, ((lo, hi), t) in enumerate(zip(overlap, target_box)):
        dst = dst.narrow(d, lo - t[0], hi - lo)
    dst.copy_(src.to(out.dtype) if src.dtype != out.dtype else src)


def _dcp_chunk(directory: str, piece: dict, entry: dict, name: str, handles: dict | None) -> torch.Tensor:
    """One whole chunk of a DCP file (a ``torch.save``d tensor: there is no reading part of one), checked
    against its piece; kept in ``handles`` so the boxes of one read decode it once."""
    cache_key = ("dcp", piece["file"], piece["span"][0])
    if handles is not None and cache_key in handles:
        return handles[cache_key]
    offset, length = piece["span"]
    value = load_value(directory, Span(piece["file"], offset, length), f"{piece['key']} (tensor {name})")
    extents = [b - a for a, b in piece["box"]]
    if not isinstance(value, torch.Tensor) or list(value.shape) != extents or value.dtype != DTYPES[entry["dtype"]]:
        what = f"a {value.dtype} tensor of shape {list(value.shape)}" if isinstance(value, torch.Tensor) \
            else f"a {type(value).__name__}"
        raise CheckpointError(f"{os.path.join(directory, piece['file'])}: {piece['key']} at {piece['box']} holds {what}, "
                              f"the metadata says {entry['dtype']} {extents}")
    if handles is not None:
        handles[cache_key] = value
    return value


def _read_reordered(directory: str, entry: dict, name: str, target_box: Box, out: torch.Tensor,
                    handles: dict | None, checks: FileChecks | None) -> None:
    """A box of a tensor saved with its rows in another order within blocks (``entry["rows"]``, from a
    ``dcp.names.RowOrder``): the whole blocks around the box are read and put in the model's order."""
    block, order = entry["rows"]["block"], entry["rows"]["order"]
    lo, hi = target_box[0]
    first, last = lo // block * block, -(-hi // block) * block
    wide = torch.empty([last - first, *(b - a for a, b in target_box[1:])], dtype=out.dtype)
    plain = {k: v for k, v in entry.items() if k != "rows"}
    read_box(directory, plain, name, [[first, last], *target_box[1:]], wide, handles, checks)
    blocks = wide.unflatten(0, (-1, block))[:, order].flatten(0, 1)
    out.copy_(blocks.narrow(0, lo - first, hi - lo))


def read_chunks(directory: str, entry: dict, name: str, box: Box, *,
                checks: FileChecks | None = None) -> Iterator[torch.Tensor]:
    """``box`` of the tensor ``name`` in consecutive row-major chunks of at most ``CHUNK_BYTES``, so
    a converter's memory stays bounded whatever size the index declares (for a DCP source, by that and
    the saved chunks the current one overlaps: a DCP chunk is decoded whole)."""
    dtype = DTYPES[entry["dtype"]]
    shape = [b - a for a, b in box]
    numel, step = math.prod(shape), max(1, CHUNK_BYTES // dtype.itemsize)
    decoded: dict = {}
    for start in range(0, numel, step):
        for run, _ in flat_runs(shape, start, min(start + step, numel)):
            part = [[a + lo, a + hi] for (a, _), (lo, hi) in zip(box, run)]
            buf = torch.empty([hi - lo for lo, hi in run], dtype=dtype)
            # Files stay open for one chunk only: a mapping kept open would count every page read so
            # far as resident memory. The DCP chunks the last part decoded are kept (one saved chunk, a
            # rank's share of a tensor, spans many parts): each is decoded once, not once per part.
            handles = dict(decoded)
            read_box(directory, entry, name, part, buf, handles=handles, checks=checks)
            decoded = {k: v for k, v in handles.items() if isinstance(v, torch.Tensor)}
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
    handles: dict = {}  # one tensor's files and decoded DCP chunks: the boxes of a packed q|k|v share them
    for box, at in boxes(torch.Size(local_shape), spec, tp_rank):
        part = buf if spec is None else buf.narrow(spec.dim, at, box[spec.dim][1] - box[spec.dim][0])
        read_box(directory, entry, saved_name, box, part, handles=handles, checks=checks)
    return buf
