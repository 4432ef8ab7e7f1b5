"""``qn-hf-convert``: between sharded qn_hf checkpoints and Hugging Face directories, in one process.

Every command streams tensor by tensor (peak memory about the largest tensor, not the model): a
Hugging Face directory is read as a checkpoint whose tensors are single whole pieces, each output
tensor or shard piece is read from the overlapping source pieces and written with
``write_streaming``. The layout of a target mesh comes from ``qn_hf.layout`` (the same policy and
stage cut that ``parallelize`` applies), so no GPU and no process group are involved.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import sys

import torch
from tqdm import tqdm
from transformers import GenerationConfig
from transformers.utils import GENERATION_CONFIG_NAME as GENERATION_CONFIG

from .checkpoint import (
    _DTYPES,
    FORMAT,
    INDEX,
    VERSION,
    CheckpointError,
    _boxes,
    _read_box,
    FileChecks,
    _write_json,
    file_digest,
    checkpoint_dir,
    entry_nbytes,
    next_checkpoint_dir,
    publish,
    read_index,
)
from .hf_source import config_from_dict as _config
from .hf_source import base_prefixes, read_hf_dir, source_name
from .layout import Layout, model_layout
from .safetensors_stream import write_streaming

HF_INDEX = "model.safetensors.index.json"

EXAMPLES = """examples:
  qn-hf-convert from-hf ./gpt2-hf ./ckpt --tp 2 --pp 2     # start training at tp=2, pp=2 from a HF model
  qn-hf-convert reshard ./ckpt ./ckpt-tp4 --tp 4 --pp 1    # resume the same run at another mesh
  qn-hf-convert to-hf ./ckpt ./gpt2-trained                # back to AutoModel.from_pretrained
