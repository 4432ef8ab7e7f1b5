"""A DCP checkpoint as a qn_hf index: each saved chunk becomes a piece (a box of the whole tensor stored as
a byte span of a ``.distcp`` file), so everything that reads a box of a tensor from its pieces (a rank's
shard at any mesh, ZeRO-1's flat ranges, dp_shard's rows, the converters' chunks) reads DCP unchanged.

Model keys become the model's names (``names``: the wrappers' segments stripped, a ``KeyMap`` applied,
the task model's prefix added or dropped), and every key must find a tensor of the model: a key that
names none is refused, as a wrong architecture would be. Optimizer state becomes ``optimizer/<name>/<key>``
and the parameter groups the index's ``optimizer``: one group per saved group (torch's recipe), or, for
the per-parameter layout (``flatten_optimizer_state_dict``), ``optimizer_by_param``, grouped at load by
the loading optimizer's own groups.
"""

from __future__ import annotations

import os

from ..format import OPTIMIZER, CheckpointError, check_entry, optimizer_key
from ..hf import source_name
from ..optimizer_state import STATELESS
from .metadata import Contents, load_value
from .names import KeyMap, Part, check_unique, classify, model_name

DCP_FORMAT = "torch.distributed.checkpoint"
BY_PARAM = "optimizer_by_param"
NOT_SAVED = ("initial_lr",)  # an LR scheduler's entry in torch's groups: not a hyperparameter a step reads


class ModelNames:
    """The names a saved tensor may take in the model: its parameters (owners of tied weights), the
    aliases of tied weights and persistent buffers (accepted, not read), and the prefixes of its task
    model (``transformer.`` of GPT2LMHeadModel)."""

    def __init__(self, params: set[str], ignored: set[str], prefixes: list[str]) -> None:
        self.params, self.prefixes = params, prefixes
        self.known = {"tensors": dict.fromkeys(params | ignored)}  # what hf.source_name looks names up in

    def resolve(self, name: str) -> str | None:
        """The model's name for a saved ``name`` (with or without the task model's prefix, as
        ``hf.source_name`` finds it); None when it is an alias or a buffer; raises KeyError when the model
        has no such tensor."""
        try:
            found = source_name(self.known, name, self.prefixes)
        except CheckpointError:
            raise KeyError(name) from None
        return found if found in self.params else None


def dcp_index(sources: list[Contents], root: str, names: ModelNames, key_map: KeyMap | None) -> dict:
    """The index of the DCP directories ``sources`` (torch's recipe: one; accelerate's: the model's and the
    optimizer's), file names relative to ``root``."""
    tensors: dict[str, dict] = {}
    groups: dict[str, dict] = {}  # nested: group number -> hyperparameters; flat: parameter -> hyperparameters
    saved_names: dict[str, str] = {}
    unknown: list[str] = []
    for contents in sources:
        where = contents.directory
        sub = os.path.relpath(contents.directory, root)
        keys = classify(sorted(contents.tensors) + sorted(contents.values))
        for key, item in contents.tensors.items():
            k = keys[key]
            if k.part in (Part.OTHER, Part.GROUP):
                continue
            mapped = model_name(k.fqn, key_map)
            if mapped is None:
                continue
            try:
                name = names.resolve(mapped)
            except KeyError:
                unknown.append(key)
                continue
            if name is None:
                continue
            qn = name if k.part is Part.MODEL else optimizer_key(name, k.field)
            saved_names[key] = qn
            pieces = [{"file": c.span.file if sub == "." else f"{sub}/{c.span.file}", "key": key, "box": c.box,
                       "span": [c.span.offset, c.span.length]} for c in item.chunks]
            entry = {"shape": item.shape, "dtype": item.dtype, "pieces": pieces}
            rows = key_map.rows(name) if key_map is not None else None
            if rows is not None and item.shape:  # state shaped like its parameter is stored in its row order
                entry["rows"] = {"block": rows.block, "order": list(rows.order)}
            check_entry(where, key, entry)
            tensors[qn] = entry
        for key, span in contents.values.items():
            k = keys[key]
            if k.part is Part.GROUP:
                try:
                    owner = k.fqn if k.fqn.isdigit() else _group_owner(k.fqn, key_map, names)
                except KeyError:
                    unknown.append(key)
                    continue
                if owner is not None and k.field not in NOT_SAVED:
                    groups.setdefault(owner, {})[k.field] = load_value(contents.directory, span, key)
    if unknown:
        raise CheckpointError(f"{sources[0].directory}: {len(unknown)} saved entries name nothing in this model, e.g. "
                              f"{', '.join(repr(k) for k in unknown[:3])}; it was saved from another architecture, or "
                              f"under other names: pass key_map= to rename them")
    check_unique(sources[0].directory, saved_names)
    index = {"format": DCP_FORMAT, "tensors": tensors, "optimizer": None, "step": None, "mesh": None,
             "config": None, "files": None, "loss_scaler": None, "generation_config": None}
    if groups and all(g.isdigit() for g in groups):
        with_state = _with_state(tensors)
        index["optimizer"] = [_group(groups.get(str(i)), with_state, names, key_map, sources[0].directory, i)
                              for i in range(len(groups))]
    elif groups:
        index[BY_PARAM] = groups
    return index


