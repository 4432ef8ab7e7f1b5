"""Offline conversions between sharded checkpoints and Hugging Face directories, in one process.

Every conversion streams (peak memory a bounded chunk of one tensor, not the model): a Hugging Face
directory is read as a checkpoint whose tensors are single whole pieces, each output tensor or shard
piece is read in chunks from the overlapping source pieces and written with ``write_streaming``. The
layout of a target mesh comes from ``qn_hf.checkpoint.layout`` (the same policy and stage cut that
``parallelize`` applies), so no GPU and no process group are involved.

A conversion keeps every tensor it reads, at the shape the config gives it, or refuses: the model
class is the one the source records (``architectures``), else the one class of its model type whose
tensors are exactly the source's; only ``to-hf`` leaves something out, the optimizer state, and says so.
"""

from __future__ import annotations

import os

import torch
from safetensors import safe_open
from tqdm import tqdm

from ..version import __version__
from .atomic import fresh_dir, remove_entry
from .classes import model_class
from .dcp.directory import dcp_sources, read_header, read_source, tied_aliases
from .dcp.index import BY_PARAM
from .dcp.write import point_root, write_whole_dcp
from .errors import CheckpointFormat
from .export import STAGING, begin_export, finish_export, numbered_weights_file, split_by_size
from .files import PARTIAL, FileChecks, file_digest, publish
from .format import (
    DTYPES,
    INDEX,
    OPTIMIZER,
    CheckpointError,
    boxes,
    entry_nbytes,
    new_index,
    optimizer_key,
    read_index,
    shard_file,
    state_spec,
    tp_writes,
)
from .hf import (
    DEFAULT_MAX_SHARD_BYTES,
    HF_WEIGHTS,
    base_prefixes,
    config_from_dict,
    hf_tensors,
    key_renamer,
    read_generation_config,
    read_headers,
    read_hf_config,
    read_hf_dir,
    source_name,
    weight_files,
    with_architecture,
)
from .layout import Layout, Place, layout_class, meta_model, model_layout
from .lock import hold_directory
from .names import next_checkpoint_dir
from .optimizer_state import STATELESS
from .pieces import read_box, read_chunks
from .seal import write_index
from .stream import write_streaming


def _work(src: dict, layout: Layout, prefixes: list[str], *, where: str,
          optimizer: bool) -> list[tuple[str, str, Place]]:
    """(name to write, name in the source, where it goes) for every tensor and (with ``optimizer``) its
    optimizer state. Every source tensor must be used, at the shape the config gives it."""
    work, used = [], set()
    states: dict[str, list[str]] = {}  # the optimizer state saved for each tensor, found in one pass
    for key in sorted(k for k in src["tensors"] if k.startswith(OPTIMIZER)):
        states.setdefault(key[len(OPTIMIZER):].rpartition("/")[0], []).append(key)
    for name, place in layout.tensors.items():
        try:
            source = source_name(src, name, prefixes)
        except CheckpointError as e:
            raise CheckpointError(f"{where}: {e}") from None
        if src["tensors"][source]["shape"] != list(place.shape):
            raise CheckpointError(f"{where}: {source} has shape {src['tensors'][source]['shape']}, the config "
                                  f"({layout.model_class}) gives {name} the shape {list(place.shape)}")
        work.append((name, source, place))
        used.add(source)
        for key in states.get(source, []):
            shape = tuple(src["tensors"][key]["shape"])
            spec = state_spec(shape, place.shape, place.spec)
            used.add(key)
            if optimizer:
                work.append((optimizer_key(name, key.rsplit("/", 1)[1]), key,
                             place if spec is not None else Place(stage=place.stage, spec=None, shape=shape)))
    aliases = {source_name(src, a, prefixes) for a in layout.aliases if _has(src, a, prefixes)}
    left = sorted(set(src["tensors"]) - used - aliases)
    if left:
        raise CheckpointError(f"{where}: the model ({layout.model_class}) has no place for {len(left)} of its "
                              f"tensors ({', '.join(left[:4])}{', ...' if len(left) > 4 else ''}); was it saved from "
                              f"another architecture? Its config's \"architectures\" names the class to build")
    return work


def _has(src: dict, name: str, prefixes: list[str]) -> bool:
    try:
        source_name(src, name, prefixes)
    except CheckpointError:
        return False
    return True


