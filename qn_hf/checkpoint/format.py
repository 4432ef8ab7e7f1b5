"""The on-disk format of a sharded checkpoint, in one place: file and key names, dtypes, which rank
writes a tensor, the boxes a tensor is stored in, and the validation of an index.

A checkpoint directory ``ckpt-<step>`` holds ``index.json`` and one ``shard-pp<stage>-tp<rank>.safetensors``
per (stage, tp rank) that has something to write. The index records, for every tensor (HF name;
optimizer state as ``optimizer/<param>/<key>``), its global unpadded shape, its dtype and its pieces:
each piece is a box of the global tensor (``[start, stop]`` per dimension) stored under one key of
one file. The pieces of a tensor tile it exactly once.
"""

from __future__ import annotations

import json
import os

import torch

from ..shard import ShardSpec
from .names import LATEST, is_checkpoint_name

FORMAT = "qn_hf.checkpoint"
VERSION = 1
INDEX = "index.json"
# dtype names in the index, and the codes safetensors files use for them
DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16, "float64": torch.float64,
          "int64": torch.int64, "int32": torch.int32, "uint8": torch.uint8, "bool": torch.bool}
SAFETENSORS_CODES = {"float32": "F32", "float16": "F16", "bfloat16": "BF16", "float64": "F64", "int64": "I64",
                     "int32": "I32", "uint8": "U8", "bool": "BOOL"}
MAX_ELEMENTS = 1 << 40
MAX_INDEX_BYTES = 256 << 20  # a million tensors' entries fit in far less
OPTIMIZER = "optimizer/"
Box = list[list[int]]  # [[start, stop], ...] per dimension


class CheckpointError(ValueError):
    """A checkpoint that is missing, damaged, or does not fit the model."""


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def safetensors_code(dtype: torch.dtype) -> str:
    return SAFETENSORS_CODES[dtype_name(dtype)]


def dtype_of_code(code: str) -> str:
    """The index's dtype name for a safetensors dtype code (unknown codes pass through, and fail the
    entry check with the list of known ones)."""
    return next((name for name, c in SAFETENSORS_CODES.items() if c == code), code)


def shard_file(stage: int, tp_rank: int, dp_rank: int = 0) -> str:
    """The file one rank writes: dp rank 0 for whole tensors; other dp ranks only their pieces of
    sharded optimizer state (``zero=True``)."""
    return f"shard-pp{stage}-tp{tp_rank}" + (f"-dp{dp_rank}" if dp_rank else "") + ".safetensors"


def optimizer_key(param: str, key: str) -> str:
    """The saved name of one optimizer state tensor (``exp_avg``) of the parameter saved as ``param``."""
    return f"{OPTIMIZER}{param}/{key}"


def optimizer_prefix(param: str) -> str:
    return f"{OPTIMIZER}{param}/"


def tp_writes(spec: ShardSpec | None, tp_rank: int) -> bool:
    """One writer per distinct shard: the first of KV-head replicas; tp rank 0 for a tensor
    replicated over tp."""
    return spec.writes(tp_rank) if spec is not None else tp_rank == 0


def state_spec(state_shape: list[int] | tuple[int, ...], param_shape: list[int] | tuple[int, ...],
               spec: ShardSpec | None) -> ShardSpec | None:
    """Optimizer state shaped like its parameter is sharded like it; any other state (a step
    counter) is replicated and written once."""
    return spec if list(state_shape) == list(param_shape) else None


def global_shape(local_shape: list[int] | tuple[int, ...] | torch.Size, spec: ShardSpec | None) -> list[int]:
    shape = list(local_shape)
    if spec is not None:
        shape[spec.dim] = spec.size
    return shape


def boxes(shape: torch.Size, spec: ShardSpec | None, tp_rank: int) -> list[tuple[Box, int]]:
    """(global box, local offset along the split dim) for each contiguous piece of a local tensor."""
    full = [[0, n] for n in shape]
    if spec is None:
        return [(full, 0)]
    out = []
    for start, stop, at in spec.pieces(tp_rank):
        box = [list(r) for r in full]
        box[spec.dim] = [start, stop]
        out.append((box, at))
    return out


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


def entry_nbytes(entry: dict) -> int:
    """Bytes of the whole tensor an index entry describes."""
    return torch.Size(entry["shape"]).numel() * torch.empty(0, dtype=DTYPES[entry["dtype"]]).element_size()


def new_index(*, library_version: str, step: int | None, mesh: dict[str, int], config: dict,
              tensors: dict[str, dict], optimizer: list[dict] | None, files: dict[str, dict],
              generation_config: dict | None) -> dict:
    return {"format": FORMAT, "version": VERSION, "library_version": library_version, "step": step, "mesh": mesh,
            "config": config, "tensors": tensors, "optimizer": optimizer, "files": files,
            "generation_config": generation_config}


