"""Writing Hugging Face directories: consolidating the sharded model from every rank of the mesh
(``save_pretrained``), and the staged publication that it and ``qn-hf-convert to-hf`` share.

Only dp rank 0's ranks gather (dp replicas are identical), with, under expert parallelism, the
other ranks of their ep groups for the experts. Within a pipeline stage the tp ranks
gather each tensor in turn and the stage's tp rank 0 streams it into the stage's files; a single
file is ``model.safetensors``, several are ``model-pp<stage>-<k>.safetensors`` plus the
``model.safetensors.index.json`` HF reads, written by rank 0 from the files' headers. A weight tied
across stages is saved once, under the first stage's name, as HF saves it.

Every file is written into a staging directory made inside the output directory, and moved into
place only once all are whole (``finish_export``): a failed export leaves the directory as it was,
and nothing is written through a link left in it.
"""

from __future__ import annotations

import json
import os
import re

import torch
import torch.distributed as dist
import transformers
from safetensors import safe_open
from torch import nn
from transformers import GenerationConfig

from ..comm import barrier
from ..data_parallel.sharded import gathered_state
from ..placement import ShardPlacement
from ..tensor_parallel.shard import over_experts
from .atomic import fresh_dir, write_text_atomic
from .files import fsync_dir, fsync_file
from .format import dtype_of_code, entry_nbytes, global_shape
from .hf import HF_CONFIG, HF_INDEX, HF_WEIGHTS, generation_config_of, hf_class_name, with_architecture
from .stream import write_streaming

STAGING = ".qn_hf-export.partial"  # inside the output directory: the final renames stay on one filesystem
# Weight files of several-file layouts: ours per pipeline stage, and transformers' own numbering.
_SHARDED_WEIGHTS = re.compile(r"model-(\d{5}-of-\d{5}|pp\d{3}-\d{5})\.safetensors")


def stage_weights_file(stage: int, part: int) -> str:
    """The ``part``-th (0-based) file of a pipeline stage's weights in a several-file export."""
    return f"model-pp{stage:03d}-{part + 1:05d}.safetensors"


def numbered_weights_file(part: int, parts: int) -> str:
    return f"model-{part + 1:05d}-of-{parts:05d}.safetensors"


def split_by_size(sizes: list[tuple[str, int]], max_bytes: int) -> list[list[str]]:
    """Names in order, grouped into files of at most ``max_bytes`` (a larger tensor gets its own)."""
    chunks: list[list[str]] = [[]]
    total = 0
    for name, nbytes in sizes:
        if chunks[-1] and total + nbytes > max_bytes:
            chunks.append([])
            total = 0
        chunks[-1].append(name)
        total += nbytes
    return chunks


def write_configs(path: str, config: transformers.PretrainedConfig, generation_config: dict | None) -> None:
    """``config.json`` (and ``generation_config.json``) as ``save_pretrained`` writes them; ``path`` is
    a staging directory made for them, so transformers' plain ``open`` finds nothing to follow."""
    config.save_pretrained(path)
    if generation_config is not None:
        GenerationConfig.from_dict(generation_config).save_pretrained(path)


def write_index(path: str, files: list[str]) -> None:
    """``model.safetensors.index.json`` for weight files already written, from their headers."""
    weight_map: dict[str, str] = {}
    total = 0
    for name in files:
        with safe_open(os.path.join(path, name), framework="pt") as f:
            for key in f.keys():
                weight_map[key] = name
                sl = f.get_slice(key)
                total += entry_nbytes({"shape": list(sl.get_shape()), "dtype": dtype_of_code(sl.get_dtype())})
    index = {"metadata": {"total_size": total}, "weight_map": dict(sorted(weight_map.items()))}
    write_text_atomic(os.path.join(path, HF_INDEX), json.dumps(index, indent=2))


def begin_export(path: str) -> str:
    """A new, empty staging directory inside ``path`` (made if needed); an earlier failed export's is
    removed."""
    os.makedirs(path, exist_ok=True)
    staging = os.path.join(path, STAGING)
    fresh_dir(staging)
    return staging


