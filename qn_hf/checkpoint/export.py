"""Consolidating the sharded model into a Hugging Face directory, from every rank of the mesh.

Only dp rank 0's ranks gather (dp replicas are identical), with, under expert parallelism, the
other ranks of their ep groups for the experts. Within a pipeline stage the tp ranks
gather each tensor in turn and the stage's tp rank 0 streams it into the stage's files; a single
file is ``model.safetensors``, several are ``model-pp<stage>-<k>.safetensors`` plus the
``model.safetensors.index.json`` HF reads, written by rank 0 from the files' headers. Every file is
written beside its final name and renamed into place, so a crash never leaves a half-written file.
A weight tied across stages is saved once, under the first stage's name, as HF saves it.
"""

from __future__ import annotations

import os

import torch
import torch.distributed as dist
from torch import nn

from ..comm import barrier
from ..placement import ShardPlacement
from ..shard import over_experts
from .format import global_shape
from .hf import HF_WEIGHTS, finish_weights, generation_config_of, split_by_size, stage_weights_file, write_configs
from .stream import write_streaming


def unique_state(module: nn.Module) -> dict[str, torch.Tensor]:
    """The state dict with tied tensors kept once, under their first name (as HF saves them)."""
    seen: set[int] = set()
    out: dict[str, torch.Tensor] = {}
    for name, tensor in module.state_dict(keep_vars=True).items():
        if id(tensor) not in seen:
            seen.add(id(tensor))
            out[name] = tensor
    return out


def save_pretrained(module: nn.Module, path: str, *, placement: ShardPlacement, config, max_shard_bytes: int) -> None:
    """Stream the model into HF files: within each stage the tp ranks gather one tensor at a time
    and the stage's writer writes it straight to disk, so no rank holds more than one full tensor
    beyond its shard. Files hold at most ``max_shard_bytes``; several files get an index."""
    coords = placement.coords
    written: list[str] = []
    state = {n: t.detach() for n, t in unique_state(module).items() if not placement.is_follower(n)}
    specs = {n: placement.spec(n) for n in state}
    shapes = {n: global_shape(t.shape, specs[n]) for n, t in state.items()}
    sizes = [(n, torch.Size(shapes[n]).numel() * t.element_size()) for n, t in state.items()]
    chunks = split_by_size(sizes, max_shard_bytes)
    if placement.dims.pp == 1 and len(chunks) == 1:
        files = [HF_WEIGHTS]
    else:
        files = [stage_weights_file(coords["pp"], k) for k in range(len(chunks))]

    def produce(name: str) -> torch.Tensor:
        return placement.whole(name, state[name])

    if placement.replica_rank == 0:
        for file, names in zip(files, chunks):
            if coords["tp"] == 0:
                os.makedirs(path, exist_ok=True)
                write_streaming(os.path.join(path, file), [(n, shapes[n], state[n].dtype) for n in names], produce)
                written.append(file)
            else:  # the writer gathers in this order; take part in each gather
                for n in names:
                    if specs[n] is not None:
                        produce(n)
    elif coords.get("expert_replica") == 0:  # other dp ranks sharing out the writers' experts (ep > tp)
        for n in (n for names in chunks for n in names):
            if over_experts(specs[n]):
                produce(n)
    every = [None] * dist.get_world_size()
    dist.all_gather_object(every, written)
    if dist.get_rank() == 0:
        write_configs(path, config, generation_config_of(module))
        finish_weights(path, sorted(f for w in every for f in w))
    barrier(placement.device)
