"""The on-disk format of a sharded checkpoint, in one place: file and key names, dtypes, which rank
writes a tensor, the boxes a tensor is stored in, and the validation of an index.

A checkpoint directory ``ckpt-<step>`` holds ``index.json`` and one ``shard-pp<stage>-tp<rank>.safetensors``
per (stage, tp rank) that has something to write. The index records, for every tensor (HF name;
optimizer state as ``optimizer/<param>/<key>``), its global unpadded shape, its dtype and its pieces:
each piece is a box of the global tensor (``[start, stop]`` per dimension) stored under one key of
one file. The pieces of a tensor tile it exactly once.
"""

from __future__ import annotations

import math
import os
import warnings

import torch

from ..data_parallel.precision import scaler_state_problem
from ..tensor_parallel.shard import ShardSpec
from .errors import CheckpointError
from .json_records import parse_json, read_bytes, read_json
from .names import LATEST, is_checkpoint_name
from .seal import legacy_note, seal_problem
from .tiling import Box, corner_sums

FORMAT = "qn_hf.checkpoint"
VERSION = 2  # 2: the index is sealed (seal.py) and records the loss scale and parameters without optimizer state
READABLE_VERSIONS = (1, 2)  # 1 loads with a warning: its index cannot be verified
INDEX = "index.json"
# dtype names in the index, and the codes safetensors files use for them
DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16, "float64": torch.float64,
          "int64": torch.int64, "int32": torch.int32, "uint8": torch.uint8, "bool": torch.bool}
SAFETENSORS_CODES = {"float32": "F32", "float16": "F16", "bfloat16": "BF16", "float64": "F64", "int64": "I64",
                     "int32": "I32", "uint8": "U8", "bool": "BOOL"}
MAX_ELEMENTS = 1 << 40
MAX_CORNERS = 1 << 24  # pieces x 2**(dimensions they cut): ZeRO over 1024 ranks at tp 8 needs 2**17
OPTIMIZER = "optimizer/"


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


def entry_nbytes(entry: dict) -> int:
    """Bytes of the whole tensor an index entry describes."""
    return torch.Size(entry["shape"]).numel() * torch.empty(0, dtype=DTYPES[entry["dtype"]]).element_size()


def new_index(*, library_version: str, step: int | None, mesh: dict[str, int], config: dict,
              tensors: dict[str, dict], optimizer: list[dict] | None, files: dict[str, dict],
              generation_config: dict | None, loss_scaler: dict | None) -> dict:
    """``loss_scaler``: float16's ``LossScaler.state()``, or None for a run without one."""
    return {"format": FORMAT, "version": VERSION, "library_version": library_version, "step": step, "mesh": mesh,
            "config": config, "tensors": tensors, "optimizer": optimizer, "files": files,
            "generation_config": generation_config, "loss_scaler": loss_scaler}


def checkpoint_dir(path: str) -> str:
    """The directory of the current checkpoint under ``path`` (or ``path`` itself if it is one)."""
    if os.path.isfile(os.path.join(path, INDEX)):
        return path
    if not os.path.lexists(os.path.join(path, LATEST)):
        raise CheckpointError(f"{path} holds no checkpoint (no {LATEST} and no {INDEX})")
    name = read_json(os.path.join(path, LATEST))  # bounded: a planted huge pointer is refused unread
    if not isinstance(name, str) or not is_checkpoint_name(name):
        raise CheckpointError(f"{os.path.join(path, LATEST)} names {name!r}, not a checkpoint directory")
    return os.path.join(path, name)


def read_index(directory: str) -> dict:
    """The validated index: its own digest first (any edited byte is refused), then its fields' types,
    names, dtypes, shapes, boxes that tile each tensor exactly once, file names that stay inside the
    directory and each with its recorded digest, optimizer state that belongs to a tensor and is no
    larger than it, and no file asked to hold more bytes than it has."""
    where = os.path.join(directory, INDEX)
    data = read_bytes(where)
    index = parse_json(where, data)
    if not isinstance(index, dict) or index.get("format") != FORMAT or index.get("version") not in READABLE_VERSIONS:
        raise CheckpointError(f"{where} is not a {FORMAT} index of version {' or '.join(map(str, READABLE_VERSIONS))}")
    problem = seal_problem(data, index)
    if problem is not None:
        raise CheckpointError(f"{where} {problem}")
    if legacy_note(index) is not None:
        warnings.warn(f"{where} {legacy_note(index)}", stacklevel=2)
    check_fields(where, index)
    tensors = index["tensors"]
    for name, entry in tensors.items():
        check_entry(where, name, entry)
    for name, entry in tensors.items():
        if name.startswith(OPTIMIZER):
            _check_state(where, name, entry, tensors)
    _check_file_sizes(directory, tensors, index["files"])
    return index


