"""A Hugging Face model directory read as a checkpoint: one whole-tensor piece per tensor.

Tensors get the names the model's modules use: transformers 5 keeps some architectures on disk
under older names (ViT's ``encoder.layer.N.attention.attention.query``) and renames them while
loading; the same renamings are applied here. A conversion that merges or splits tensors cannot be
read piecewise and is refused with a clear error.
"""

from __future__ import annotations

import json
import os

import transformers
from safetensors import safe_open

from .checkpoint import CheckpointError, _check_entry
from .layout import meta_model

HF_INDEX = "model.safetensors.index.json"
SAFETENSORS_DTYPES = {"F32": "float32", "F16": "float16", "BF16": "bfloat16", "F64": "float64", "I64": "int64",
                       "I32": "int32", "U8": "uint8", "BOOL": "bool"}


def is_hf_dir(path: str) -> bool:
    return os.path.isfile(os.path.join(path, "config.json")) and (
        os.path.isfile(os.path.join(path, "model.safetensors")) or os.path.isfile(os.path.join(path, HF_INDEX))
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
    """transformers 5 keeps some architectures on disk under older names (ViT's
    ``encoder.layer.N.attention.attention.query``) and renames them while loading. Apply the same
    renamings; a conversion that merges or splits tensors cannot be streamed and is refused."""
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
    elif os.path.isfile(os.path.join(hf_dir, "model.safetensors")):
        files = ["model.safetensors"]
    else:
        raise CheckpointError(f"{hf_dir} has neither model.safetensors nor {HF_INDEX}")
    tensors: dict[str, dict] = {}
    for file in files:
        try:
            with safe_open(os.path.join(hf_dir, file), framework="pt") as f:
                for key in f.keys():
                    sl = f.get_slice(key)
                    shape = list(sl.get_shape())
                    entry = {"shape": shape, "dtype": SAFETENSORS_DTYPES.get(sl.get_dtype(), sl.get_dtype()),
                             "pieces": [{"file": file, "key": key, "box": [[0, n] for n in shape]}]}
                    _check_entry(os.path.join(hf_dir, file), key, entry)
                    tensors[rename(key)] = entry
        except (OSError, ValueError) as e:
            if isinstance(e, CheckpointError):
                raise
            raise CheckpointError(f"{os.path.join(hf_dir, file)} cannot be read: {e}") from None
    return {"tensors": tensors}, config
