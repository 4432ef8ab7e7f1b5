"""Sharded safetensors checkpoints in Hugging Face key space that load into any mesh.

Layout of a checkpoint directory ``path``::

    path/latest                      name of the current checkpoint (replaced atomically)
    path/ckpt-000020/index.json      every tensor: HF name, global shape, dtype, and its pieces
    path/ckpt-000020/shard-pp0-tp0.safetensors   what the rank at (pp=0, tp=0) of dp rank 0 holds

A checkpoint is named by the training step it holds (``step=``; a save without one takes the number
after the current checkpoint's, a second save of a step gets ``.1``).

A piece is a box of the *global, unpadded* tensor (start/stop per dimension) stored under one key
of one file. Each distinct shard is written once: by dp rank 0, by the first of KV-head replicas,
by tp rank 0 for replicated tensors, by the first stage for a weight tied across stages. Optimizer
state tensors shaped like their parameter are stored exactly like it (``optimizer/<name>/<key>``).
Loading computes the box each local shard covers (from its ``ShardSpec`` at the current mesh) and
reads only the overlapping parts of the saved pieces, so tp, pp and dp may all change.

A save writes ``ckpt-N.partial``, fsyncs every file, renames it to ``ckpt-N`` and only then points
``latest`` at it: a crash at any moment leaves ``latest`` naming a whole checkpoint.
"""

from __future__ import annotations

import json
import os
import shutil
import zlib
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist
from safetensors import safe_open
from safetensors.torch import save_file

from .atomic import give_plain_mode, write_text_atomic
from .checkpoint_names import LATEST, checkpoint_name, is_checkpoint_name, next_checkpoint_dir, parse_name
from .comm import barrier
from .shard import ShardSpec

if TYPE_CHECKING:
    from .parallel_model import ParallelModel

FORMAT = "qn_hf.checkpoint"
VERSION = 1
INDEX = "index.json"
_DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16, "float64": torch.float64,
           "int64": torch.int64, "int32": torch.int32, "uint8": torch.uint8, "bool": torch.bool}
_MAX_ELEMENTS = 1 << 40
_MAX_INDEX_BYTES = 256 << 20  # a million tensors' entries fit in far less
Box = list[list[int]]  # [[start, stop], ...] per dimension


class CheckpointError(ValueError):
    """A checkpoint that is missing, damaged, or does not fit the model."""


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def _fsync_file(path: str) -> None:
    with open(path, "rb") as f:
        os.fsync(f.fileno())


def _fsync_dir(path: str) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _write_json(obj: object, target: str) -> None:
    write_text_atomic(target, json.dumps(obj, indent=1))


# -- what this rank holds, as boxes of global tensors ----------------------------------------------
def _boxes(shape: torch.Size, spec: ShardSpec | None, tp_rank: int) -> list[tuple[Box, int]]:
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


def _global_shape(local: torch.Tensor, spec: ShardSpec | None) -> list[int]:
    shape = list(local.shape)
    if spec is not None:
        shape[spec.dim] = spec.size
    return shape


def _local_entries(pm: ParallelModel, optimizer: torch.optim.Optimizer | None):
    """(saved name, local tensor, spec, writes) for every tensor this rank holds."""
    followers = {tie.follower for tie in pm.stage_plan.ties}
    tp_rank = pm.coords["tp"]
    for name, p in pm.named_parameters():
        if name in followers:
            continue
        spec = pm.specs.get(name)
        writes = spec.writes(tp_rank) if spec is not None else tp_rank == 0
        yield name, p.detach(), spec, writes
        state = optimizer.state.get(p, {}) if optimizer is not None else {}
        for key, value in state.items():
            if isinstance(value, torch.Tensor):
                same = value.shape == p.shape
                yield f"optimizer/{name}/{key}", value.detach(), spec if same else None, writes if same else tp_rank == 0