def _count(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0


def check_fields(where: str, index: dict) -> None:
    """Every field but the tensors' entries: the types a reader relies on."""
    def need(ok: bool, field: str, what: str) -> None:
        if not ok:
            raise CheckpointError(f"{where}: {field!r} is {str(index.get(field))[:80]!r}; it must be {what}")

    need(isinstance(index.get("tensors"), dict), "tensors", "a mapping from tensor names to entries")
    need(index.get("step") is None or _count(index["step"]), "step", "a non-negative integer or null")
    config = index.get("config")
    need(isinstance(config, dict) and isinstance(config.get("model_type"), str), "config",
         "the model's config, a mapping with its model_type")
    mesh = index.get("mesh", {})
    need(isinstance(mesh, dict) and all(_count(v) for v in mesh.values()), "mesh", "a mapping to mesh sizes")
    need(index.get("generation_config") is None or isinstance(index["generation_config"], dict), "generation_config",
         "a mapping or null")
    need(index.get("library_version") is None or isinstance(index["library_version"], str), "library_version",
         "a string")
    groups = index.get("optimizer")
    scalar = (type(None), bool, int, float, str)
    need(groups is None or (isinstance(groups, list) and all(
        isinstance(g, dict) and isinstance(g.get("params"), list) and all(isinstance(p, str) for p in g["params"])
        and all(isinstance(v, scalar) or (isinstance(v, list) and all(isinstance(x, scalar) for x in v))
                for k, v in g.items() if k != "params") for g in groups)),
         "optimizer", "null or a list of parameter groups: plain hyperparameters and the names of their 'params'")
    files = index.get("files")
    need(isinstance(files, dict) and all(
        os.path.basename(f) == f and isinstance(d, dict) and set(d) == {"bytes", "crc32"}
        and all(_count(v) for v in d.values())
        for f, d in files.items()), "files", "a mapping from file names to their bytes and crc32")
    scaler_problem = scaler_state_problem(index["loss_scaler"]) if index.get("loss_scaler") is not None else None
    need(scaler_problem is None, "loss_scaler", f"null or a loss scaler's state ({scaler_problem})")


def check_entry(where: str, name: str, entry: object) -> None:
    """One tensor's entry: a known dtype, a sane shape, and pieces inside it that tile it once."""
    def bad(why: str) -> CheckpointError:
        return CheckpointError(f"{where}: tensor {name!r}: {why}")

    if not isinstance(entry, dict) or entry.get("dtype") not in DTYPES:
        raise bad(f"dtype must be one of {sorted(DTYPES)}")
    shape = entry.get("shape")
    if not isinstance(shape, list) or not all(_count(n) for n in shape):
        raise bad(f"shape {shape!r} is not a list of non-negative integers")
    if math.prod(shape) > MAX_ELEMENTS:
        raise bad(f"shape {shape} has more than 2**40 elements")
    pieces = entry.get("pieces")
    if not isinstance(pieces, list) or not pieces:
        raise bad("no pieces")
    for piece in pieces:
        if (not isinstance(piece, dict) or not isinstance(piece.get("key"), str)
                or not _count(piece.get("lead", 0)) or piece.get("lead", 0) > len(shape)):
            raise bad(f"piece {str(piece)[:200]} is malformed")
        file, span = piece.get("file"), piece.get("span")
        if span is not None:  # a chunk of a torch.distributed.checkpoint file (dcp/index.py)
            if not (isinstance(span, list) and len(span) == 2 and all(_count(v) for v in span)) \
                    or not _inside(file, levels=2, suffix=".distcp"):
                raise bad(f"piece {str(piece)[:200]} is not a byte span of a .distcp file inside the directory")
        elif not _inside(file, levels=1, suffix=".safetensors"):
            raise bad(f"file {file!r} is not a .safetensors name inside the checkpoint directory")
        box = piece.get("box")
        if (not isinstance(box, list) or len(box) != len(shape)
                or not all(isinstance(r, list) and len(r) == 2 and all(_count(v) for v in r) for r in box)
                or not all(a <= b <= n for (a, b), n in zip(box, shape))):
            raise bad(f"box {str(box)[:200]} does not lie inside shape {shape}")
    rows = entry.get("rows")
    if rows is not None and not (
            shape and isinstance(rows, dict) and _count(rows.get("block")) and rows["block"] > 0
            and shape[0] % rows["block"] == 0 and isinstance(rows.get("order"), list)
            and sorted(rows["order"]) == list(range(rows["block"]))):
        raise bad(f"row order {str(rows)[:200]} is not a permutation within blocks of its rows")
    boxes_ = [piece["box"] for piece in pieces]
    covered, volume = sum(math.prod(b - a for a, b in box) for box in boxes_), math.prod(shape)
    if covered != volume:
        raise bad(f"pieces cover {covered} of {volume} elements")
    split = [d for d in range(len(shape)) if any(box[d] != [0, shape[d]] for box in boxes_)]
    if len(boxes_) << len(split) > MAX_CORNERS:
        raise bad(f"{len(boxes_)} pieces cut along {len(split)} dimensions; more than a checkpoint ever needs")
    if corner_sums(boxes_, split) != corner_sums([[[0, n] for n in shape]], split):
        raise bad(f"pieces overlap: they add up to its {volume} elements but cover some twice and others never")


def _inside(file: object, *, levels: int, suffix: str) -> bool:
    """``file`` names a ``suffix`` file at most ``levels`` plain names below the checkpoint directory."""
    if not isinstance(file, str) or not file.endswith(suffix):
        return False
    parts = file.split("/")
    return len(parts) <= levels and all(p not in ("", ".", "..") and os.path.basename(p) == p and "\\" not in p
                                        for p in parts)


def _check_state(where: str, name: str, entry: dict, tensors: dict) -> None:
    """Optimizer state belongs to a tensor of the checkpoint and is shaped like it, or smaller (a step
    counter, a factored second moment): a reader allocates it, so it must not be arbitrarily large."""
    param, _, key = name[len(OPTIMIZER):].rpartition("/")
    if not key or param.startswith(OPTIMIZER) or param not in tensors:
        raise CheckpointError(f"{where}: optimizer state {name!r} belongs to no tensor of the checkpoint "
                              f"(saved names are {OPTIMIZER}<tensor>/<state>)")
    own = tensors[param]["shape"]
    if entry["shape"] != own and math.prod(entry["shape"]) > max(1, math.prod(own)):
        raise CheckpointError(f"{where}: optimizer state {name!r} has shape {entry['shape']}, larger than its "
                              f"tensor's {own}")


def _check_file_sizes(directory: str, tensors: dict, files: dict) -> None:
    """Each file holds at least the bytes the index places in it: checked before anything is allocated
    or read, so an index cannot make a reader allocate more than the checkpoint's files hold."""
    need: dict[str, int] = {}
    for entry in tensors.values():
        itemsize = DTYPES[entry["dtype"]].itemsize
        for piece in entry["pieces"]:
            need[piece["file"]] = need.get(piece["file"], 0) + itemsize * math.prod(b - a for a, b in piece["box"])
    for file, nbytes in need.items():
        path = os.path.join(directory, file)
        if file not in files:  # without its digest, a file's damage would go unseen
            raise CheckpointError(f"{path}: the index records no size and CRC-32 for it in 'files', so its bytes "
                                  f"cannot be checked; use an intact copy of the index")
        recorded = files[file]["bytes"]
        if nbytes > recorded:
            raise CheckpointError(f"{path}: the index places {nbytes:,} bytes of tensors in it but records it as "
                                  f"{recorded:,} bytes")
        try:
            actual = os.path.getsize(path)
        except FileNotFoundError:
            continue  # reported by the rank that reads from it, naming the tensor
        except OSError as e:
            raise CheckpointError(f"{path} cannot be read: {e}") from None
        if nbytes > actual:
            raise CheckpointError(f"{path} is corrupt: the index places {nbytes:,} bytes of tensors in it, "
                                  f"the file has {actual:,}")