def write_checkpoint(src_dir: str, src: dict, layout: Layout, config: dict, out: str, *, where: str,
                     step: int | None = None, optimizer: list[dict] | None = None,
                     generation_config: dict | None = None, loss_scaler: dict | None = None,
                     format: CheckpointFormat = CheckpointFormat.QN) -> str:
    """Write ``src`` (an index over ``src_dir``) as a checkpoint of ``layout`` under ``out``, holding
    ``out`` meanwhile (``lock.py``): refused while a training job saves there, as that job is meanwhile.
    ``format`` DCP: a directory torch's FSDP2 recipe loads, each tensor whole (in row blocks of bounded size,
    read from the source one at a time); the layout's tp and pp only check that the model splits so."""
    work = _work(src, layout, base_prefixes(config), where=where, optimizer=True)
    renamed = {source: name for name, source, _ in work}
    groups = ([{**g, **{k: sorted(renamed.get(p, p) for p in g[k]) for k in ("params", STATELESS) if k in g}}
               for g in optimizer] if optimizer else optimizer)
    dcp = format is CheckpointFormat.DCP
    virtual = {"virtual_stages": layout.virtual_stages} if layout.virtual_stages > 1 and not dcp else {}
    header = new_index(library_version=__version__, step=step, config={**config, "architectures": [layout.model_class]},
                       mesh={"dp": 1, "tp": 1 if dcp else layout.tp, "pp": 1 if dcp else layout.pp, **virtual},
                       tensors={}, optimizer=groups, files={}, generation_config=generation_config,
                       loss_scaler=loss_scaler)
    with hold_directory(out, purpose="qn-hf-convert writing a checkpoint", fix=CONVERT_FIX):
        final = next_checkpoint_dir(out, step=step)
        partial = final + PARTIAL
        fresh_dir(partial)
        try:
            if dcp:
                checks = FileChecks(src_dir, src.get("files"))
                write_whole_dcp(partial, [(name, src["tensors"][source], source) for name, source, _ in work],
                                lambda entry, name, box, buf: read_box(src_dir, entry, name, box, buf, handles={},
                                                                       checks=checks),
                                groups=groups, header=header,
                                aliases=tied_aliases(meta_model(config_from_dict(config), cls=layout_class(layout))))
            else:
                entries, digests = _write_shards(src_dir, src, layout, work, partial)
                write_index({**header, "tensors": entries, "files": digests}, os.path.join(partial, INDEX))
                read_index(partial)  # what we wrote must pass our own validation
        except BaseException:
            remove_entry(partial)  # what was written so far: it may be as large as the model
            raise
        publish(partial, final)
        point_root(final)
    return final


CONVERT_FIX = "Wait until that job ends, or write the converted checkpoint under another directory"


def _write_shards(src_dir: str, src: dict, layout: Layout, work: list[tuple[str, str, Place]],
                  partial: str) -> tuple[dict[str, dict], dict[str, dict[str, int]]]:
    """Every (stage, tp rank)'s file: the index entries of what they hold, and their digests."""
    entries: dict[str, dict] = {}
    digests: dict[str, dict[str, int]] = {}
    src_checks = FileChecks(src_dir, src.get("files"))  # an HF source has no digests: nothing to check
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
                by_key = {key: (source, box) for key, _, _, source, box in plan}

                def produce(key: str):
                    source, box = by_key[key]
                    return read_chunks(src_dir, src["tensors"][source], source, box, checks=src_checks)

                write_streaming(os.path.join(partial, file), [(k, s, d) for k, s, d, _, _ in plan], produce)
                digests[file] = file_digest(os.path.join(partial, file))
    return entries, digests


def from_hf(hf_dir: str, out: str, *, tp: int, pp: int, virtual_stages: int = 1,
            format: CheckpointFormat = CheckpointFormat.QN) -> str:
    """A checkpoint laid out as a run at (tp, pp) with ``virtual_stages`` chunks per rank saves one
    (each rank's file holds its chunks' tensors); any run loads it, by name."""
    config = read_hf_config(hf_dir)
    headers = read_headers(hf_dir, weight_files(hf_dir))
    cls = model_class(config, lambda model: set(hf_tensors(headers, key_renamer(model), where=hf_dir)), where=hf_dir)
    src, _ = read_hf_dir(hf_dir, model_class=cls)
    layout = model_layout(config_from_dict(config), tp=tp, pp=pp, virtual_stages=virtual_stages, cls=cls)
    # a Hugging Face model is where training starts: step 0
    return write_checkpoint(hf_dir, src, layout, config, out, where=hf_dir, step=0,
                            generation_config=read_generation_config(hf_dir), format=format)


def _checkpoint_layout(directory: str, index: dict, *, tp: int, pp: int, virtual_stages: int) -> Layout:
    weights = {n for n in index["tensors"] if not n.startswith(OPTIMIZER)}
    cls = model_class(index["config"], lambda model: weights, where=directory)
    return model_layout(config_from_dict(index["config"]), tp=tp, pp=pp, virtual_stages=virtual_stages, cls=cls)


