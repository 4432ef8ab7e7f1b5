"""Where a DCP checkpoint is, and what qn_hf records next to one it wrote.

A DCP checkpoint is a directory with torch's ``.metadata``: torch's recipe saves one; accelerate's FSDP2
``save_state`` saves the model in ``pytorch_model_fsdp_0/`` and the optimizer in ``optimizer_0/``; qn_hf's
``save_checkpoint(format="dcp")`` publishes ``ckpt-<step>/`` under a root with ``latest`` as for its own
format, with ``qn_hf.json`` (sealed as an index is: config, step, mesh, loss scale, the optimizer's groups
and class, each file's size and CRC-32), which torch ignores.
"""

from __future__ import annotations

import os
from collections.abc import Callable

import transformers
from torch import nn

from ..classes import model_class
from ..format import INDEX, CheckpointError, check_fields, checkpoint_dir, read_index, read_json
from ..hf import base_prefixes, config_from_dict, hf_class_name, read_hf_config
from ..json_records import parse_json, read_bytes
from ..layout import meta_model
from ..names import LATEST
from ..seal import seal_problem
from .index import DCP_FORMAT, ModelNames, dcp_index, saved_model_names
from .metadata import is_dcp_dir, read_contents
from .names import KeyMap
from .torchtitan import KEY_MAPS

HEADER = "qn_hf.json"
ACCELERATE_MODEL, ACCELERATE_OPTIMIZER = "pytorch_model_fsdp_0", "optimizer_0"
HEADER_FIELDS = ("library_version", "step", "mesh", "config", "generation_config", "loss_scaler", "optimizer", "files")


def dcp_sources(path: str) -> tuple[str, list[str]] | None:
    """(root, DCP directories) of the checkpoint at ``path``, or None if it is not a DCP checkpoint. A root
    (``latest``) is read through the checkpoint it names, not as the DCP its ``.metadata`` makes it for torch
    (write.point_root), which has no qn_hf.json beside it."""
    if os.path.lexists(os.path.join(path, LATEST)) and not os.path.isfile(os.path.join(path, INDEX)):
        directory = checkpoint_dir(path)
        return (directory, [directory]) if is_dcp_dir(directory) else None
    if is_dcp_dir(path):
        return path, [path]
    model, optim = os.path.join(path, ACCELERATE_MODEL), os.path.join(path, ACCELERATE_OPTIMIZER)
    if is_dcp_dir(model):
        return path, [model] + ([optim] if is_dcp_dir(optim) else [])
    return None


def read_header(directory: str) -> dict | None:
    """``qn_hf.json`` of a DCP directory qn_hf wrote (its seal and fields checked), or None."""
    where = os.path.join(directory, HEADER)
    if not os.path.lexists(where):
        return None
    data = read_bytes(where)  # size-capped
    header = parse_json(where, data)
    if not isinstance(header, dict) or header.get("format") != DCP_FORMAT:
        raise CheckpointError(f"{where} is not qn_hf's record of a {DCP_FORMAT} checkpoint")
    problem = seal_problem(data, header)
    if problem is not None:
        raise CheckpointError(f"{where} {problem}")
    check_fields(where, {**header, "tensors": {}})
    return header


def whole_model(module: nn.Module, config: dict | None) -> nn.Module:
    """The model with every stage's tensors: its class built on ``meta`` from its config (a pipeline
    stage holds only its own), or the module itself when it is not a transformers class (a PEFT wrapper)."""
    cls = getattr(transformers, hf_class_name(module), None)
    if config is not None and isinstance(cls, type) and issubclass(cls, transformers.PreTrainedModel):
        return meta_model(config_from_dict(config), cls=cls)
    return module


def tied_aliases(model: nn.Module) -> dict[str, list[str]]:
    """The other names of each tied weight, by the name ``named_parameters`` gives it first (the one
    ``get_state_dict`` keys the optimizer's state by, and qn_hf saves it under)."""
    first = {id(p): n for n, p in model.named_parameters()}
    out: dict[str, list[str]] = {}
    for name, p in model.named_parameters(remove_duplicate=False):
        if first[id(p)] != name:
            out.setdefault(first[id(p)], []).append(name)
    return out


def persistent_buffers(model: nn.Module) -> list[str]:
    return sorted(set(model.state_dict()) - {n for n, _ in model.named_parameters(remove_duplicate=False)})


