"""Saving a sharded checkpoint from every rank of the mesh.

Each distinct shard is written once, by the rank the placement names (``ShardPlacement.writes``): dp
rank 0, the first of KV-head replicas, tp rank 0 for a tensor replicated over tp, the first of the
ranks holding the same experts for an ep-sharded experts block, each rank its ZeRO-1 pieces, the
first dp_shard group its rows; the first stage for a weight tied across stages. Every writing
rank writes its own safetensors file and a small JSON of its entries; rank 0 merges those into the
index. The directory is written as ``ckpt-N.partial`` and published only when whole.
"""

from __future__ import annotations

import json
import math
import os
from collections.abc import Iterator
from dataclasses import dataclass

import torch
import torch.distributed as dist
from safetensors.torch import save_file
from torch import nn

from ..arguments import check_non_negative_int, check_positive_int
from ..comm import barrier
from ..data_parallel.optimizer import OptimizerView
from ..data_parallel.precision import LossScaler
from ..data_parallel.sharded import local, row_range
from ..placement import Held, ShardPlacement
from ..tensor_parallel.shard import ShardSpec
from ..version import __version__
from .atomic import fresh_dir, give_plain_mode
from .files import PARTIAL, file_digest, fsync_file, prune, publish, write_json
from .format import INDEX, CheckpointError, boxes, dtype_name, global_shape, new_index, optimizer_key, shard_file
from .hf import generation_config_of, recorded_config
from .lock import DirectoryInUse, HeldDirectories
from .names import next_checkpoint_dir
from .optimizer_state import merge_groups, optimizer_groups, optimizer_view
from .pieces import flat_runs
from .seal import write_index


def save_checkpoint(module: nn.Module, path: str, *, placement: ShardPlacement, config,
                    optimizer: torch.optim.Optimizer | None = None, step: int | None = None,
                    virtual_stages: int = 1, keep_last: int | None = None, scaler: LossScaler | None = None,
                    roots: HeldDirectories | None = None) -> str:
    """Write a checkpoint of ``module``'s shard on every rank (and ``optimizer``'s state, and float16's
    loss ``scaler``) under ``path``; return its directory. ``config`` is the whole model's config;
    ``virtual_stages`` is recorded in the index's mesh (informational: files are per pp rank and loading
    goes by name). Other checkpoints under ``path`` stay, unless ``keep_last`` asks to remove all but the
    newest ``keep_last`` once this one is published (``prune``). Rank 0 holds ``path`` (``lock.py``) in
    the job's ``roots`` from its first save on, so that another job saving there is refused; without
    ``roots``, for this save only."""
    if step is not None:
        check_non_negative_int("step", step, what="the training step the checkpoint holds")
    if keep_last is not None:
        check_positive_int("keep_last", keep_last, fix="how many of the newest checkpoints to keep")
    own = roots is None
    roots = HeldDirectories() if own else roots
    try:
        final = os.path.join(path, _choose(path, step=step, placement=placement, roots=roots))
        partial = final + PARTIAL
        if dist.get_rank() == 0:
            fresh_dir(partial)
        barrier(placement.device)

        view = optimizer_view(optimizer) if optimizer is not None else None
        if placement.may_write(pieces=view is not None and bool(view.split_params)):
            write_shard(module, placement, view, partial)
        barrier(placement.device)
        if dist.get_rank() == 0:
            dims = placement.dims
            mesh = {"dp": dims.dp, "tp": dims.tp, "pp": dims.pp, **({"cp": dims.cp} if dims.cp > 1 else {}),
                    **({"ep": dims.ep} if dims.ep > 1 else {}),
                    **({"dp_shard": dims.dp_shard} if dims.dp_shard > 1 else {}),
                    **({"virtual_stages": virtual_stages} if virtual_stages > 1 else {})}
            index = new_index(library_version=__version__, step=step, mesh=mesh, config=recorded_config(config, module),
                              tensors={}, optimizer=None, files={}, generation_config=generation_config_of(module),
                              loss_scaler=scaler.state() if scaler is not None else None)
            for meta_name in sorted(n for n in os.listdir(partial) if n.endswith(".json")):
                with open(os.path.join(partial, meta_name)) as f:
                    meta = json.load(f)
                for name, entry in meta["tensors"].items():  # tp ranks each bring their pieces of a tensor
                    into = index["tensors"].setdefault(name, {**entry, "pieces": []})
                    into["pieces"] = into["pieces"] + entry["pieces"]
                if meta["optimizer"] is not None:
                    index["optimizer"] = merge_groups(index["optimizer"], meta["optimizer"])
                index["files"].update(meta.get("files", {}))
                os.unlink(os.path.join(partial, meta_name))
            write_index(index, os.path.join(partial, INDEX))
            publish(partial, final)
            if keep_last is not None:
                prune(path, keep_last=keep_last)
        barrier(placement.device)
        return final
    finally:
        if own:
            roots.release()


