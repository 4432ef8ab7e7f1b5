"""Consolidating a ParallelModel into a Hugging Face directory.

Only dp rank 0's ranks gather (dp replicas are identical). Within a pipeline stage the tp ranks
gather each tensor in turn and the stage's tp rank 0 streams it into the stage's files; a single
file is ``model.safetensors``, several are ``model-pp<stage>-<k>.safetensors`` plus the
``model.safetensors.index.json`` HF reads, written by rank 0 from the files' headers. Every file is
written beside its final name and renamed into place, so a crash never leaves a half-written file.
A weight tied across stages is saved once, under the first stage's name, as HF saves it.
"""

from __future__ import annotations

import json
import os
import re
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist
from safetensors import safe_open

from .checkpoint import _global_shape, entry_nbytes
from .atomic import write_text_atomic
from .hf_source import SAFETENSORS_DTYPES
from .comm import all_gather_tensors, barrier
from .safetensors_stream import write_streaming

if TYPE_CHECKING:
    from .parallel_model import ParallelModel

INDEX = "model.safetensors.index.json"
DEFAULT_MAX_SHARD_BYTES = 5 * 1024**3


def unique_state(module: torch.nn.Module) -> dict[str, torch.Tensor]:
    """The state dict with tied tensors kept once, under their first name (as HF saves them)."""
    seen: set[int] = set()
    out: dict[str, torch.Tensor] = {}
    for name, tensor in module.state_dict(keep_vars=True).items():
        if id(tensor) not in seen:
            seen.add(id(tensor))
            out[name] = tensor
    return out


def _files(stage: int, stages: int, chunks: int) -> list[str]:
    if stages == 1 and chunks == 1:
        return ["model.safetensors"]
    return [f"model-pp{stage:03d}-{k + 1:05d}.safetensors" for k in range(chunks)]


def _chunks(sizes: list[tuple[str, int]], max_bytes: int) -> list[list[str]]:
    chunks: list[list[str]] = [[]]
    total = 0
    for name, nbytes in sizes:
        if chunks[-1] and total + nbytes > max_bytes:
            chunks.append([])
            total = 0
        chunks[-1].append(name)
        total += nbytes
    return chunks


def save_pretrained(pm: ParallelModel, path: str, *, max_shard_bytes: int = DEFAULT_MAX_SHARD_BYTES) -> None:
    """Stream the model into HF files: within each stage the tp ranks gather one tensor at a time
    and the stage's writer writes it straight to disk, so no rank holds more than one full tensor
    beyond its shard. Files hold at most ``max_shard_bytes``; several files get an index."""
    stages = pm.dims.pp
    followers = {tie.follower for tie in pm.stage_plan.ties}
    written: list[str] = []
    if pm.coords["dp"] == 0:
        state = {n: t.detach() for n, t in unique_state(pm.module).items() if n not in followers}
        specs = {n: pm.specs.get(n) for n in state}
        shapes = {n: _global_shape(t, specs[n]) for n, t in state.items()}
        sizes = [(n, torch.Size(shapes[n]).numel() * t.element_size()) for n, t in state.items()]
        chunks = _chunks(sizes, max_shard_bytes)
        files = _files(pm.coords["pp"], stages, len(chunks))

        def produce(name: str) -> torch.Tensor:
            value, spec = state[name], specs[name]
            return value if spec is None else spec.unshard(all_gather_tensors(value, group=pm.groups.tp))

        for file, names in zip(files, chunks):
            if pm.coords["tp"] == 0:
                os.makedirs(path, exist_ok=True)
                write_streaming(os.path.join(path, file), [(n, shapes[n], state[n].dtype) for n in names], produce)
                written.append(file)
            else:  # the writer gathers in this order; take part in each gather
                for n in names:
                    if specs[n] is not None:
                        produce(n)
    every = [None] * dist.get_world_size()
    dist.all_gather_object(every, written)
    if dist.get_rank() == 0:
        files = sorted(f for w in every for f in w)
        _write_config(pm.module, pm.config, path)
        if files != ["model.safetensors"]:
            _write_index(path, files)
        _remove_stale_weights(path, keep=set(files) | ({INDEX} if files != ["model.safetensors"] else set()))
    barrier(pm.device)


def _remove_stale_weights(path: str, *, keep: set[str]) -> None:
    """Drop weight files an earlier save with another layout left behind: from_pretrained prefers
    ``model.safetensors`` over an index, so a stale one would silently win."""
    for name in os.listdir(path):
        stale = name in ("model.safetensors", INDEX) or re.fullmatch(r"model-(\d{5}-of-\d{5}|pp\d{3}-\d{5})\.safetensors", name)
        if stale and name not in keep:
            os.unlink(os.path.join(path, name))


def _write_index(path: str, files: list[str]) -> None:
    weight_map: dict[str, str] = {}
    total = 0
    for name in files:
        with safe_open(os.path.join(path, name), framework="pt") as f:
            for key in f.keys():
                weight_map[key] = name
                sl = f.get_slice(key)
                total += entry_nbytes({"shape": list(sl.get_shape()), "dtype": SAFETENSORS_DTYPES[sl.get_dtype()]})
    index = {"metadata": {"total_size": total}, "weight_map": dict(sorted(weight_map.items()))}
    write_text_atomic(os.path.join(path, INDEX), json.dumps(index, indent=2))


def _write_config(module: torch.nn.Module, config, path: str) -> None:
    config.save_pretrained(path)
    generation_config = getattr(module, "generation_config", None)
    if generation_config is not None and getattr(module, "can_generate", lambda: False)():
        generation_config.save_pretrained(path)