# -- save ------------------------------------------------------------------------------------------
def save_checkpoint(pm: ParallelModel, path: str, *, optimizer: torch.optim.Optimizer | None = None,
                    step: int | None = None) -> str:
    """Write a checkpoint of ``pm`` (and ``optimizer``) under ``path``; return its directory."""
    from . import __version__

    if step is not None and (isinstance(step, bool) or not isinstance(step, int) or step < 0):
        raise ValueError(f"step={step!r} must be a non-negative integer (the training step the checkpoint holds)")
    chosen = torch.zeros(2, dtype=torch.int64, device=pm.device)
    if dist.get_rank() == 0:
        os.makedirs(path, exist_ok=True)
        chosen[0], chosen[1] = parse_name(os.path.basename(next_checkpoint_dir(path, step=step)))
    dist.broadcast(chosen, src=0)  # every rank writes into the directory rank 0 chose
    final = os.path.join(path, checkpoint_name(int(chosen[0]), int(chosen[1])))
    partial = final + ".partial"
    if dist.get_rank() == 0:
        shutil.rmtree(partial, ignore_errors=True)
        os.makedirs(partial)
    barrier(pm.device)

    if pm.coords["dp"] == 0:
        _write_shard(pm, optimizer, partial)
    barrier(pm.device)
    if dist.get_rank() == 0:
        index = {
            "format": FORMAT, "version": VERSION, "library_version": __version__, "step": step,
            "mesh": {"dp": pm.dims.dp, "tp": pm.dims.tp, "pp": pm.dims.pp},
            "config": pm.config.to_dict(), "tensors": {}, "optimizer": None, "files": {},
            "generation_config": generation_config_of(pm.module),
        }
        for meta_name in sorted(n for n in os.listdir(partial) if n.endswith(".json")):
            with open(os.path.join(partial, meta_name)) as f:
                meta = json.load(f)
            for name, entry in meta["tensors"].items():  # tp ranks each bring their pieces of a tensor
                into = index["tensors"].setdefault(name, {**entry, "pieces": []})
                into["pieces"] = into["pieces"] + entry["pieces"]
            if meta["optimizer"] is not None:
                index["optimizer"] = _merge_groups(index["optimizer"], meta["optimizer"])
            index["files"].update(meta.get("files", {}))
            os.unlink(os.path.join(partial, meta_name))
        _write_json(index, os.path.join(partial, INDEX))
        publish(partial, final)
    barrier(pm.device)
    return final


def publish(partial: str, final: str) -> None:
    """Make a fully written ``partial`` directory the current checkpoint: fsync it, rename it to
    ``final``, then atomically point ``latest`` at it, and only then remove older ones. A crash at
    any point leaves ``latest`` naming a whole checkpoint."""
    root = os.path.dirname(final)
    _fsync_dir(partial)
    os.rename(partial, final)
    _fsync_dir(root)
    _write_json(os.path.basename(final), os.path.join(root, LATEST))
    _fsync_dir(root)
    for old in os.listdir(root):
        if is_checkpoint_name(old.removesuffix(".partial")) and old != os.path.basename(final):
            shutil.rmtree(os.path.join(root, old), ignore_errors=True)


def file_digest(path: str) -> dict[str, int]:
    """Size and CRC-32 of a written file: what load checks, so flipped or missing bytes are caught
    (safetensors checks its header, not the data)."""
    crc, size = 0, 0
    with open(path, "rb") as f:
        while chunk := f.read(1 << 24):
            crc, size = zlib.crc32(chunk, crc), size + len(chunk)
    return {"bytes": size, "crc32": crc}


class FileChecks:
    """Verifies each checkpoint file against the index's digest the first time this rank reads
    from it (only the files it reads, so a rank never scans the whole checkpoint)."""

    def __init__(self, directory: str, digests: dict | None) -> None:
        self.directory = directory
        self.digests = digests or {}
        self.done: set[str] = set()

    def verify(self, file: str) -> None:
        if file in self.done or file not in self.digests:
            return
        path = os.path.join(self.directory, file)
        try:
            actual = file_digest(path)
        except FileNotFoundError:
            raise CheckpointError(f"{path} is missing") from None
        expected = self.digests[file]
        if actual != expected:
            raise CheckpointError(f"{path} is corrupt: {actual['bytes']:,} bytes with CRC-32 {actual['crc32']:#010x}, "
                                  f"the index recorded {expected['bytes']:,} bytes with CRC-32 {expected['crc32']:#010x}")
        self.done.add(file)