def checkpoint_dir(path: str) -> str:
    """The directory of the current checkpoint under ``path`` (or ``path`` itself if it is one)."""
    if os.path.isfile(os.path.join(path, INDEX)):
        return path
    try:
        with open(os.path.join(path, LATEST)) as f:
            name = json.load(f)
    except FileNotFoundError:
        raise CheckpointError(f"{path} holds no checkpoint (no {LATEST} and no {INDEX})") from None
    except (OSError, ValueError) as e:
        raise CheckpointError(f"{os.path.join(path, LATEST)} is unreadable: {e}") from None
    if not isinstance(name, str) or not is_checkpoint_name(name):
        raise CheckpointError(f"{os.path.join(path, LATEST)} names {name!r}, not a checkpoint directory")
    return os.path.join(path, name)


def read_index(directory: str) -> dict:
    """The validated index: names, dtypes, shapes, boxes that tile each tensor exactly once, and
    file names that stay inside the directory."""
    where = os.path.join(directory, INDEX)
    try:
        size = os.path.getsize(where)
        if size > MAX_INDEX_BYTES:  # refuse before reading: a forged index must not exhaust memory
            raise CheckpointError(f"{where} is {size:,} bytes, more than an index can be ({MAX_INDEX_BYTES:,})")
        with open(where) as f:
            index = json.load(f)
    except FileNotFoundError:
        raise CheckpointError(f"{where} is missing") from None
    except (OSError, ValueError, RecursionError) as e:  # RecursionError: absurdly nested JSON
        raise CheckpointError(f"{where} is not valid JSON: {type(e).__name__}: {str(e)[:200]}") from None
    if not isinstance(index, dict) or index.get("format") != FORMAT or index.get("version") != VERSION:
        raise CheckpointError(f"{where} is not a {FORMAT} v{VERSION} index")
    tensors = index.get("tensors")
    if not isinstance(tensors, dict):
        raise CheckpointError(f"{where}: 'tensors' must be a mapping")
    for name, entry in tensors.items():
        check_entry(where, name, entry)
    files = index.get("files", {})
    if not isinstance(files, dict) or not all(
        isinstance(f, str) and os.path.basename(f) == f and isinstance(d, dict) and set(d) == {"bytes", "crc32"}
        and all(isinstance(v, int) and not isinstance(v, bool) and v >= 0 for v in d.values())
        for f, d in files.items()
    ):
        raise CheckpointError(f"{where}: 'files' must map file names to their bytes and crc32")
    return index


def check_entry(where: str, name: str, entry: object) -> None:
    """One tensor's entry: a known dtype, a sane shape, and pieces inside it that tile it once."""
    def bad(why: str) -> CheckpointError:
        return CheckpointError(f"{where}: tensor {name!r}: {why}")

    if not isinstance(entry, dict) or entry.get("dtype") not in DTYPES:
        raise bad(f"dtype must be one of {sorted(DTYPES)}")
    shape = entry.get("shape")
    if not isinstance(shape, list) or not all(isinstance(n, int) and not isinstance(n, bool) and n >= 0 for n in shape):
        raise bad(f"shape {shape!r} is not a list of non-negative integers")
    volume = 1
    for n in shape:
        volume *= n
    if volume > MAX_ELEMENTS:
        raise bad(f"shape {shape} has more than 2**40 elements")
    pieces = entry.get("pieces")
    if not isinstance(pieces, list) or not pieces:
        raise bad("no pieces")
    covered = 0
    seen = []
    for piece in pieces:
        if not isinstance(piece, dict) or not isinstance(piece.get("key"), str):
            raise bad(f"piece {piece!r} is malformed")
        file = piece.get("file")
        if not isinstance(file, str) or os.path.basename(file) != file or file in ("", ".", "..") or not file.endswith(".safetensors"):
            raise bad(f"file {file!r} is not a .safetensors name inside the checkpoint directory")
        box = piece.get("box")
        if (not isinstance(box, list) or len(box) != len(shape)
                or not all(isinstance(r, list) and len(r) == 2 and all(isinstance(v, int) for v in r) for r in box)
                or not all(0 <= a <= b <= n for (a, b), n in zip(box, shape))):
            raise bad(f"box {box!r} does not lie inside shape {shape}")
        size = 1
        for a, b in box:
            size *= b - a
        covered += size
        seen.append(box)
    for i, a in enumerate(seen):
        for b in seen[i + 1 :]:
            if all(max(x[0], y[0]) < min(x[1], y[1]) for x, y in zip(a, b)) and len(a) > 0:
                raise bad(f"pieces {a} and {b} overlap")
    if covered != volume:
        raise bad(f"pieces cover {covered} of {volume} elements")
