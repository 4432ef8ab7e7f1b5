"""Hugging Face model directories, read and written: a directory read as a checkpoint (one
whole-tensor piece per tensor), and the names, index and configs ``from_pretrained`` expects.

Tensors are read under the names the model's modules use: transformers 5 keeps some architectures
on disk under older names (ViT's ``encoder.layer.N.attention.attention.query``) and renames them
while loading; the same renamings are applied here. Per-expert tensors (Mixtral's ``experts.J.w1``/``w3``/
``w2``, the Qwen family's ``experts.J.gate_proj``/``up_proj``/``down_proj``), which transformers stacks
into fused experts tensors, are read as pieces of those (a rank under expert parallelism reads only its
experts' files). Any other conversion that merges or splits tensors cannot be read piecewise and is
refused with a clear error.
"""

from __future__ import annotations

import json
import os
import re
from dataclasses import dataclass

import torch
import transformers
from safetensors import safe_open
from transformers import GenerationConfig

from ..atomic import write_text_atomic
from ..layout import meta_model
from .format import CheckpointError, check_entry, dtype_of_code, entry_nbytes

HF_INDEX = "model.safetensors.index.json"
HF_WEIGHTS = "model.safetensors"
DEFAULT_MAX_SHARD_BYTES = 5 * 1024**3
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


def is_hf_dir(path: str) -> bool:
    return os.path.isfile(os.path.join(path, "config.json")) and (
        os.path.isfile(os.path.join(path, HF_WEIGHTS)) or os.path.isfile(os.path.join(path, HF_INDEX))
    )


def config_from_dict(config: dict) -> transformers.PretrainedConfig:
    config = dict(config)
    return transformers.AutoConfig.for_model(config.pop("model_type"), **config)


def base_prefixes(config: dict) -> list[str]:
    return [p for p in (config.get("base_model_prefix"), "transformer", "model", "vit") if p]


def source_name(index: dict, name: str, prefixes: list[str]) -> str:
    """The saved name of the model's tensor ``name``: HF files name base-model tensors with or
    without the task model's prefix (``transformer.``), depending on which class saved them."""
    if name in index["tensors"]:
        return name
    for prefix in prefixes:
        if name.startswith(prefix + ".") and name[len(prefix) + 1 :] in index["tensors"]:
            return name[len(prefix) + 1 :]
        if f"{prefix}.{name}" in index["tensors"]:
            return f"{prefix}.{name}"
    raise CheckpointError(f"the source has no tensor {name!r}; was it saved from another architecture?")


@dataclass(frozen=True)
class ExpertPart:
    """A per-expert tensor on disk (Mixtral's ``experts.3.w1.weight``) that transformers 5 merges into
    a fused experts tensor while loading: expert ``expert`` of source pattern ``part`` of ``parts``."""

    target: str
    part: int
    parts: int
    expert: int


def _merges_experts(converter) -> bool:
    """transformers' experts merge: the experts stacked along dim 0 (``MergeModulelist(dim=0)``), and
    with several source patterns (gate, up) those concatenated along dim 1 in pattern order."""
    from transformers.core_model_loading import Concatenate, MergeModulelist

    ops = converter.operations
    stacked = len(ops) >= 1 and isinstance(ops[0], MergeModulelist) and ops[0].dim == 0
    joined = len(ops) == 1 or (len(ops) == 2 and isinstance(ops[1], Concatenate) and ops[1].dim == 1)
    return (stacked and joined and len(converter.target_patterns) == 1
            and all(p.count("*") == 1 for p in converter.source_patterns))


def _key_renamer(config: transformers.PretrainedConfig):
    """transformers' load-time renamings for this architecture, as a function of one key: the new
    name, or for a per-expert tensor its place in the fused experts tensor."""
    from transformers.conversion_mapping import get_model_conversion_mapping
    from transformers.core_model_loading import WeightConverter, WeightRenaming, apply_converters, apply_renamings

    transforms = get_model_conversion_mapping(meta_model(config))
    renamings = [t for t in transforms if isinstance(t, WeightRenaming)]
    converters = [t for t in transforms if isinstance(t, WeightConverter)]

    def rename(key: str) -> str | ExpertPart:
        key = apply_renamings(key, renamings)
        target, pattern = apply_converters(key, converters) if converters else (key, None)
        if pattern is None:
            return key
        converter = next(c for c in converters if pattern in c.source_patterns)
        if not _merges_experts(converter):
            raise CheckpointError(f"{key}: this architecture converts tensors while loading; use from_pretrained + parallelize")
        expert = re.search(re.escape(pattern).replace(r"\*", r"(\d+)"), key)
        return ExpertPart(target=target, part=converter.source_patterns.index(pattern),
                          parts=len(converter.source_patterns), expert=int(expert.group(1)))

    return rename


