"""Hugging Face model directories, read and written: a directory read as a checkpoint (one
whole-tensor piece per tensor), and the names, index and configs ``from_pretrained`` expects.

Tensors are read under the names the model's modules use: transformers 5 keeps some architectures
on disk under older names (ViT's ``encoder.layer.N.attention.attention.query``) and renames them
while loading; the same renamings are applied here. A conversion that merges or splits tensors
cannot be read piecewise and is refused with a clear error.
"""

from __future__ import annotations

import json
import os
import re

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


def _key_renamer(config: transformers.PretrainedConfig):
    """transformers' load-time renamings for this architecture, as a function of one key."""
    from transformers.conversion_mapping import get_model_conversion_mapping
    from transformers.core_model_loading import WeightConverter, WeightRenaming, apply_converters, apply_renamings

    transforms = get_model_conversion_mapping(meta_model(config))
    renamings = [t for t in transforms if isinstance(t, WeightRenaming)]
    converters = [t for t in transforms if isinstance(t, WeightConverter)]

    def rename(key: str) -> str:
        if converters and apply_converters(key, converters)[1] is not None:
            raise CheckpointError(f"{key}: this architecture converts tensors while loading; use from_pretrained + parallelize")
        return apply_renamings(key, renamings)

    return rename


def read_hf_dir(hf_dir: str) -> tuple[dict, dict]:
    """A Hugging Face directory as an index of whole-tensor pieces (under the names the model's
    modules use), and its config dict."""
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
    for file in files:
        try:
            with safe_open(os.path.join(hf_dir, file), framework="pt") as f:
                for key in f.keys():
                    sl = f.get_slice(key)
                    shape = list(sl.get_shape())
                    entry = {"shape": shape, "dtype": dtype_of_code(sl.get_dtype()),
                             "pieces": [{"file": file, "key": key, "box": [[0, n] for n in shape]}]}
                    check_entry(os.path.join(hf_dir, file), key, entry)
                    tensors[rename(key)] = entry
        except (OSError, ValueError) as e:
            if isinstance(e, CheckpointError):
                raise
            raise CheckpointError(f"{os.path.join(hf_dir, file)} cannot be read: {e}") from None
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