def entry_nbytes(entry: dict) -> int:
    """Bytes of the whole tensor an index entry describes."""
    return torch.Size(entry["shape"]).numel() * torch.empty(0, dtype=_DTYPES[entry["dtype"]]).element_size()


def _merge_groups(merged: list[dict] | None, groups: list[dict]) -> list[dict]:
    if merged is None:
        return groups
    for into, extra in zip(merged, groups):
        into["params"] = sorted(set(into["params"]) | set(extra["params"]))
    return merged


def _write_shard(pm: ParallelModel, optimizer: torch.optim.Optimizer | None, directory: str) -> None:
    stem = f"shard-pp{pm.coords['pp']}-tp{pm.coords['tp']}"
    file = stem + ".safetensors"
    tensors: dict[str, torch.Tensor] = {}
    entries: dict[str, dict] = {}
    for name, value, spec, writes in _local_entries(pm, optimizer):
        if not writes:
            continue
        pieces = []
        for i, (box, at) in enumerate(_boxes(value.shape, spec, pm.coords["tp"])):
            local = value if spec is None else value.narrow(spec.dim, at, box[spec.dim][1] - box[spec.dim][0])
            key = f"{name}#{i}"
            tensors[key] = local.to("cpu").contiguous()
            pieces.append({"file": file, "key": key, "box": box})
        entries[name] = {"shape": _global_shape(value, spec), "dtype": _dtype_name(value.dtype), "pieces": pieces}
    groups = None
    if optimizer is not None:
        names = {id(p): n for n, p in pm.named_parameters()}
        followers = {tie.follower for tie in pm.stage_plan.ties}
        groups = []
        for group in optimizer.param_groups:
            hyper = {k: v for k, v in group.items() if k != "params" and isinstance(v, (int, float, bool, str, type(None), list, tuple))}
            groups.append({**hyper, "params": sorted(names[id(p)] for p in group["params"] if names.get(id(p)) not in followers)})
    save_file(tensors, os.path.join(directory, file), metadata={"format": "pt"})
    give_plain_mode(os.path.join(directory, file))  # safetensors creates it owner-only
    _fsync_file(os.path.join(directory, file))
    written = {file: file_digest(os.path.join(directory, file))}
    _write_json({"tensors": entries, "optimizer": groups, "files": written}, os.path.join(directory, stem + ".json"))


def generation_config_of(module: torch.nn.Module) -> dict | None:
    """What ``save_pretrained`` writes as generation_config.json (for a model that generates), as a
    dict for the index, so ``qn-hf-convert to-hf`` writes it too."""
    generation_config = getattr(module, "generation_config", None)
    if generation_config is None or not getattr(module, "can_generate", lambda: False)():
        return None
    return generation_config.to_dict()


# -- load ------------------------------------------------------------------------------------------
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
        if size > _MAX_INDEX_BYTES:  # refuse before reading: a forged index must not exhaust memory
            raise CheckpointError(f"{where} is {size:,} bytes, more than an index can be ({_MAX_INDEX_BYTES:,})")
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
        _check_entry(where, name, entry)
    files = index.get("files", {})
    if not isinstance(files, dict) or not all(
        isinstance(f, str) and os.path.basename(f) == f and isinstance(d, dict) and set(d) == {"bytes", "crc32"}
        and all(isinstance(v, int) and not isinstance(v, bool) and v >= 0 for v in d.values())
        for f, d in files.items()
    ):
        raise CheckpointError(f"{where}: 'files' must map file names to their bytes and crc32")
    return index