def saved_model_names(sources: list[Contents], key_map: KeyMap | None) -> set[str]:
    """The names the model's tensors have in ``sources`` (what a converter picks the model class by)."""
    out = set()
    for contents in sources:
        keys = classify(sorted(contents.tensors) + sorted(contents.values))
        out |= {model_name(keys[key].fqn, key_map) for key in contents.tensors if keys[key].part is Part.MODEL}
    return out - {None}


def _group_owner(fqn: str, key_map: KeyMap | None, names: ModelNames) -> str | None:
    """The model's name of a flattened group's parameter (KeyError: the model has none)."""
    mapped = model_name(fqn, key_map)
    return names.resolve(mapped) if mapped is not None else None


def _with_state(tensors: dict) -> set[str]:
    return {name[len(OPTIMIZER):].rpartition("/")[0] for name in tensors if name.startswith(OPTIMIZER)}


def _group(saved: dict | None, with_state: set[str], names: ModelNames, key_map: KeyMap | None, where: str, i: int) -> dict:
    """One saved group in the index's form: its hyperparameters, ``params`` as the model names them and
    the ones without any state (``stateless``)."""
    if saved is None or not isinstance(saved.get("params"), list):
        raise CheckpointError(f"{where}: optimizer parameter group {i} is missing or has no 'params' list")
    params = []
    for fqn in saved["params"]:
        mapped = model_name(fqn, key_map) if isinstance(fqn, str) else None
        try:
            name = names.resolve(mapped) if mapped is not None else None
        except KeyError:
            raise CheckpointError(f"{where}: optimizer parameter group {i} names {fqn!r}, which this model does "
                                  f"not have") from None
        if name is not None:
            params.append(name)
    hyper = {k: (list(v) if isinstance(v, tuple) else v) for k, v in saved.items() if k != "params"}
    stateless = [p for p in params if p not in with_state]
    return {**hyper, "params": sorted(params), STATELESS: sorted(stateless)}


def groups_by_membership(where: str, by_param: dict[str, dict], tensors: dict,
                         groups: list[list[str]]) -> list[dict]:
    """The per-parameter hyperparameters of a flattened optimizer state dict as the loading optimizer's
    groups (``groups``: each group's parameter names): every parameter of a group must have been saved
    with the same values."""
    out, with_state = [], _with_state(tensors)
    for i, params in enumerate(groups):
        hyper: dict | None = None
        for p in params:
            saved = by_param.get(p)
            if saved is None:
                raise CheckpointError(f"{where}: parameter {p} has no saved hyperparameters (optimizer group {i})")
            if hyper is not None and saved != hyper:
                raise CheckpointError(f"{where}: the parameters of optimizer group {i} were saved with different "
                                      f"hyperparameters ({p}: {saved}, others: {hyper}); group them as they were")
            hyper = saved
        stateless = [p for p in params if p not in with_state]
        out.append({**{k: (list(v) if isinstance(v, tuple) else v) for k, v in (hyper or {}).items()},
                    "params": sorted(params), STATELESS: sorted(stateless)})
    return out


__all__ = ["BY_PARAM", "DCP_FORMAT", "ModelNames", "dcp_index", "groups_by_membership", "saved_model_names"]
