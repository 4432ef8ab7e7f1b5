"""Offline conversions between sharded checkpoints and Hugging Face directories, in one process.

Every conversion streams tensor by tensor (peak memory about the largest tensor, not the model): a
Hugging Face directory is read as a checkpoint whose tensors are single whole pieces, each output
tensor or shard piece is read from the overlapping source pieces and written with
``write_streaming``. The layout of a target mesh comes from ``qn_hf.layout`` (the same policy and
stage cut that ``parallelize`` applies), so no GPU and no process group are involved.
"""

from __future__ import annotations

import os
import shutil

import torch
from tqdm import tqdm

from ..layout import Layout, Place, model_layout
from ..version import __version__
from .files import FileChecks, file_digest, publish, write_json
from .format import (DTYPES, INDEX, OPTIMIZER, boxes, checkpoint_dir, entry_nbytes, new_index, optimizer_key,
                     optimizer_prefix, read_index, shard_file, state_spec, tp_writes)
from .hf import (HF_WEIGHTS, DEFAULT_MAX_SHARD_BYTES, base_prefixes, config_from_dict, finish_weights,
                 numbered_weights_file, read_generation_config, read_hf_dir, source_name, split_by_size, write_configs)
from .names import next_checkpoint_dir
from .pieces import read_box
from .stream import write_streaming


def _work(src: dict, layout: Layout, prefixes: list[str]) -> list[tuple[str, str, Place]]:
    """(name to write, name in the source, where it goes) for every tensor and optimizer state."""
    work = []
    for name, place in layout.tensors.items():
        source = source_name(src, name, prefixes)
        work.append((name, source, place))
        for key in sorted(k for k in src["tensors"] if k.startswith(optimizer_prefix(source))):
            shape = tuple(src["tensors"][key]["shape"])
            spec = state_spec(shape, place.shape, place.spec)
            work.append((optimizer_key(name, key.rsplit("/", 1)[1]), key,
                         place if spec is not None else Place(stage=place.stage, spec=None, shape=shape)))
    return work


def write_checkpoint(src_dir: str, src: dict, layout: Layout, config: dict, out: str, *,
                     step: int | None = None, optimizer: list[dict] | None = None,
                     generation_config: dict | None = None) -> str:
    """Write ``src`` (an index over ``src_dir``) as a checkpoint of ``layout`` under ``out``."""
    os.makedirs(out, exist_ok=True)
    final = next_checkpoint_dir(out, step=step)
    partial = final + ".partial"
    shutil.rmtree(partial, ignore_errors=True)
    os.makedirs(partial)
    entries: dict[str, dict] = {}
    digests: dict[str, dict[str, int]] = {}
    src_checks = FileChecks(src_dir, src.get("files"))  # an HF source has no digests: nothing to check
    work = _work(src, layout, base_prefixes(config))
    with tqdm(total=len(work) * layout.tp, desc=f"writing tp={layout.tp} pp={layout.pp}", unit="tensor",
              disable=None) as bar:
        for stage in range(layout.pp):
            for tp_rank in range(layout.tp):
                file = shard_file(stage, tp_rank)
                plan = []
                for name, source, place in work:
                    bar.update(1)
                    if place.stage != stage or not tp_writes(place.spec, tp_rank):
                        continue
                    entry = src["tensors"][source]
                    pieces = []
                    for i, (box, _) in enumerate(boxes(torch.Size(place.shape), place.spec, tp_rank)):
                        key = f"{name}#{i}"
                        plan.append((key, [b - a for a, b in box], DTYPES[entry["dtype"]], source, box))
                        pieces.append({"file": file, "key": key, "box": box})
                    into = entries.setdefault(name, {"shape": list(place.shape), "dtype": entry["dtype"], "pieces": []})
                    into["pieces"] += pieces  # each tp rank adds its pieces
                by_key = {key: (source, box, shape, dtype) for key, shape, dtype, source, box in plan}

                def produce(key: str) -> torch.Tensor:
                    source, box, shape, dtype = by_key[key]
                    buf = torch.empty(shape, dtype=dtype)
                    # Files stay open for one tensor only: a mapping kept open would count every
                    # page read so far as resident memory.
                    read_box(src_dir, src["tensors"][source], source, box, buf, handles={}, checks=src_checks)
                    return buf

                write_streaming(os.path.join(partial, file), [(k, s, d) for k, s, d, _, _ in plan], produce)
                digests[file] = file_digest(os.path.join(partial, file))
    virtual = {"virtual_stages": layout.virtual_stages} if layout.virtual_stages > 1 else {}
    index = new_index(library_version=__version__, step=step, mesh={"dp": 1, "tp": layout.tp, "pp": layout.pp, **virtual},
                      config=config, tensors=entries, optimizer=optimizer, files=digests,
                      generation_config=generation_config)
    write_json(index, os.path.join(partial, INDEX))
    read_index(partial)  # what we wrote must pass our own validation
    publish(partial, final)
    return final


def from_hf(hf_dir: str, out: str, *, tp: int, pp: int, virtual_stages: int = 1) -> str:
    """A checkpoint laid out as a run at (tp, pp) with ``virtual_stages`` chunks per rank saves one
    (each rank's file holds its chunks' tensors); any run loads it, by name."""
    src, config = read_hf_dir(hf_dir)
    layout = model_layout(config_from_dict(config), tp=tp, pp=pp, virtual_stages=virtual_stages)
    # a Hugging Face model is where training starts: step 0
    return write_checkpoint(hf_dir, src, layout, config, out, step=0, generation_config=read_generation_config(hf_dir))


def reshard(ckpt: str, out: str, *, tp: int, pp: int, virtual_stages: int = 1) -> str:
    directory = checkpoint_dir(ckpt)
    index = read_index(directory)
    layout = model_layout(config_from_dict(index["config"]), tp=tp, pp=pp, virtual_stages=virtual_stages)
    return write_checkpoint(directory, index, layout, index["config"], out, step=index.get("step"),
                            optimizer=index.get("optimizer"), generation_config=index.get("generation_config"))


def to_hf(ckpt: str, out: str, *, max_shard_bytes: int = DEFAULT_MAX_SHARD_BYTES) -> None:
    directory = checkpoint_dir(ckpt)
    index = read_index(directory)
    checks = FileChecks(directory, index.get("files"))
    names = [n for n in index["tensors"] if not n.startswith(OPTIMIZER)]
    groups = split_by_size([(n, entry_nbytes(index["tensors"][n])) for n in names], max_shard_bytes)
    os.makedirs(out, exist_ok=True)
    write_configs(out, config_from_dict(index["config"]), index.get("generation_config"))
    files = []
    with tqdm(total=len(names), desc="to-hf", unit="tensor", disable=None) as bar:
        for i, group in enumerate(groups):
            file = HF_WEIGHTS if len(groups) == 1 else numbered_weights_file(i, len(groups))

            def produce(name: str) -> torch.Tensor:
                entry = index["tensors"][name]
                buf = torch.empty(entry["shape"], dtype=DTYPES[entry["dtype"]])
                read_box(directory, entry, name, [[0, n] for n in entry["shape"]], buf, handles={}, checks=checks)
                bar.update(1)
                return buf

            write_streaming(os.path.join(out, file),
                            [(n, index["tensors"][n]["shape"], DTYPES[index["tensors"][n]["dtype"]]) for n in group], produce)
            files.append(file)
    finish_weights(out, files)
