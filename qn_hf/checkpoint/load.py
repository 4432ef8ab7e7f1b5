"""Loading a checkpoint saved at any mesh, or a Hugging Face directory, into this rank's shard.

Each rank computes the box its local shard covers (from its ``ShardSpec`` at the current mesh) and
reads only the overlapping parts of the saved pieces, so tp, pp and dp may all change. Everything is
read and checked before anything is copied, and the outcome is agreed over the whole job.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn

from ..placement import ShardPlacement
from .files import FileChecks
from .format import DTYPES, CheckpointError, checkpoint_dir, global_shape, optimizer_prefix, read_index, state_spec
from .hf import base_prefixes, is_hf_dir, read_hf_dir, source_name
from .pieces import read_local


def load_checkpoint(module: nn.Module, path: str, *, placement: ShardPlacement, model_type: str,
                    optimizer: torch.optim.Optimizer | None = None) -> dict:
    """Load ``path`` into ``module``'s shard (and ``optimizer``); return the saved metadata.

    If any rank finds a problem, every rank raises the same ``CheckpointError`` (naming the rank,
    file and tensor) and nothing in the model or optimizer has changed."""
    error, loaded = None, None
    try:
        loaded = _read_all(module, path, placement, model_type, optimizer)
    except CheckpointError as e:
        error = str(e)
    errors = [None] * dist.get_world_size()
    dist.all_gather_object(errors, error)
    failed = [(r, e) for r, e in enumerate(errors) if e is not None]
    if failed:
        rank, message = failed[0]
        raise CheckpointError(f"rank {rank}: {message}" + (f" (and {len(failed) - 1} more ranks failed)" if len(failed) > 1 else ""))
    index, tensors, states = loaded
    params = dict(module.named_parameters())
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


def _read_all(module: nn.Module, path: str, placement: ShardPlacement, model_type: str,
              optimizer: torch.optim.Optimizer | None):
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
    if saved_type != model_type:
        raise CheckpointError(f"{directory} holds a {saved_type!r} model, this one is {model_type!r}")
    tp_rank = placement.coords["tp"]
    params = dict(module.named_parameters())
    prefixes = base_prefixes(config)
    tensors = {}
    for name, p in params.items():
        try:
            saved = source_name(index, placement.owner(name), prefixes)
        except CheckpointError as e:
            raise CheckpointError(f"{directory}: {e}") from None
        tensors[name] = read_local(directory, index, saved, p, placement.spec(name), tp_rank, checks=checks)
    states: dict[nn.Parameter, dict[str, torch.Tensor]] = {}
    if optimizer is not None:
        _check_optimizer(directory, index, optimizer, params, placement)
        names = {id(p): n for n, p in params.items()}
        for group in optimizer.param_groups:
            for p in group["params"]:
                name = names[id(p)]
                prefix = optimizer_prefix(placement.owner(name))
                spec = placement.spec(name)
                state = {}
                for key in (k for k in index["tensors"] if k.startswith(prefix)):
                    entry = index["tensors"][key]
                    like = torch.empty(0, dtype=DTYPES[entry["dtype"]])
                    param_shape = global_shape(p.shape, spec)
                    own = state_spec(entry["shape"], param_shape, spec)
                    shape = list(p.shape) if entry["shape"] == param_shape else entry["shape"]
                    state[key[len(prefix):]] = read_local(directory, index, key, like, own, tp_rank, shape=shape,
                                                          checks=checks)
                if state:
                    states[p] = state
    return index, tensors, states


def _check_optimizer(directory: str, index: dict, optimizer: torch.optim.Optimizer, params: dict[str, nn.Parameter],
                     placement: ShardPlacement) -> None:
    saved = index.get("optimizer")
    if not isinstance(saved, list):
        raise CheckpointError(f"{directory} has no optimizer state; load without optimizer= or save with it")
    if len(saved) != len(optimizer.param_groups):
        raise CheckpointError(f"{directory}: the optimizer had {len(saved)} parameter groups, this one has "
                              f"{len(optimizer.param_groups)}")
    names = {id(p): n for n, p in params.items()}
    for i, (group, saved_group) in enumerate(zip(optimizer.param_groups, saved)):
        for p in group["params"]:
            name = names.get(id(p))
            saved_name = placement.owner(name) if name is not None else None
            if saved_name is None or saved_name not in saved_group.get("params", []):
                raise CheckpointError(f"{directory}: parameter {names.get(id(p), '?')} is in optimizer group {i} "
                                      f"here but not in the saved group {i}")