def _fused_entries(parts: list[tuple[ExpertPart, dict]]) -> dict[str, dict]:
    """Per-expert pieces as pieces of their fused tensors ``[experts, parts x rows, ...]``: each is the
    box of one expert and one part, stored without the experts dim (``lead`` 1)."""
    fused: dict[str, dict] = {}
    for where, piece in parts:
        shape = [b for _, b in piece["box"]]
        entry = fused.setdefault(where.target, {"rows": shape[0], "rest": shape[1:], "dtype": piece["dtype"],
                                                "experts": 0, "parts": where.parts, "pieces": []})
        if shape != [entry["rows"], *entry["rest"]] or piece["dtype"] != entry["dtype"]:
            raise CheckpointError(f"{piece['key']}: shape {shape} {piece['dtype']} differs from the other experts of "
                                  f"{where.target}")
        rows = entry["rows"]
        box = [[where.expert, where.expert + 1], [where.part * rows, (where.part + 1) * rows], *[[0, n] for n in shape[1:]]]
        entry["pieces"].append({"file": piece["file"], "key": piece["key"], "box": box, "lead": 1})
        entry["experts"] = max(entry["experts"], where.expert + 1)
    return {target: {"shape": [e["experts"], e["parts"] * e["rows"], *e["rest"]], "dtype": e["dtype"],
                     "pieces": e["pieces"]} for target, e in fused.items()}


def read_hf_dir(hf_dir: str) -> tuple[dict, dict]:
    """A Hugging Face directory as an index of whole-tensor pieces (under the names the model's
    modules use; per-expert tensors as pieces of the fused experts tensors), and its config dict."""
    with open(os.path.join(hf_dir, "config.json")) as f:
        config = json.load(f)
    rename = _key_renamer(config_from_dict(config))
    if os.path.isfile(os.path.join(hf_dir, HF_INDEX)):
        with open(os.path.join(hf_dir, HF_INDEX)) as f:
            files = sorted(set(json.load(f)["weight_map"].values()))
    elif os.path.isfile(os.path.join(hf_dir, HF_WEIGHTS)):
        files = [HF_WEIGHTS]
    else:
        raise CheckpointError(f"{hf_dir} has neither {HF_WEIGHTS} nor {HF_INDEX}")
    tensors: dict[str, dict] = {}
    parts: list[tuple[ExpertPart, dict]] = []
    for file in files:
        try:
            with safe_open(os.path.join(hf_dir, file), framework="pt") as f:
                for key in f.keys():
                    sl = f.get_slice(key)
                    shape = list(sl.get_shape())
                    entry = {"shape": shape, "dtype": dtype_of_code(sl.get_dtype()),
                             "pieces": [{"file": file, "key": key, "box": [[0, n] for n in shape]}]}
                    check_entry(os.path.join(hf_dir, file), key, entry)
                    name = rename(key)
                    if isinstance(name, ExpertPart):
                        parts.append((name, {**entry["pieces"][0], "dtype": entry["dtype"]}))
                    else:
                        tensors[name] = entry
        except (OSError, ValueError) as e:
            if isinstance(e, CheckpointError):
                raise
            raise CheckpointError(f"{os.path.join(hf_dir, file)} cannot be read: {e}") from None
    for name, entry in _fused_entries(parts).items():
        check_entry(hf_dir, name, entry)  # every expert of every part present, once
        tensors[name] = entry
    return {"tensors": tensors}, config


def read_generation_config(hf_dir: str) -> dict | None:
    path = os.path.join(hf_dir, transformers.utils.GENERATION_CONFIG_NAME)
    if not os.path.isfile(path):
        return None
    with open(path) as f:
        return json.load(f)


def generation_config_of(module: torch.nn.Module) -> dict | None:
    """What ``save_pretrained`` writes as generation_config.json (for a model that generates), as a
    dict: checkpoints keep it so that ``qn-hf-convert to-hf`` writes it too."""
    generation_config = getattr(module, "generation_config", None)
    if generation_config is None or not getattr(module, "can_generate", lambda: False)():
        return None
    return generation_config.to_dict()


def write_configs(path: str, config: transformers.PretrainedConfig, generation_config: dict | None) -> None:
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


def finish_weights(path: str, files: list[str]) -> None:
    """The index for several files (none for one ``model.safetensors``), and no stale weight files
    of an earlier save with another layout: from_pretrained prefers ``model.safetensors`` over an
    index, so a stale one would silently win."""
    single = files == [HF_WEIGHTS]
    if not single:
        write_index(path, files)
    keep = set(files) | (set() if single else {HF_INDEX})
    for name in os.listdir(path):
        stale = name in (HF_WEIGHTS, HF_INDEX) or _SHARDED_WEIGHTS.fullmatch(name)
        if stale and name not in keep:
            os.unlink(os.path.join(path, name))
