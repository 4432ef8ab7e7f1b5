"""Consolidating a ParallelModel into a Hugging Face directory.

Only dp rank 0's ranks gather (dp replicas are identical). Within a pipeline stage the tp ranks
gather each tensor in turn and the stage's tp rank 0 writes the stage's file; with one stage that is
``model.safetensors``, with several ``model-0000k-of-0000P.safetensors`` plus the
``model.safetensors.index.json`` HF reads, written by rank 0 from the files' headers. Every file is
written beside its final name and renamed into place, so a crash never leaves a half-written file.
A weight tied across stages is saved once, under the first stage's name, as HF saves it.
"""

from __future__ import annotations

import json
import os
import re
import tempfile
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist
from safetensors import safe_open
from safetensors.torch import save_file

from .comm import all_gather_tensors, barrier

if TYPE_CHECKING:
    from .parallel_model import ParallelModel

INDEX = "model.safetensors.index.json"


def unique_state(module: torch.nn.Module) -> dict[str, torch.Tensor]:
    """The state dict with tied tensors kept once, under their first name (as HF saves them)."""
    seen: set[int] = set()
    out: dict[str, torch.Tensor] = {}
    for name, tensor in module.state_dict(keep_vars=True).items():
        if id(tensor) not in seen:
            seen.add(id(tensor))
            out[name] = tensor
    return out


def stage_file(stage: int, stages: int) -> str:
    return "model.safetensors" if stages == 1 else f"model-{stage + 1:05d}-of-{stages:05d}.safetensors"


def save_pretrained(pm: ParallelModel, path: str) -> None:
    stages = pm.dims.pp
    followers = {tie.follower for tie in pm.stage_plan.ties}
    if pm.coords["dp"] == 0:
        full: dict[str, torch.Tensor] = {}
        for name, tensor in unique_state(pm.module).items():
            if name in followers:
                continue
            spec = pm.specs.get(name)
            value = tensor.detach()
            if spec is not None:
                value = spec.unshard(all_gather_tensors(value, group=pm.groups.tp))
            if pm.coords["tp"] == 0:
                full[name] = value.to("cpu").contiguous()
        if pm.coords["tp"] == 0:
            os.makedirs(path, exist_ok=True)
            _atomic_save(full, os.path.join(path, stage_file(pm.coords["pp"], stages)))
    barrier(pm.device)
    if dist.get_rank() == 0:
        _write_config(pm.module, path)
        if stages > 1:
            _write_index(path, stages)
        _remove_stale_weights(path, keep={stage_file(s, stages) for s in range(stages)} | ({INDEX} if stages > 1 else set()))
    barrier(pm.device)


def _remove_stale_weights(path: str, *, keep: set[str]) -> None:
    """Drop weight files an earlier save with another layout left behind: from_pretrained prefers
    ``model.safetensors`` over an index, so a stale one would silently win."""
    for name in os.listdir(path):
        stale = name == "model.safetensors" or name == INDEX or re.fullmatch(r"model-\d{5}-of-\d{5}\.safetensors", name)
        if stale and name not in keep:
            os.unlink(os.path.join(path, name))


def _atomic_save(tensors: dict[str, torch.Tensor], target: str) -> None:
    fd, tmp = tempfile.mkstemp(dir=os.path.dirname(target), prefix="." + os.path.basename(target) + ".")
    os.close(fd)
    try:
        save_file(tensors, tmp, metadata={"format": "pt"})
        with open(tmp, "rb") as f:
            os.fsync(f.fileno())
        os.replace(tmp, target)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)


def _write_index(path: str, stages: int) -> None:
    weight_map: dict[str, str] = {}
    total = 0
    for stage in range(stages):
        name = stage_file(stage, stages)
        with safe_open(os.path.join(path, name), framework="pt") as f:
            for key in f.keys():
                weight_map[key] = name
                sl = f.get_slice(key)
                numel = 1
                for d in sl.get_shape():
                    numel *= d
                total += numel * _itemsize(sl.get_dtype())
    index = {"metadata": {"total_size": total}, "weight_map": dict(sorted(weight_map.items()))}
    fd, tmp = tempfile.mkstemp(dir=path, prefix="." + INDEX + ".")
    with os.fdopen(fd, "w") as f:
        json.dump(index, f, indent=2)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, os.path.join(path, INDEX))


def _itemsize(safetensors_dtype: str) -> int:
    return {"F64": 8, "I64": 8, "F32": 4, "I32": 4, "BF16": 2, "F16": 2, "I16": 2, "I8": 1, "U8": 1, "BOOL": 1}[safetensors_dtype]


def _write_config(module: torch.nn.Module, path: str) -> None:
    module.config.save_pretrained(path)
    generation_config = getattr(module, "generation_config", None)
    if generation_config is not None and getattr(module, "can_generate", lambda: False)():
        generation_config.save_pretrained(path)