def _check_entry(where: str, name: str, entry: object) -> None:
    def bad(why: str) -> CheckpointError:
        return CheckpointError(f"{where}: tensor {name!r}: {why}")

    if not isinstance(entry, dict) or entry.get("dtype") not in _DTYPES:
        raise bad(f"dtype must be one of {sorted(_DTYPES)}")
    shape = entry.get("shape")
    if not isinstance(shape, list) or not all(isinstance(n, int) and not isinstance(n, bool) and n >= 0 for n in shape):
        raise bad(f"shape {shape!r} is not a list of non-negative integers")
    volume = 1
    for n in shape:
        volume *= n
    if volume > _MAX_ELEMENTS:
        raise bad(f"shape {shape} has more than 2**40 elements")
    pieces = entry.get("pieces")
    if not isinstance(pieces, list) or not pieces:
        raise bad("no pieces")
    covered = 0
    boxes = []
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
        boxes.append(box)
    for i, a in enumerate(boxes):
        for b in boxes[i + 1 :]:
            if all(max(x[0], y[0]) < min(x[1], y[1]) for x, y in zip(a, b)) and len(a) > 0:
                raise bad(f"pieces {a} and {b} overlap")
    if covered != volume:
        raise bad(f"pieces cover {covered} of {volume} elements")