def reshard(ckpt: str, out: str, *, tp: int, pp: int, virtual_stages: int = 1, config: str | None = None,
            format: CheckpointFormat = CheckpointFormat.QN, key_map: str | None = None) -> str:
    """``ckpt`` (qn_hf's or a DCP checkpoint) as a checkpoint laid out at (tp, pp), or as a DCP (``format``)."""
    directory, index = read_source(ckpt, config=config, key_map=key_map)
    layout = _checkpoint_layout(directory, index, tp=tp, pp=pp, virtual_stages=virtual_stages)
    if BY_PARAM in index:
        raise CheckpointError(f"{directory}: its optimizer state is saved per parameter (flatten_optimizer_state_dict), "
                              f"which names no parameter groups to write; load it into a run with load_checkpoint")
    return write_checkpoint(directory, index, layout, index["config"], out, where=directory, step=index.get("step"),
                            optimizer=index.get("optimizer"), generation_config=index.get("generation_config"),
                            loss_scaler=index.get("loss_scaler"), format=format)  # the loss scale is the same at any mesh


def to_hf(ckpt: str, out: str, *, max_shard_bytes: int = DEFAULT_MAX_SHARD_BYTES, overwrite: bool = False,
          config: str | None = None, key_map: str | None = None) -> list[str]:
    """Export the checkpoint's weights as a Hugging Face directory; return the names of what a HF
    directory cannot hold and was left out (the optimizer state). An ``out`` that holds anything
    (but an earlier failed export's staging) is refused unless ``overwrite``, as HF's tools do."""
    if not overwrite and os.path.isdir(out) and any(entry != STAGING for entry in os.listdir(out)):
        raise CheckpointError(f"{out} is not empty; choose a new directory, or pass --overwrite to replace the model "
                              f"files it holds")
    directory, index = read_source(ckpt, config=config, key_map=key_map)
    layout = _checkpoint_layout(directory, index, tp=1, pp=1, virtual_stages=1)
    work = _work(index, layout, base_prefixes(index["config"]), where=directory, optimizer=False)
    checks = FileChecks(directory, index.get("files"))
    sizes = [(name, entry_nbytes(index["tensors"][source])) for name, source, _ in work]
    groups = split_by_size(sizes, max_shard_bytes)
    sources = {name: source for name, source, _ in work}
    staging = begin_export(out)
    try:
        files = _write_weights(directory, index, staging, groups, sources, checks=checks)
    except BaseException:
        remove_entry(staging)  # what was written so far: it may be as large as the model
        raise
    finish_export(staging, out, config=with_architecture(config_from_dict(index["config"]), layout.model_class),
                  generation_config=index.get("generation_config"), files=files)
    return sorted(n for n in index["tensors"] if n.startswith(OPTIMIZER))


def _write_weights(directory: str, index: dict, staging: str, groups: list[list[str]], sources: dict[str, str], *,
                   checks: FileChecks) -> list[str]:
    """Each group of tensors (by the names they are written under) into one weights file."""
    files = []
    with tqdm(total=sum(map(len, groups)), desc="to-hf", unit="tensor", disable=None) as bar:
        for i, group in enumerate(groups):
            file = HF_WEIGHTS if len(groups) == 1 else numbered_weights_file(i, len(groups))

            def produce(name: str):
                bar.update(1)
                entry = index["tensors"][sources[name]]
                return read_chunks(directory, entry, sources[name], [[0, n] for n in entry["shape"]], checks=checks)

            entries = [(n, index["tensors"][sources[n]]["shape"], DTYPES[index["tensors"][sources[n]]["dtype"]])
                       for n in group]
            write_streaming(os.path.join(staging, file), entries, produce)
            files.append(file)
    return files


def unchecked_dcp(path: str) -> bool:
    """Whether ``path`` is a DCP checkpoint without qn_hf's record of its files' CRC-32s (torch's format has no
    checksums: a damaged data byte reads as a wrong weight, not as an error)."""
    found = dcp_sources(path)
    return found is not None and not all(read_header(d) is not None for d in found[1])


def verify_against(out: str, reference: str) -> int:
    """Every tensor of the Hugging Face directory ``out`` bit for bit equal to ``reference``'s (a Hugging Face
    directory you trust: the one a checkpoint came from), the same names on both sides; the count compared.
    ``CheckpointError`` naming the first difference. One tensor in memory at a time from each side."""
    # each side's tensors from their files' headers, checked (an unreadable file is a CheckpointError)
    sides = [dict(read_headers(directory, weight_files(directory))) for directory in (out, reference)]
    if sides[0].keys() != sides[1].keys():
        only = sorted(sides[0].keys() ^ sides[1].keys())
        raise CheckpointError(f"{out} and {reference} hold different tensors ({len(only)} on one side only, e.g. "
                              f"{only[:3]})")
    for key in sorted(sides[0]):
        mine, theirs = ({k: e[k] for k in ("shape", "dtype")} for e in (sides[0][key], sides[1][key]))
        if mine == theirs:
            with safe_open(os.path.join(out, sides[0][key]["pieces"][0]["file"]), framework="pt") as a, \
                    safe_open(os.path.join(reference, sides[1][key]["pieces"][0]["file"]), framework="pt") as b:
                if torch.equal(a.get_tensor(key), b.get_tensor(key)):
                    continue
        raise CheckpointError(f"{out}'s {key} differs from {reference}'s (the source may be damaged: its format "
                              f"carries no checksums)")
    return len(sides[0])