def checkpoint_record(directory: str) -> dict:
    """What qn_hf recorded of the checkpoint directory ``directory`` (its mesh, step, config): the index, or
    for a DCP it wrote, ``qn_hf.json``. A DCP another framework wrote records none of it: refused."""
    if not is_dcp_dir(directory):
        return read_index(directory)
    header = read_header(directory)
    if header is None:
        raise CheckpointError(f"{directory} is a torch.distributed.checkpoint another framework wrote: it records no "
                              f"mesh or step; load it with pm.load_checkpoint, or convert it (qn-hf-convert reshard)")
    return header


def model_names(model: nn.Module, config: dict | None) -> ModelNames:
    """Every name ``model``'s tensors have (a ``whole_model``), and its task prefixes."""
    params = {n for n, _ in model.named_parameters()}
    every = {n for n, _ in model.named_parameters(remove_duplicate=False)}
    buffers = {n for n, _ in model.named_buffers()}
    return ModelNames(params, (every - params) | buffers, base_prefixes(config or {}))


def read_dcp(path: str, names_for: Callable[[set[str], dict | None], ModelNames],
             key_map: KeyMap | None) -> tuple[str, dict]:
    """(root directory, qn_hf index) of the DCP checkpoint at ``path``. ``names_for(saved, config)``: the
    model's names, given the names its model keys have (wrappers stripped, ``key_map`` applied) and the
    config qn_hf recorded with it (None: another framework wrote it)."""
    found = dcp_sources(path)
    if found is None:
        raise CheckpointError(f"{path} is not a torch.distributed.checkpoint directory (no .metadata)")
    root, sources = found
    contents = [read_contents(d) for d in sources]
    header = read_header(root)
    index = dcp_index(contents, root, names_for(saved_model_names(contents, key_map),
                                                header.get("config") if header else None), key_map)
    if header is not None:
        index.update({k: header.get(k) for k in HEADER_FIELDS if header.get(k) is not None})
    return root, index


def is_dcp_checkpoint(path: str) -> bool:
    try:
        return dcp_sources(path) is not None
    except CheckpointError:
        return False


__all__ = ["HEADER", "checkpoint_record", "dcp_sources", "is_dcp_checkpoint", "model_names", "persistent_buffers", "read_dcp", "read_header",
           "read_source", "tied_aliases", "whole_model"]


def read_source(ckpt: str, *, config: str | None = None, key_map: str | None = None) -> tuple[str, dict]:
    """(directory, index) of a qn_hf checkpoint or a DCP checkpoint. A DCP another framework wrote records no
    config: ``config`` (a Hugging Face directory or its ``config.json``) gives it, and with it the model
    class, the one whose tensors the DCP holds; ``key_map`` names one of ``KEY_MAPS`` for its keys."""
    if dcp_sources(ckpt) is None:
        if key_map is not None:
            raise CheckpointError(f"{ckpt} is a qn_hf checkpoint: its names are the model's, --key-map is for DCPs")
        directory = checkpoint_dir(ckpt)
        return directory, read_index(directory)
    given = _config_arg(config) if config is not None else None
    if key_map is not None and given is None:
        raise CheckpointError(f"--key-map {key_map} needs --config: the mapping depends on the model's shapes")
    mapping = KEY_MAPS[key_map](config_from_dict(given)) if key_map is not None else None
    chosen: dict = {}

    def names_for(saved: set[str], recorded: dict | None) -> ModelNames:
        if (recorded or given) is None:
            raise CheckpointError(f"{ckpt} is a torch.distributed.checkpoint directory that records no model config; "
                                  f"pass --config with the Hugging Face directory (or config.json) of its model")
        cls = model_class(recorded or given, lambda model: saved, where=ckpt)
        chosen.update(recorded or given, architectures=[cls.__name__])
        return model_names(meta_model(config_from_dict(recorded or given), cls=cls), recorded or given)

    directory, index = read_dcp(ckpt, names_for, mapping)
    index["config"] = chosen
    return directory, index


def _config_arg(path: str) -> dict:
    if os.path.isdir(path):
        return read_hf_config(path)
    config = read_json(path)
    if not isinstance(config, dict) or not isinstance(config.get("model_type"), str):
        raise CheckpointError(f"{path} is not a model config (a mapping with its model_type)")
    return config
