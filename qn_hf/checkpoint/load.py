"""Loading a checkpoint saved at any mesh, or a Hugging Face directory, into this rank's shard.

Each rank computes the box its local shard covers (from its ``ShardSpec`` at the current mesh) and
reads only the overlapping parts of the saved pieces, so tp, pp and dp may all change. Everything is
read and checked before anything is copied, and the outcome is agreed over the whole job.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable

import torch
from torch import nn

from ..comm import failures
from ..data_parallel.optimizer import OptimizerView
from ..data_parallel.precision import LossScaler
from ..data_parallel.sharded import local, row_range, sharded_like
from ..placement import ShardPlacement
from .dcp.directory import is_dcp_checkpoint, model_names, read_dcp, whole_model
from .dcp.index import BY_PARAM, DCP_FORMAT, groups_by_membership
from .dcp.names import KeyMap, as_key_map
from .files import FileChecks
from .format import (
    DTYPES,
    FORMAT,
    CheckpointError,
    checkpoint_dir,
    global_shape,
    optimizer_prefix,
    read_index,
    state_spec,
)
from .hf import base_prefixes, is_hf_dir, read_hf_dir, source_name
from .optimizer_state import (
    OPTIMIZER_CLASS,
    foreign_group_problem,
    kept_state,
    missing_state,
    optimizer_class_name,
    optimizer_view,
    restored_hyperparameters,
    saved_group_problem,
    stateless_of,
)
from .pieces import read_local

# Config entries that say nothing about what a checkpoint's tensors mean: bookkeeping, runtime
# switches, token ids, label names, initialisation, the loss's problem type. Dropout probabilities
# (any key naming dropout or a drop probability) may change between runs too.
STEP_COUNTER = "step"  # the name of torch's optimizers' per-parameter step count in their state
NOT_ARCHITECTURE = frozenset({
    "_name_or_path", "architectures", "transformers_version", "dtype", "torch_dtype", "use_cache",
    "output_attentions", "output_hidden_states", "return_dict", "torchscript", "id2label", "label2id",
    "problem_type", "initializer_range", "initializer_factor", "chunk_size_feed_forward", "tokenizer_class",
    "task_specific_params", "prefix", "finetuning_task", "pretraining_tp", "_attn_implementation",
    "_attn_implementation_internal", "_experts_implementation", "base_model_tp_plan", "base_model_pp_plan",
})


def _free_to_differ(key: str) -> bool:
    return key in NOT_ARCHITECTURE or key.endswith(("token_id", "token_ids")) or "dropout" in key or "pdrop" in key \
        or key.endswith("_prob")


def config_differences(saved: dict, current: dict, *, path: str = "") -> list[str]:
    """``key: saved X, this model Y`` for every architecture entry both configs hold with different
    values (nested configs by their dotted path). Keys only one side holds are left alone: a newer
    transformers writes defaults an older one did not."""
    out = []
    for key in sorted(set(saved) & set(current)):
        if _free_to_differ(key):
            continue
        a, b = saved[key], current[key]
        if isinstance(a, dict) and isinstance(b, dict):
            out += config_differences(a, b, path=f"{path}{key}.")
        elif a != b and not (isinstance(a, (list, tuple)) and isinstance(b, (list, tuple)) and list(a) == list(b)):
            out.append(f"{path}{key}: saved {a!r}, this model {b!r}")
    return out


def load_checkpoint(module: nn.Module, path: str, *, placement: ShardPlacement, model_type: str,
                    optimizer: torch.optim.Optimizer | None = None, cast: bool = False,
                    config: dict | None = None, scaler: LossScaler | None = None,
                    key_map: KeyMap | Callable[[str], str | None] | None = None) -> dict:
    """Load ``path`` into ``module``'s shard (and ``optimizer``, and float16's loss ``scaler``: see
    ``restore_loss_scale``); return the saved metadata.
    ``cast`` (mixed precision): weights saved in another floating-point dtype are converted.
    ``config`` (the model's whole config, as a dict): the saved one must agree with it on every
    architecture entry (``config_differences``), or tensors of the same shapes would load into a
    model that reads them differently (other head counts, another norm epsilon, untied embeddings).
    ``path`` may also be a ``torch.distributed.checkpoint`` directory (``dcp``); ``key_map`` renames its keys.

    If any rank finds a problem, every rank raises the same ``CheckpointError`` (naming the rank,
    file and tensor) and nothing in the model or optimizer has changed."""
    error, loaded = None, None
    view = optimizer_view(optimizer) if optimizer is not None else None
    try:
        loaded = _read_all(module, path, placement, model_type, view, cast, config, as_key_map(key_map))
    except CheckpointError as e:
        error = str(e)
    failed = failures(error)
    if failed:
        rank, message = failed[0]
        raise CheckpointError(f"rank {rank}: {message}" + (f" (and {len(failed) - 1} more ranks failed)" if len(failed) > 1 else ""))
    index, tensors, states = loaded
    params = dict(module.named_parameters())
    with torch.no_grad():
        for name, value in tensors.items():
            local(params[name]).copy_(value)  # dp_shard: value is this rank's rows already
            m = view.master(params[name]) if view is not None else None
            if m is not None and view.mixed:  # float32 masters from the float32 weights
                m.tensor.copy_(_flat_part(value, m.start, m.tensor))
    if view is not None:
        for group, saved_group in zip(view.inner.param_groups, index["optimizer"]):
            group.update(restored_hyperparameters(group, saved_group))
        group_of = {id(p): group for group in view.inner.param_groups for p in group["params"]}
        for keyed, state in states.items():
            placed = {k: placed_state(k, v, param=keyed, group=group_of[id(keyed)]) for k, v in state.items()}
            # dp_shard: the moments become this rank's rows of the whole, as its parameter holds them
            view.inner.state[keyed] = {k: sharded_like(v, keyed) if v.ndim > 0 else v for k, v in placed.items()}
    if scaler is not None:
        restore_loss_scale(scaler, index, path=path)
    return {"step": index.get("step"), "mesh": index.get("mesh"), "library_version": index.get("library_version"),
            "loss_scaler": index.get("loss_scaler")}


def restore_loss_scale(scaler: LossScaler, index: dict, *, path: str) -> None:
    """float16's loss scale as the saved run left it (the same on every rank, so any mesh resumes it).
    A checkpoint of a run without float16 (bf16, fp32, a Hugging Face model) has none: the scale starts
    afresh, as a new float16 run's does. One saved before qn_hf recorded it starts afresh too, with a
    warning. A float16 scale loaded without float16 is left unused (the run needs none)."""
    saved = index.get("loss_scaler")
    if saved is not None:
        scaler.load_state(saved)
    elif index.get("format") == FORMAT and "loss_scaler" not in index:
        warnings.warn(f"{path} was saved before qn_hf recorded float16's loss scale: it starts afresh at "
                      f"{scaler.scale:g}, so the first steps may overflow and be skipped while it settles",
                      stacklevel=3)


def placed_state(key: str, value: torch.Tensor, *, param: torch.Tensor, group: dict) -> torch.Tensor:
    """Where ``torch.optim.Optimizer.load_state_dict`` puts an optimizer state tensor: on the
    parameter's device, except the ``step`` counters, which stay on the host unless the group is
    fused or capturable (then float32 on the device). Torch's Adam reads a host counter without
    waiting for the device; one on a GPU would cost two host syncs per parameter and step."""
    if key == STEP_COUNTER:
        if group.get("fused") or group.get("capturable"):
            return value.to(dtype=torch.float32, device=param.device)
        return value
    return value.to(param.device)


def _read_all(module: nn.Module, path: str, placement: ShardPlacement, model_type: str,
              view: OptimizerView | None, cast: bool, current: dict | None, key_map: KeyMap | None):
    if is_hf_dir(path):
        if view is not None:
            raise CheckpointError(f"{path} is a Hugging Face directory: it holds no optimizer state")
        directory = path
        index, config = read_hf_dir(path)
    elif is_dcp_checkpoint(path):
        directory, index = read_dcp(path, lambda saved, _: model_names(whole_model(module, current), current), key_map)
        config = index.get("config") or {}  # one another framework wrote records none: its shapes are the check
    else:
        directory = checkpoint_dir(path)
        index = read_index(directory)
        config = index.get("config", {})
    checks = FileChecks(directory, index.get("files"))
    saved_type = config.get("model_type", model_type if index.get("format") == DCP_FORMAT else None)
    if saved_type != model_type:
        raise CheckpointError(f"{directory} holds a {saved_type!r} model, this one is {model_type!r}")
    differences = config_differences(config, current) if current is not None else []
    if differences:
        raise CheckpointError(f"{directory} was saved from a model with another configuration: "
                              + "; ".join(differences) + "; build the model from the checkpoint's config.json (or "
                              "its index's config) to resume it")
    params = dict(module.named_parameters())
    prefixes = base_prefixes(config)
    # Mixed precision: weights are read in float32 (the masters; the low-precision copies are cast).
    read_as = torch.float32 if view is not None and view.mixed else None
    tensors = {}
    for name, p in params.items():
        try:
            saved = source_name(index, placement.owner(name), prefixes)
        except CheckpointError as e:
            raise CheckpointError(f"{directory}: {e}") from None
        like = p if read_as is None or not p.is_floating_point() else torch.empty(0, dtype=read_as)
        whole = read_local(directory, index, saved, like, placement.spec(name),
                           placement.shard_rank(placement.spec(name)), shape=list(p.shape), checks=checks, cast=cast)
        rows = row_range(p)  # dp_shard: keep this rank's rows only
        tensors[name] = whole if rows is None else whole.narrow(0, *rows).clone()
    states: dict[torch.Tensor, dict[str, torch.Tensor]] = {}
    if view is not None:
        if BY_PARAM in index:  # saved per parameter (flatten_optimizer_state_dict): grouped as this optimizer is
            names_of = {id(p): placement.owner(n) for n, p in params.items()}
            index["optimizer"] = groups_by_membership(directory, index[BY_PARAM], index["tensors"], [
                [names_of[id(p)] for p in group if id(p) in names_of] for group in view.model_param_groups])
        _check_optimizer(directory, index, view, params, placement)
        names = {id(p): n for n, p in params.items()}
        kept: dict[tuple, frozenset[str] | None] = {}  # the state keys the optimizer keeps, by group and tensor kind
        for i, params_of_group in enumerate(view.model_param_groups):
            hyper = restored_hyperparameters(view.inner.param_groups[i], index["optimizer"][i])
            stateless = stateless_of(index["optimizer"][i])
            for p in params_of_group:
                m, keyed = view.master(p), view.state_key(p)
                if keyed is None:
                    continue  # ZeRO-1: no part of this parameter is in this rank's pieces
                name = names[id(p)]
                prefix = optimizer_prefix(placement.owner(name))
                spec = placement.spec(name)
                tensor_kind = (i, keyed.dim(), keyed.dtype, keyed.device)
                if tensor_kind not in kept:
                    kept[tensor_kind] = kept_state(view, hyper, keyed)
                present = {k[len(prefix):] for k in index["tensors"] if k.startswith(prefix)}
                problem = missing_state(placement.owner(name), present, stateless=stateless, kept=kept[tensor_kind],
                                        kind=optimizer_class_name(view), exact=index.get("format") == DCP_FORMAT)
                if problem is not None:
                    raise CheckpointError(f"{directory}: {problem}; resume from another checkpoint, or load without "
                                          f"optimizer= to start the optimizer afresh")
                state = {}
                for key in (k for k in index["tensors"] if k.startswith(prefix)):
                    entry = index["tensors"][key]
                    like = torch.empty(0, dtype=DTYPES[entry["dtype"]])
                    param_shape = global_shape(p.shape, spec)
                    own = state_spec(entry["shape"], param_shape, spec)
                    shape = list(p.shape) if entry["shape"] == param_shape else entry["shape"]
                    value = read_local(directory, index, key, like, own, placement.shard_rank(own), shape=shape,
                                       checks=checks)
                    state[key[len(prefix):]] = (_flat_part(value, m.start, keyed) if own is spec and m is not None
                                                and entry["shape"] == param_shape else value)
                if state:
                    states[keyed] = state
    return index, tensors, states


def _flat_part(value: torch.Tensor, start: int, like: torch.Tensor) -> torch.Tensor:
    """The part of ``value`` (shaped like a whole local parameter) a master ``like`` covers: all of
    it, or under ZeRO-1 the flat range from ``start``."""
    return value.reshape(-1)[start : start + like.numel()].reshape(like.shape).clone()


def _check_optimizer(directory: str, index: dict, view: OptimizerView, params: dict[str, nn.Parameter],
                     placement: ShardPlacement) -> None:
    saved = index.get("optimizer")
    if not isinstance(saved, list):
        raise CheckpointError(f"{directory} has no optimizer state; load without optimizer= or save with it")
    if len(saved) != len(view.inner.param_groups):
        raise CheckpointError(f"{directory}: the optimizer had {len(saved)} parameter groups, this one has "
                              f"{len(view.inner.param_groups)}")
    names = {id(p): n for n, p in params.items()}
    kind = optimizer_class_name(view)
    recorded = {g.get(OPTIMIZER_CLASS) for g in saved} - {None}  # absent: saved before classes were recorded
    if not recorded and index.get("format") == DCP_FORMAT:  # DCP records no class: its hyperparameters must fit
        for i, (group, saved_group) in enumerate(zip(view.inner.param_groups, saved)):
            problem = foreign_group_problem(group, saved_group, kind)
            if problem is not None:
                raise CheckpointError(f"{directory}: optimizer group {i} {problem}; build that optimizer to resume, or "
                                      f"load without optimizer= to start it afresh")
    if recorded and recorded != {kind}:
        raise CheckpointError(f"{directory}: the optimizer state was saved from {', '.join(sorted(recorded))}, this "
                              f"optimizer is {kind}; its state and hyperparameters would mean other things: build a "
                              f"{next(iter(sorted(recorded)))} to resume, or load without optimizer= to start it afresh")
    for i, (group, saved_group) in enumerate(zip(view.inner.param_groups, saved)):
        problem = saved_group_problem(group, saved_group)
        if problem is not None:
            raise CheckpointError(f"{directory}: the saved optimizer group {i}'s {problem}: the index was edited "
                                  f"or written by another tool; resume from another checkpoint, or load without "
                                  f"optimizer= to start the optimizer afresh")
    for i, (group, saved_group) in enumerate(zip(view.model_param_groups, saved)):
        for p in group:
            name = names.get(id(p))
            saved_name = placement.owner(name) if name is not None else None
            if saved_name is None or saved_name not in saved_group.get("params", []):
                raise CheckpointError(f"{directory}: parameter {names.get(id(p), '?')} is in optimizer group {i} "
                                      f"here but not in the saved group {i}")