"""


def write_checkpoint(src_dir: str, src: dict, layout: Layout, config: dict, out: str, *,
                     step: int | None = None, optimizer: list[dict] | None = None,
                     generation_config: dict | None = None) -> str:
    """Write ``src`` (an index over ``src_dir``) as a checkpoint of ``layout`` under ``out``."""
    from . import __version__

    os.makedirs(out, exist_ok=True)
    final = next_checkpoint_dir(out, step=step)
    partial = final + ".partial"
    shutil.rmtree(partial, ignore_errors=True)
    os.makedirs(partial)
    prefixes = base_prefixes(config)
    entries: dict[str, dict] = {}
    digests: dict[str, dict[str, int]] = {}
    src_checks = FileChecks(src_dir, src.get("files"))  # an HF source has no digests: nothing to check
    work = []
    for name, place in layout.tensors.items():
        source = source_name(src, name, prefixes)
        work.append((name, source, place))
        for key in sorted(k for k in src["tensors"] if k.startswith(f"optimizer/{source}/")):
            state = src["tensors"][key]
            same = tuple(state["shape"]) == place.shape
            work.append((f"optimizer/{name}/{key.rsplit('/', 1)[1]}", key,
                         place if same else type(place)(stage=place.stage, spec=None, shape=tuple(state["shape"]))))
    total = sum(1 for _ in work) * layout.tp
    with tqdm(total=total, desc=f"writing tp={layout.tp} pp={layout.pp}", unit="tensor", disable=None) as bar:
        for stage in range(layout.pp):
            for tp_rank in range(layout.tp):
                file = f"shard-pp{stage}-tp{tp_rank}.safetensors"
                plan = []
                for name, source, place in work:
                    bar.update(1)
                    if place.stage != stage:
                        continue
                    writes = place.spec.writes(tp_rank) if place.spec is not None else tp_rank == 0
                    if not writes:
                        continue
                    entry = src["tensors"][source]
                    dtype = _DTYPES[entry["dtype"]]
                    pieces = []
                    for i, (box, _) in enumerate(_boxes(torch.Size(place.shape), place.spec, tp_rank)):
                        key = f"{name}#{i}"
                        plan.append((key, [b - a for a, b in box], dtype, source, box))
                        pieces.append({"file": file, "key": key, "box": box})
                    into = entries.setdefault(name, {"shape": list(place.shape), "dtype": entry["dtype"], "pieces": []})
                    into["pieces"] += pieces  # each tp rank adds its pieces
                by_key = {key: (source, box, shape, dtype) for key, shape, dtype, source, box in plan}

                def produce(key: str) -> torch.Tensor:
                    source, box, shape, dtype = by_key[key]
                    buf = torch.empty(shape, dtype=dtype)
                    # Files stay open for one tensor only: a mapping kept open would count every
                    # page read so far as resident memory.
                    _read_box(src_dir, src["tensors"][source], source, box, buf, handles={}, checks=src_checks)
                    return buf

                write_streaming(os.path.join(partial, file), [(k, s, d) for k, s, d, _, _ in plan], produce)
                digests[file] = file_digest(os.path.join(partial, file))
    index = {"format": FORMAT, "version": VERSION, "library_version": __version__, "step": step,
             "mesh": {"dp": 1, "tp": layout.tp, "pp": layout.pp}, "config": config, "tensors": entries,
             "optimizer": optimizer, "files": digests, "generation_config": generation_config}
    _write_json(index, os.path.join(partial, INDEX))
    read_index(partial)  # what we wrote must pass our own validation
    publish(partial, final)
    return final


def from_hf(hf_dir: str, out: str, *, tp: int, pp: int) -> str:
    src, config = read_hf_dir(hf_dir)
    # a Hugging Face model is where training starts: step 0
    return write_checkpoint(hf_dir, src, model_layout(_config(config), tp=tp, pp=pp), config, out, step=0,
                            generation_config=_read_generation_config(hf_dir))


def _read_generation_config(hf_dir: str) -> dict | None:
    path = os.path.join(hf_dir, GENERATION_CONFIG)
    if not os.path.isfile(path):
        return None
    with open(path) as f:
        return json.load(f)


def reshard(ckpt: str, out: str, *, tp: int, pp: int) -> str:
    directory = checkpoint_dir(ckpt)
    index = read_index(directory)
    layout = model_layout(_config(index["config"]), tp=tp, pp=pp)
    return write_checkpoint(directory, index, layout, index["config"], out, step=index.get("step"),
                            optimizer=index.get("optimizer"), generation_config=index.get("generation_config"))


def to_hf(ckpt: str, out: str, *, max_shard_bytes: int = 5 * 1024**3) -> None:
    directory = checkpoint_dir(ckpt)
    index = read_index(directory)
    checks = FileChecks(directory, index.get("files"))
    names = [n for n in index["tensors"] if not n.startswith("optimizer/")]
    files: list[list[str]] = [[]]
    size = 0
    for name in names:
        entry = index["tensors"][name]
        nbytes = entry_nbytes(entry)
        if files[-1] and size + nbytes > max_shard_bytes:
            files.append([])
            size = 0
        files[-1].append(name)
        size += nbytes
    os.makedirs(out, exist_ok=True)
    _config(index["config"]).save_pretrained(out)
    if index.get("generation_config") is not None:  # as save_pretrained writes it for a model that generates
        GenerationConfig.from_dict(index["generation_config"]).save_pretrained(out)
    weight_map = {}
    with tqdm(total=len(names), desc="to-hf", unit="tensor", disable=None) as bar:
        for i, group in enumerate(files):
            file = "model.safetensors" if len(files) == 1 else f"model-{i + 1:05d}-of-{len(files):05d}.safetensors"

            def produce(name: str) -> torch.Tensor:
                entry = index["tensors"][name]
                buf = torch.empty(entry["shape"], dtype=_DTYPES[entry["dtype"]])
                _read_box(directory, entry, name, [[0, n] for n in entry["shape"]], buf, handles={}, checks=checks)
                bar.update(1)
                return buf

            write_streaming(os.path.join(out, file),
                            [(n, index["tensors"][n]["shape"], _DTYPES[index["tensors"][n]["dtype"]]) for n in group], produce)
            weight_map.update({n: file for n in group})
    if len(files) > 1:
        total = sum(entry_nbytes(index["tensors"][n]) for n in names)
        _write_json({"metadata": {"total_size": total}, "weight_map": weight_map}, os.path.join(out, HF_INDEX))


def _size(text: str) -> int:
    match = re.fullmatch(r"(\d+(?:\.\d+)?)\s*([KMGT]?i?B)?", text.strip(), re.IGNORECASE)
    if not match:
        raise argparse.ArgumentTypeError(f"{text!r} is not a size like 5GB or 500MiB")
    units = {"": 1, "B": 1, "KB": 1e3, "MB": 1e6, "GB": 1e9, "TB": 1e12, "KIB": 2**10, "MIB": 2**20, "GIB": 2**30, "TIB": 2**40}
    return int(float(match.group(1)) * units[(match.group(2) or "").upper()])


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="qn-hf-convert", description=__doc__.split("\n\n")[0], epilog=EXAMPLES,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="command", required=True)
    p = sub.add_parser("to-hf", help="sharded checkpoint -> Hugging Face directory", epilog=EXAMPLES,
                       formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("ckpt", help="a checkpoint directory (ckpt-<step>) or the directory holding them (its latest)")
    p.add_argument("out", help="the Hugging Face directory to write (config, generation config, safetensors)")
    p.add_argument("--max-shard-size", type=_size, default=_size("5GB"), help="largest output file (default 5GB)")
    for name, what in (("from-hf", "Hugging Face directory -> sharded checkpoint"), ("reshard", "checkpoint -> checkpoint at another mesh")):
        p = sub.add_parser(name, help=what, epilog=EXAMPLES, formatter_class=argparse.RawDescriptionHelpFormatter)
        p.add_argument("src", help="a Hugging Face model directory" if name == "from-hf" else
                       "a checkpoint directory (ckpt-<step>) or the directory holding them (its latest)")
        p.add_argument("out", help="the directory to hold the new checkpoint (written as ckpt-<step>, then latest)")
        p.add_argument("--tp", type=int, required=True, help="tensor-parallel degree the checkpoint is laid out for")
        p.add_argument("--pp", type=int, required=True, help="pipeline stages the checkpoint is laid out for")
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        if args.command == "to-hf":
            to_hf(args.ckpt, args.out, max_shard_bytes=args.max_shard_size)
        elif args.command == "from-hf":
            print(from_hf(args.src, args.out, tp=args.tp, pp=args.pp))
        else:
            print(reshard(args.src, args.out, tp=args.tp, pp=args.pp))
    except (CheckpointError, ValueError, OSError) as e:
        print(f"qn-hf-convert: error: {e}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
