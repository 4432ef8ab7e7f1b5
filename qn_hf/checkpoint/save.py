"""Saving a sharded checkpoint from every rank of the mesh.

Each distinct shard is written once: by dp rank 0, by the first of KV-head replicas, by tp rank 0
for a tensor replicated over tp, by the first stage for a weight tied across stages. Every writing
rank writes its own safetensors file and a small JSON of its entries; rank 0 merges those into the
index. The directory is written as ``ckpt-N.partial`` and published only when whole.
"""

from __future__ import annotations

import json
import os
import shutil

import torch
import torch.distributed as dist
from safetensors.torch import save_file
from torch import nn

from ..arguments import check_non_negative_int
from ..atomic import give_plain_mode
from ..comm import barrier
from ..placement import ShardPlacement
from ..version import __version__
from .files import file_digest, fsync_file, publish, write_json
from .format import (INDEX, boxes, dtype_name, global_shape, new_index, optimizer_key, shard_file, state_spec,
                     tp_writes)
from .hf import generation_config_of
from .names import checkpoint_name, next_checkpoint_dir, parse_name


def save_checkpoint(module: nn.Module, path: str, *, placement: ShardPlacement, config,
                    optimizer: torch.optim.Optimizer | None = None, step: int | None = None) -> str:
    """Write a checkpoint of ``module``'s shard on every rank (and ``optimizer``'s state) under
    ``path``; return its directory. ``config`` is the whole model's config."""
    if step is not None:
        check_non_negative_int("step", step, what="the training step the checkpoint holds")
    chosen = torch.zeros(2, dtype=torch.int64, device=placement.device)
    if dist.get_rank() == 0:
        os.makedirs(path, exist_ok=True)
        chosen[0], chosen[1] = parse_name(os.path.basename(next_checkpoint_dir(path, step=step)))
    dist.broadcast(chosen, src=0)  # every rank writes into the directory rank 0 chose
    final = os.path.join(path, checkpoint_name(int(chosen[0]), int(chosen[1])))
    partial = final + ".partial"
    if dist.get_rank() == 0:
        shutil.rmtree(partial, ignore_errors=True)
        os.makedirs(partial)
    barrier(placement.device)

    if placement.coords["dp"] == 0:
        write_shard(module, placement, optimizer, partial)
    barrier(placement.device)
    if dist.get_rank() == 0:
        dims = placement.dims
        index = new_index(library_version=__version__, step=step, mesh={"dp": dims.dp, "tp": dims.tp, "pp": dims.pp},
                          config=config.to_dict(), tensors={}, optimizer=None, files={},
                          generation_config=generation_config_of(module))
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
        write_json(index, os.path.join(partial, INDEX))
        publish(partial, final)
    barrier(placement.device)
    return final


def local_entries(module: nn.Module, placement: ShardPlacement, optimizer: torch.optim.Optimizer | None):
    """(saved name, local tensor, spec, whether this tp rank writes it) for every tensor here."""
    tp_rank = placement.coords["tp"]
    for name, p in module.named_parameters():
        if placement.is_follower(name):
            continue
        spec = placement.spec(name)
        yield name, p.detach(), spec, tp_writes(spec, tp_rank)
        state = optimizer.state.get(p, {}) if optimizer is not None else {}
        for key, value in state.items():
            if isinstance(value, torch.Tensor):
                own = state_spec(value.shape, p.shape, spec)
                yield optimizer_key(name, key), value.detach(), own, tp_writes(own, tp_rank)


def _merge_groups(merged: list[dict] | None, groups: list[dict]) -> list[dict]:
    if merged is None:
        return groups
    for into, extra in zip(merged, groups):
        into["params"] = sorted(set(into["params"]) | set(extra["params"]))
    return merged


def optimizer_groups(module: nn.Module, placement: ShardPlacement, optimizer: torch.optim.Optimizer) -> list[dict]:
    """Each parameter group's hyperparameters and the saved names of its parameters here."""
    names = {id(p): n for n, p in module.named_parameters()}
    groups = []
    for group in optimizer.param_groups:
        hyper = {k: v for k, v in group.items() if k != "params" and isinstance(v, (int, float, bool, str, type(None), list, tuple))}
        groups.append({**hyper, "params": sorted(names[id(p)] for p in group["params"]
                                                 if not placement.is_follower(names.get(id(p))))})
    return groups


def write_shard(module: nn.Module, placement: ShardPlacement, optimizer: torch.optim.Optimizer | None,
                directory: str) -> None:
    """This rank's file and the JSON of its entries (merged into the index by rank 0)."""
    file = shard_file(placement.coords["pp"], placement.coords["tp"])
    tensors: dict[str, torch.Tensor] = {}
    entries: dict[str, dict] = {}
    for name, value, spec, writes in local_entries(module, placement, optimizer):
        if not writes:
            continue
        pieces = []
        for i, (box, at) in enumerate(boxes(value.shape, spec, placement.coords["tp"])):
            local = value if spec is None else value.narrow(spec.dim, at, box[spec.dim][1] - box[spec.dim][0])
            key = f"{name}#{i}"
            tensors[key] = local.to("cpu").contiguous()
            pieces.append({"file": file, "key": key, "box": box})
        entries[name] = {"shape": global_shape(value.shape, spec), "dtype": dtype_name(value.dtype), "pieces": pieces}
    groups = optimizer_groups(module, placement, optimizer) if optimizer is not None else None
    save_file(tensors, os.path.join(directory, file), metadata={"format": "pt"})
    give_plain_mode(os.path.join(directory, file))  # safetensors creates it owner-only
    fsync_file(os.path.join(directory, file))
    written = {file: file_digest(os.path.join(directory, file))}
    write_json({"tensors": entries, "optimizer": groups, "files": written},
               os.path.join(directory, file.removesuffix(".safetensors") + ".json"))