def _unlink(path: str) -> None:
    try:
        os.unlink(path)  # a link itself, never its target; a directory by that name is refused
    except FileNotFoundError:
        pass


def finish_export(staging: str, path: str, *, config: transformers.PretrainedConfig, generation_config: dict | None,
                  files: list[str]) -> None:
    """Write the configs (and for several weight files their index) into ``staging``, then move
    everything into ``path``. The old ``config.json`` goes first and the new one last: while files
    are replaced ``path`` has no config, so ``from_pretrained`` fails there rather than load a config
    beside weights of another model. Stale weight files of an earlier layout are removed:
    ``from_pretrained`` prefers ``model.safetensors`` over an index, so a stale one would win."""
    if files != [HF_WEIGHTS]:
        write_index(staging, files)
    write_configs(staging, config, generation_config)
    staged = sorted(os.listdir(staging))
    for name in staged:
        fsync_file(os.path.join(staging, name))
    _unlink(os.path.join(path, HF_CONFIG))
    fsync_dir(path)
    for name in staged:
        if name != HF_CONFIG:
            os.replace(os.path.join(staging, name), os.path.join(path, name))
    for name in os.listdir(path):
        if (name in (HF_WEIGHTS, HF_INDEX) or _SHARDED_WEIGHTS.fullmatch(name)) and name not in staged:
            _unlink(os.path.join(path, name))
    os.replace(os.path.join(staging, HF_CONFIG), os.path.join(path, HF_CONFIG))
    fsync_dir(path)
    os.rmdir(staging)


def unique_state(module: nn.Module) -> dict[str, torch.Tensor]:
    """The state dict with tied tensors kept once, under their first name (as HF saves them), each
    whole over dp_shard (collective over those ranks)."""
    seen: set[int] = set()
    out: dict[str, torch.Tensor] = {}
    for name, tensor in gathered_state(module.state_dict(keep_vars=True)).items():
        if id(tensor) not in seen:
            seen.add(id(tensor))
            out[name] = tensor
    return out


def save_pretrained(module: nn.Module, path: str, *, placement: ShardPlacement, config, max_shard_bytes: int) -> None:
    """Stream the model into HF files: within each stage the tp ranks gather one tensor at a time
    and the stage's writer writes it straight to disk, so no rank holds more than one full tensor
    beyond its shard. Files hold at most ``max_shard_bytes``; several files get an index."""
    coords = placement.coords
    staging = os.path.join(path, STAGING)
    if dist.get_rank() == 0:
        begin_export(path)
    barrier(placement.device)  # the writers write into the staging directory rank 0 made
    written: list[str] = []
    state = {n: t.detach() for n, t in unique_state(module).items() if not placement.is_follower(n)}
    specs = {n: placement.spec(n) for n in state}
    shapes = {n: global_shape(t.shape, specs[n]) for n, t in state.items()}
    sizes = [(n, torch.Size(shapes[n]).numel() * t.element_size()) for n, t in state.items()]
    chunks = split_by_size(sizes, max_shard_bytes)
    if placement.dims.pp == 1 and len(chunks) == 1:
        files = [HF_WEIGHTS]
    else:
        files = [stage_weights_file(coords.pp, k) for k in range(len(chunks))]

    def produce(name: str) -> torch.Tensor:
        return placement.whole(name, state[name])

    if placement.replica_rank == 0:
        for file, names in zip(files, chunks):
            if coords.tp == 0:
                write_streaming(os.path.join(staging, file), [(n, shapes[n], state[n].dtype) for n in names],
                                lambda n: [produce(n)])
                written.append(file)
            else:  # the writer gathers in this order; take part in each gather
                for n in names:
                    if specs[n] is not None:
                        produce(n)
    elif coords.expert_replica == 0:  # other dp ranks sharing out the writers' experts (ep > tp)
        for n in (n for names in chunks for n in names):
            if over_experts(specs[n]):
                produce(n)
    every = [None] * dist.get_world_size()
    dist.all_gather_object(every, written)
    if dist.get_rank() == 0:
        finish_export(staging, path, config=with_architecture(config, hf_class_name(module)),
                      generation_config=generation_config_of(module), files=sorted(f for w in every for f in w))
    barrier(placement.device)