ROOT_PURPOSE = "saving checkpoints (pm.save_checkpoint)"
ROOT_FIX = ("Two jobs saving under one root delete each other's checkpoints (keep_last) and point latest at each "
            "other's weights: save this job's checkpoints under another root, or stop the job that holds it first "
            "(its lock goes when its process exits)")


def _choose(path: str, *, step: int | None, placement: ShardPlacement, roots: HeldDirectories) -> str:
    """The new checkpoint's directory name, chosen by rank 0 once it holds ``path``. A refusal (a root
    another job holds, a root that cannot be written) reaches every rank with the name, so all of them
    raise it before any collective that would wait on rank 0."""
    outcome: list = [None]
    error = None
    if dist.get_rank() == 0:
        try:
            os.makedirs(path, exist_ok=True)
            roots.hold(path, purpose=ROOT_PURPOSE, fix=ROOT_FIX)
            outcome[0] = os.path.basename(next_checkpoint_dir(path, step=step))
        except (DirectoryInUse, OSError) as e:
            error = e
            outcome[0] = (isinstance(e, DirectoryInUse), str(e) if isinstance(e, DirectoryInUse) else
                          f"cannot save a checkpoint under {path}: {type(e).__name__}: {e}")
    dist.broadcast_object_list(outcome, src=0, device=placement.device)
    if isinstance(outcome[0], tuple):
        in_use, message = outcome[0]
        if isinstance(error, DirectoryInUse):
            raise error
        raise DirectoryInUse(message, path=path) if in_use else CheckpointError(message)
    return outcome[0]


@dataclass(frozen=True)
class LocalTensor:
    """One tensor this rank holds (``values``), or under ``zero=True`` the flat range of it starting
    at ``start`` (``values`` 1-D), of a local tensor shaped ``shape``."""

    name: str  # the saved name
    values: torch.Tensor
    shape: list[int]
    start: int
    spec: ShardSpec | None
    writes: bool

    @property
    def whole(self) -> bool:
        return self.start == 0 and list(self.values.shape) == self.shape


def local_entries(module: nn.Module, placement: ShardPlacement, view: OptimizerView | None):
    """Every tensor this rank writes or could write (``writes``): weights, then optimizer state.

    Weights are the float32 masters under mixed precision; the placement says which rank writes each
    distinct value (dp rank 0, or each dp rank its ZeRO-1 pieces, or the first dp_shard group its rows)."""
    mixed = view is not None and view.mixed
    for name, p in module.named_parameters():
        if placement.is_follower(name):
            continue
        key = view.state_key(p) if view is not None else None
        rows = row_range(p)
        if rows is not None:  # dp_shard: this rank's rows, a flat range, and its optimizer state's
            state = view.inner.state.get(key, {}) if key is not None else {}
            yield from _row_entries(name, p, rows, placement, state)
            continue
        spec, shape = placement.spec(name), list(p.shape)
        m = view.master(p) if view is not None else None
        split = view is not None and view.split(p)  # ZeRO-1: its optimizer data in pieces over its holders
        held = Held.PIECES if split else Held.WHOLE
        once, mine = placement.writes(name), placement.writes(name, held)  # mine: what this rank holds
        if mixed and m is not None:
            values = m.tensor.detach() if split else m.tensor.detach().reshape(shape)
            yield LocalTensor(name, values, shape, m.start, spec, mine)
        elif not (mixed and split):
            yield LocalTensor(name, p.detach(), shape, 0, spec, once)
        if key is None:
            continue
        for state_name, value in view.inner.state.get(key, {}).items():
            if not isinstance(value, torch.Tensor):
                continue
            if list(value.shape) == list(key.shape) and value.ndim > 0:  # shaped like its parameter
                values = value.detach() if split else value.detach().reshape(shape)
                yield LocalTensor(optimizer_key(name, state_name), values, shape, m.start if split else 0, spec, mine)
            else:  # a scalar (Adam's step): one writer, the rank holding the parameter's first element
                writes = placement.writes_scalar(name, held, holds_first=not split or m.start == 0)
                yield LocalTensor(optimizer_key(name, state_name), value.detach(), list(value.shape), 0, None, writes)


