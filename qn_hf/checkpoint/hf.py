"""Hugging Face model directories read as checkpoints (one whole-tensor piece per tensor), and
what a checkpoint records of the model class and configs that ``from_pretrained`` expects.

Tensors are read under the names the model's modules use: transformers 5 keeps some architectures
on disk under older names (ViT's ``encoder.layer.N.attention.attention.query``) and renames them
while loading; the same renamings are applied here. Per-expert tensors (Mixtral's ``experts.J.w1``/``w3``/
``w2``, the Qwen family's ``experts.J.gate_proj``/``up_proj``/``down_proj``), which transformers stacks
into fused experts tensors, are read as pieces of those (a rank under expert parallelism reads only its
experts' files). Any other conversion that merges or splits tensors cannot be read piecewise and is
refused with a clear error. Every file is read as untrusted: a malformed one is a ``CheckpointError``.
"""

from __future__ import annotations

import copy
import os
import re
from collections.abc import Callable
from dataclasses import dataclass

import torch
import transformers
from safetensors import SafetensorError, safe_open

from .format import CheckpointError, check_entry, dtype_of_code, read_json
from .layout import meta_model

HF_CONFIG = "config.json"
HF_INDEX = "model.safetensors.index.json"
HF_WEIGHTS = "model.safetensors"
DEFAULT_MAX_SHARD_BYTES = 5 * 1024**3


def is_hf_dir(path: str) -> bool:
    return os.path.isfile(os.path.join(path, HF_CONFIG)) and (
        os.path.isfile(os.path.join(path, HF_WEIGHTS)) or os.path.isfile(os.path.join(path, HF_INDEX))
    )


def config_from_dict(config: dict) -> transformers.PretrainedConfig:
    """The config a dict describes (``config.json``'s, or an index's), or a ``CheckpointError``."""
    if not isinstance(config, dict) or not isinstance(config.get("model_type"), str):
        raise CheckpointError(f"the config {str(config)[:100]!r} is not a mapping with a model_type")
    config = dict(config)
    model_type = config.pop("model_type")
    try:
        return transformers.AutoConfig.for_model(model_type, **config)
    except (ValueError, TypeError, KeyError, AttributeError) as e:  # unknown model_type, fields of wrong types
        raise CheckpointError(f"a {model_type!r} config cannot be built from these fields: {type(e).__name__}: "
                              f"{str(e)[:200]}") from None


def hf_class_name(module: torch.nn.Module) -> str:
    """The transformers class a model is (the nearest one it derives from, for a user's subclass):
    what ``architectures`` records so that a converter builds the same class."""
    return next((c.__name__ for c in type(module).__mro__ if getattr(transformers, c.__name__, None) is c),
                type(module).__name__)


def recorded_config(config: transformers.PretrainedConfig, module: torch.nn.Module) -> dict:
    """The config a checkpoint records: with the model's class in ``architectures`` (a model built
    with ``from_config`` has none, and a converter would not know it has a head)."""
    return {**config.to_dict(), "architectures": [hf_class_name(module)]}


def with_architecture(config: transformers.PretrainedConfig, name: str) -> transformers.PretrainedConfig:
    """A copy of ``config`` naming the class ``name`` in ``architectures``, as ``save_pretrained`` writes it."""
    config = copy.deepcopy(config)
    config.architectures = [name]
    return config


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


def key_renamer(model: torch.nn.Module) -> Callable[[str], str | ExpertPart]:
    """transformers' load-time renamings for this model's class, as a function of one key: the new
    name, or for a per-expert tensor its place in the fused experts tensor."""
    from transformers.conversion_mapping import get_model_conversion_mapping
    from transformers.core_model_loading import WeightConverter, WeightRenaming

    transforms = get_model_conversion_mapping(model)
    renamings = [t for t in transforms if isinstance(t, WeightRenaming)]
    converters = [t for t in transforms if isinstance(t, WeightConverter)]

    # transformers' loading order (its rename_source_key): every renaming in turn, then the first
    # converter that matches. Written with each transform's own rename_source_key, which every
    # supported release has (the module's apply_renamings/apply_converters came in 5.21).
    def rename(key: str) -> str | ExpertPart:
        for renaming in renamings:
            key, _ = renaming.rename_source_key(key)
        target, pattern = key, None
        for converter in converters:
            target, pattern = converter.rename_source_key(key)
            if pattern is not None:
                break
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