def _read_box(directory: str, entry: dict, name: str, target_box: Box, out: torch.Tensor,
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
            if list(sl.get_shape()) != [b - a for a, b in box]:
                raise CheckpointError(f"{file}: {piece['key']} has shape {sl.get_shape()}, the index says box {box}")
            src = sl[tuple(slice(lo - a[0], hi - a[0]) for (lo, hi), a in zip(overlap, box))] if overlap else sl[...]
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


def _read_local(directory: str, index: dict, saved_name: str, like: torch.Tensor, spec: ShardSpec | None,
                tp_rank: int, *, shape: list[int] | None = None, checks: FileChecks | None = None) -> torch.Tensor:
    """This rank's shard of ``saved_name``, read on the CPU, checked against the model's tensor."""
    entry = index["tensors"].get(saved_name)
    if entry is None:
        raise CheckpointError(f"{directory}: the checkpoint has no tensor {saved_name!r}; "
                              f"was it saved from another architecture?")
    local_shape = list(like.shape) if shape is None else shape
    expected = _global_shape(torch.empty(local_shape, device="meta"), spec)
    if entry["shape"] != expected:
        raise CheckpointError(f"{directory}: {saved_name} has shape {entry['shape']}, the model needs {expected}")
    if _DTYPES[entry["dtype"]] != like.dtype:
        raise CheckpointError(f"{directory}: {saved_name} is {entry['dtype']}, the model holds {_dtype_name(like.dtype)}")
    buf = torch.zeros(local_shape, dtype=like.dtype)  # padding rows stay zero
    for box, at in _boxes(torch.Size(local_shape), spec, tp_rank):
        part = buf if spec is None else buf.narrow(spec.dim, at, box[spec.dim][1] - box[spec.dim][0])
        _read_box(directory, entry, saved_name, box, part, checks=checks)
    return buf


def load_checkpoint(pm: ParallelModel, path: str, *, optimizer: torch.optim.Optimizer | None = None) -> dict:
    """Load a checkpoint saved at any mesh, or a Hugging Face directory, into ``pm`` (and
    ``optimizer``); return its metadata.

    Everything is read and checked first; if any rank finds a problem, every rank raises the same
    ``CheckpointError`` (naming the rank, file and tensor) and nothing in the model or optimizer
    has changed."""
    error, loaded = None, None
    try:
        loaded = _read_all(pm, path, optimizer)
    except CheckpointError as e:
        error = str(e)
    errors = [None] * dist.get_world_size()
    dist.all_gather_object(errors, error)
    failed = [(r, e) for r, e in enumerate(errors) if e is not None]
    if failed:
        rank, message = failed[0]
        raise CheckpointError(f"rank {rank}: {message}" + (f" (and {len(failed) - 1} more ranks failed)" if len(failed) > 1 else ""))
    index, tensors, states = loaded
    params = dict(pm.named_parameters())
    with torch.no_grad():
        for name, value in tensors.items():
            params[name].copy_(value)
    if optimizer is not None:
        for group, saved_group in zip(optimizer.param_groups, index["optimizer"]):
            for key, value in saved_group.items():
                if key != "params" and key in group:
                    group[key] = tuple(value) if isinstance(group[key], tuple) else value
        for p, state in states.items():
            optimizer.state[p] = {k: v.to(p.device) for k, v in state.items()}
    return {"step": index.get("step"), "mesh": index.get("mesh"), "library_version": index.get("library_version")}


def _read_all(pm: ParallelModel, path: str, optimizer: torch.optim.Optimizer | None):
    from .hf_source import base_prefixes, is_hf_dir, read_hf_dir, source_name  # hf_source imports this module

    if is_hf_dir(path):
        if optimizer is not None:
            raise CheckpointError(f"{path} is a Hugging Face directory: it holds no optimizer state")
        directory = path
        index, config = read_hf_dir(path)
    else:
        directory = checkpoint_dir(path)
        index = read_index(directory)
        config = index.get("config", {})
    checks = FileChecks(directory, index.get("files"))
    saved_type = config.get("model_type")
    if saved_type != pm.config.model_type:
        raise CheckpointError(f"{directory} holds a {saved_type!r} model, this one is {pm.config.model_type!r}")
    owner_of = {tie.follower: tie.owner for tie in pm.stage_plan.ties}
    tp_rank = pm.coords["tp"]
    params = dict(pm.named_parameters())
    prefixes = base_prefixes(config)
    tensors = {}
    for name, p in params.items():
        try:
            saved = source_name(index, owner_of.get(name, name), prefixes)
        except CheckpointError as e:
            raise CheckpointError(f"{directory}: {e}") from None
        tensors[name] = _read_local(directory, index, saved, p, pm.specs.get(name), tp_rank, checks=checks)
    states: dict[torch.nn.Parameter, dict[str, torch.Tensor]] = {}
    if optimizer is not None:
        _check_optimizer(directory, index, optimizer, params, owner_of)
        names = {id(p): n for n, p in params.items()}
        for group in optimizer.param_groups:
            for p in group["params"]:
                name = names[id(p)]
                prefix = f"optimizer/{owner_of.get(name, name)}/"
                spec = pm.specs.get(name)
                state = {}
                for key in (k for k in index["tensors"] if k.startswith(prefix)):
                    entry = index["tensors"][key]
                    like = torch.empty(0, dtype=_DTYPES[entry["dtype"]])
                    same = entry["shape"] == _global_shape(p, spec)
                    shape = list(p.shape) if same else entry["shape"]
                    state[key[len(prefix):]] = _read_local(directory, index, key, like, spec if same else None, tp_rank,
                                                           shape=shape, checks=checks)
                if state:
                    states[p] = state
    return index, tensors, states


def _check_optimizer(directory, index, optimizer, params, owner_of) -> None:
    saved = index.get("optimizer")
    if not isinstance(saved, list):
        raise CheckpointError(f"{directory} has no optimizer state; load without optimizer= or save with it")
    if len(saved) != len(optimizer.param_groups):
        raise CheckpointError(f"{directory}: the optimizer had {len(saved)} parameter groups, this one has "
                              f"{len(optimizer.param_groups)}")
    names = {id(p): n for n, p in params.items()}
    for i, (group, saved_group) in enumerate(zip(optimizer.param_groups, saved)):
        for p in group["params"]:
            name = owner_of.get(names.get(id(p)), names.get(id(p)))
            if name is None or name not in saved_group.get("params", []):
                raise CheckpointError(f"{directory}: parameter {names.get(id(p), '?')} is in optimizer group {i} "
                                      f"here but not in the saved group {i}")