def _row_entries(name: str, p: torch.Tensor, rows: tuple[int, int], placement: ShardPlacement,
                 state: dict) -> Iterator[LocalTensor]:
    """A dp_shard parameter (float32: it is the master) and its state, as this rank's flat range of
    its local tensor, written where the placement says (``Held.ROWS``) and this rank holds rows."""
    spec, shape = placement.spec(name), list(p.shape)
    first, count = rows
    start = first * math.prod(shape[1:])
    mine = placement.writes(name, Held.ROWS) and count > 0
    yield LocalTensor(name, local(p.detach()).reshape(-1), shape, start, spec, mine)
    for key, value in state.items():
        if isinstance(value, torch.Tensor) and list(value.shape) == shape and value.ndim > 0:
            yield LocalTensor(optimizer_key(name, key), local(value.detach()).reshape(-1), shape, start, spec, mine)
        elif isinstance(value, torch.Tensor):  # a scalar (Adam's step): the rank holding the first row
            writes = count > 0 and placement.writes_scalar(name, Held.ROWS, holds_first=first == 0)
            yield LocalTensor(optimizer_key(name, key), local(value.detach()), list(value.shape), 0, None, writes)


# Checkpoints a run keeps by default: the newest and two before it, so a save that turns out bad
# (a diverged run) never takes the last good state with it.
DEFAULT_KEEP_LAST = 3

def write_shard(module: nn.Module, placement: ShardPlacement, view: OptimizerView | None, directory: str) -> None:
    """This rank's file and the JSON of its entries (merged into the index by rank 0)."""
    coords = placement.coords
    file = shard_file(coords.pp, coords.tp, placement.replica_rank)
    tensors: dict[str, torch.Tensor] = {}
    entries: dict[str, dict] = {}
    for t in local_entries(module, placement, view):
        if not t.writes:
            continue
        pieces = []
        for i, (box, piece) in enumerate(_pieces(t, placement.shard_rank(t.spec))):
            key = f"{t.name}#{i}" if t.whole else f"{t.name}#dp{placement.replica_rank}.{i}"
            tensors[key] = piece.to("cpu").contiguous()
            pieces.append({"file": file, "key": key, "box": box})
        entries[t.name] = {"shape": global_shape(t.shape, t.spec), "dtype": dtype_name(t.values.dtype),
                           "pieces": pieces}
    groups = optimizer_groups(module, placement, view) if view is not None else None
    written = {}
    if tensors:  # a rank whose every piece another holds (a dp_shard group's replica) writes no empty file
        save_file(tensors, os.path.join(directory, file), metadata={"format": "pt"})
        give_plain_mode(os.path.join(directory, file))  # safetensors creates it owner-only
        fsync_file(os.path.join(directory, file))
        written = {file: file_digest(os.path.join(directory, file))}
    write_json({"tensors": entries, "optimizer": groups, "files": written},
               os.path.join(directory, file.removesuffix(".safetensors") + ".json"))


def _pieces(t: LocalTensor, shard_rank: int) -> list[tuple[list[list[int]], torch.Tensor]]:
    """(global box, its values) for each piece of ``t``: the shard's boxes of a whole tensor, or
    for a flat range, its contiguous runs cut by those boxes."""
    regions = boxes(torch.Size(t.shape), t.spec, shard_rank)
    if t.whole:
        return [(box, t.values if t.spec is None else t.values.narrow(t.spec.dim, at, box[t.spec.dim][1] - box[t.spec.dim][0]))
                for box, at in regions]
    out = []
    for run, offset in flat_runs(t.shape, t.start, t.start + t.values.numel()):
        values = t.values[offset - t.start :][: math.prod(b - a for a, b in run)].reshape([b - a for a, b in run])
        if t.spec is None:
            out.append((run, values))
            continue
        d = t.spec.dim
        for box, at in regions:  # the local rows [at, at + n) along the split dim are the global box's
            n = box[d][1] - box[d][0]
            lo, hi = max(run[d][0], at), min(run[d][1], at + n)
            if lo < hi:
                global_box = [list(r) for r in run]
                global_box[d] = [box[d][0] + lo - at, box[d][0] + hi - at]
                out.append((global_box, values.narrow(d, lo - run[d][0], hi - lo)))
    return out