def read_hf_config(hf_dir: str) -> dict:
    config = read_json(os.path.join(hf_dir, HF_CONFIG))
    if not isinstance(config, dict) or not isinstance(config.get("model_type"), str):
        raise CheckpointError(f"{os.path.join(hf_dir, HF_CONFIG)} is not a model config (a mapping with a model_type)")
    return config


def weight_files(hf_dir: str) -> list[str]:
    """The weight files of a HF directory: those its index maps tensors to, or ``model.safetensors``."""
    where = os.path.join(hf_dir, HF_INDEX)
    if not os.path.isfile(where):
        if not os.path.isfile(os.path.join(hf_dir, HF_WEIGHTS)):
            raise CheckpointError(f"{hf_dir} has neither {HF_WEIGHTS} nor {HF_INDEX}")
        return [HF_WEIGHTS]
    weight_map = read_json(where)
    weight_map = weight_map.get("weight_map") if isinstance(weight_map, dict) else None
    if not isinstance(weight_map, dict) or not weight_map:
        raise CheckpointError(f"{where}: 'weight_map' must map tensor names to weight files")
    for file in weight_map.values():
        if not isinstance(file, str) or os.path.basename(file) != file or not file.endswith(".safetensors"):
            raise CheckpointError(f"{where}: weight file {str(file)[:200]!r} is not a .safetensors name inside "
                                  f"{hf_dir}")
    return sorted(set(weight_map.values()))


def read_headers(hf_dir: str, files: list[str]) -> list[tuple[str, dict]]:
    """(key, whole-tensor entry) for every tensor of the weight files, from their headers."""
    out = []
    for file in files:
        path = os.path.join(hf_dir, file)
        try:
            with safe_open(path, framework="pt") as f:
                for key in f.keys():
                    sl = f.get_slice(key)
                    shape = list(sl.get_shape())
                    entry = {"shape": shape, "dtype": dtype_of_code(sl.get_dtype()),
                             "pieces": [{"file": file, "key": key, "box": [[0, n] for n in shape]}]}
                    check_entry(path, key, entry)
                    out.append((key, entry))
        except (OSError, ValueError, SafetensorError) as e:
            if isinstance(e, CheckpointError):
                raise
            raise CheckpointError(f"{path} cannot be read: {type(e).__name__}: {str(e)[:200]}") from None
    return out


def hf_tensors(headers: list[tuple[str, dict]], rename: Callable[[str], str | ExpertPart], *,
               where: str) -> dict[str, dict]:
    """The entries under the names the model's modules use (per-expert tensors as pieces of the
    fused experts tensors)."""
    tensors: dict[str, dict] = {}
    parts: list[tuple[ExpertPart, dict]] = []
    for key, entry in headers:
        name = rename(key)
        if isinstance(name, ExpertPart):
            parts.append((name, {**entry["pieces"][0], "dtype": entry["dtype"]}))
        elif name in tensors:
            raise CheckpointError(f"{where}: two weight files hold {name!r}")
        else:
            tensors[name] = entry
    for name, entry in _fused_entries(parts).items():
        check_entry(where, name, entry)  # every expert of every part present, once
        tensors[name] = entry
    return tensors


def read_hf_dir(hf_dir: str, *, model_class: type | None = None) -> tuple[dict, dict]:
    """A Hugging Face directory as an index of whole-tensor pieces under the names ``model_class``'s
    modules use (by default the class its config names, else its base model), and its config dict."""
    config = read_hf_config(hf_dir)
    rename = key_renamer(meta_model(config_from_dict(config), cls=model_class))
    return {"tensors": hf_tensors(read_headers(hf_dir, weight_files(hf_dir)), rename, where=hf_dir)}, config


def read_generation_config(hf_dir: str) -> dict | None:
    path = os.path.join(hf_dir, transformers.utils.GENERATION_CONFIG_NAME)
    if not os.path.isfile(path):
        return None
    config = read_json(path)
    if not isinstance(config, dict):
        raise CheckpointError(f"{path} is not a generation config (a mapping)")
    return config


def generation_config_of(module: torch.nn.Module) -> dict | None:
    """What ``save_pretrained`` writes as generation_config.json (for a model that generates), as a
    dict: checkpoints keep it so that ``qn-hf-convert to-hf`` writes it too."""
    generation_config = getattr(module, "generation_config", None)
    if generation_config is None or not getattr(module, "can_generate", lambda: False)():
        return None
    return generation_config.to_dict()
