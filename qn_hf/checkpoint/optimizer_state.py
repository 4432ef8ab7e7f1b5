"""Optimizer state in a checkpoint: what the index records of each parameter group (hyperparameters,
the optimizer class, the saved names of its parameters, and which of them had no state), and the
check that a load with an optimizer restores every state tensor of every parameter.

A parameter the optimizer never stepped (frozen when saved, or a checkpoint saved before the first
step) has no state; every other one must come back with all of it. Which tensors that is comes from
the optimizer's class itself: a throwaway copy with the group's hyperparameters steps once on a small
tensor of the parameter's dimensionality and dtype, and the tensors it then holds are the keys
(AdamW: ``step``, ``exp_avg``, ``exp_avg_sq``; amsgrad adds ``max_exp_avg_sq``; Adafactor's depend on
the dimensionality). A parameter missing any of them is refused, naming it and the key, instead of
resuming with fresh moments for it or failing inside the first ``opt.step()``.
"""

from __future__ import annotations

import math
import warnings

import torch
from torch import nn

from ..data_parallel.optimizer import OptimizerView, ParallelOptimizer
from ..placement import ShardPlacement

# Recorded with each saved parameter group: a resume into another optimizer class is refused (its
# state keys and hyperparameters mean other things: SGD would take AdamW's lr and weight decay).
OPTIMIZER_CLASS = "optimizer_class"
# Recorded with each saved parameter group: the saved names of its parameters that had no state.
STATELESS = "stateless"
NOT_HYPERPARAMETERS = ("params", OPTIMIZER_CLASS, STATELESS)


def optimizer_view(optimizer: torch.optim.Optimizer) -> OptimizerView:
    """The checkpoint's one way into an optimizer: what qn_hf's optimizer says of itself, or a torch
    optimizer read as stepping the model's parameters."""
    if isinstance(optimizer, ParallelOptimizer):
        return optimizer.checkpoint_view()
    return OptimizerView.of_torch(optimizer)


def optimizer_class_name(view: OptimizerView) -> str:
    """The torch optimizer that steps: a qn_hf optimizer's inner one, or the optimizer itself."""
    return type(view.inner).__name__


def optimizer_groups(module: nn.Module, placement: ShardPlacement, view: OptimizerView) -> list[dict]:
    """Each parameter group's hyperparameters and the saved names of its parameters here, and of those
    this rank knows had no state (under ZeRO-1, where none of a parameter's pieces is this rank's, it
    cannot tell)."""
    names = {id(p): n for n, p in module.named_parameters()}
    groups = []
    for group, params in zip(view.inner.param_groups, view.model_param_groups):
        hyper = {k: v for k, v in group.items()
                 if k != "params" and isinstance(v, (int, float, bool, str, type(None), list, tuple))}
        saved = [p for p in params if not placement.is_follower(names.get(id(p)))]
        keyed = {id(p): view.state_key(p) for p in saved}
        stateless = [names[id(p)] for p in saved if keyed[id(p)] is not None and not any(
            isinstance(v, torch.Tensor) for v in view.inner.state.get(keyed[id(p)], {}).values())]
        groups.append({**hyper, OPTIMIZER_CLASS: optimizer_class_name(view),
                       "params": sorted(names[id(p)] for p in saved), STATELESS: sorted(stateless)})
    return groups


def merge_groups(merged: list[dict] | None, groups: list[dict]) -> list[dict]:
    """One writing rank's groups merged into those of the ranks before it: every rank names its own
    parameters, and a parameter without state on any rank that holds it had none."""
    if merged is None:
        return groups
    for into, extra in zip(merged, groups):
        into["params"] = sorted(set(into["params"]) | set(extra["params"]))
        into[STATELESS] = sorted(set(into[STATELESS]) | set(extra[STATELESS]))
    return merged


# the ranges torch's optimizers take (each refuses others at construction, never at load_state_dict): a saved
# value outside them would load and then fail at the first step, or step silently wrong (a negative rate, a NaN eps)
_AT_LEAST_ZERO = ("lr", "weight_decay", "momentum", "dampening")
_ABOVE_ZERO = ("eps",)
_FRACTIONS = ("betas",)  # each in [0, 1)


def _number(value: object) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


def hyperparameter_problem(key: str, saved: object, current: object) -> str | None:
    """Why the saved hyperparameter ``key`` (``saved``, as the index holds it) cannot replace the stepping
    optimizer's ``current`` value, or None: another type than the optimizer's own (a string or null rate, one
    beta of two, a flag that is no bool), a number that is not finite, or one outside what torch's optimizers
    take (``lr`` and ``weight_decay`` >= 0, ``eps`` > 0, each beta in [0, 1))."""
    if isinstance(current, bool):  # None too: torch's optional flags (foreach, fused) read it as off
        ok = saved is None or isinstance(saved, bool)
    elif isinstance(current, (int, float, torch.Tensor)):  # a rate may be a tensor; the index holds its number
        ok = _number(saved)
    elif isinstance(current, (tuple, list)):
        ok = isinstance(saved, (tuple, list)) and len(saved) == len(current) and all(_number(v) for v in saved)
    elif isinstance(current, str):
        ok = isinstance(saved, str)
    else:  # None (foreach, fused: decided by torch) or a type of the optimizer's own: any value it saved
        return None
    if not ok:
        return f"{key}={saved!r} is not a finite value of the type {type(current).__name__} this optimizer uses"
    if key in _AT_LEAST_ZERO and saved < 0 or key in _ABOVE_ZERO and saved <= 0:
        return f"{key}={saved!r} is {'negative' if key in _AT_LEAST_ZERO else 'not positive'}"
    if key in _FRACTIONS and not all(0 <= v < 1 for v in saved):
        return f"{key}={saved!r} has a value outside [0, 1)"
    return None


def _restored(group: dict, saved_group: dict):
    """The saved hyperparameters loading puts into ``group``: those it has."""
    return ((key, value) for key, value in saved_group.items() if key not in NOT_HYPERPARAMETERS and key in group)


def saved_group_problem(group: dict, saved_group: dict) -> str | None:
    """The first of the saved hyperparameters loading would put into ``group`` that it cannot take
    (``hyperparameter_problem``), or None."""
    return next((problem for key, value in _restored(group, saved_group)
                 if (problem := hyperparameter_problem(key, value, group[key])) is not None), None)


def restored_hyperparameters(group: dict, saved_group: dict) -> dict:
    """The hyperparameters ``group`` has once the saved ones are loaded into it (those it has)."""
    out = {k: v for k, v in group.items() if k != "params"}
    for key, value in _restored(group, saved_group):
        out[key] = tuple(value) if isinstance(group[key], tuple) else value
    return out


def kept_state(view: OptimizerView, hyper: dict, like: torch.Tensor) -> frozenset[str] | None:
    """The state tensors the stepping optimizer's class keeps for a parameter like ``like`` under
    ``hyper``: what a copy holds after one step on a small tensor of the same dimensionality, dtype and
    device. None if the copy cannot step (a closure needed, sparse gradients, constructor arguments of
    its own)."""
    cls = type(view.inner)
    probe = torch.zeros([2] * like.dim(), dtype=like.dtype, device=like.device, requires_grad=True)
    probe.grad = torch.zeros_like(probe)
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            copy = cls([{**hyper, "params": [probe]}])
            copy.step()
    except Exception:  # noqa: BLE001 - any class: what stops a copy from stepping leaves the recorded check
        return None
    return frozenset(k for k, v in copy.state.get(probe, {}).items() if isinstance(v, torch.Tensor))


def foreign_group_problem(group: dict, saved_group: dict, kind: str) -> str | None:
    """Why a parameter group saved without its optimizer's class (a DCP checkpoint) is not one of a ``kind``
    optimizer's (``group``), or None: other hyperparameters (SGD's ``momentum`` for AdamW's ``betas``) or
    another ``decoupled_weight_decay`` (Adam and AdamW share every other key; loading one's into the other
    would change its kind silently)."""
    saved = set(saved_group) - set(NOT_HYPERPARAMETERS) - {"initial_lr"}
    own = set(group) - {"params", "initial_lr"}
    if saved != own:
        return (f"was saved with the hyperparameters {sorted(saved)}, this {kind} has {sorted(own)}: it was saved "
                f"from another kind of optimizer")
    for key in ("decoupled_weight_decay",):
        if key in own and saved_group[key] != group[key]:
            return f"was saved with {key}={saved_group[key]!r}, this {kind} has {group[key]!r} (Adam against AdamW)"
    return None


def stateless_of(saved_group: dict) -> frozenset[str] | None:
    """The saved group's parameters recorded without state; None if the index predates the record."""
    return frozenset(saved_group[STATELESS]) if STATELESS in saved_group else None


def missing_state(param: str, present: set[str], *, stateless: frozenset[str] | None, kept: frozenset[str] | None,
                  kind: str, exact: bool = False) -> str | None:
    """Why the saved state of ``param`` (its keys ``present``) is not what a ``kind`` optimizer restores,
    or None. ``stateless``: its group's ``stateless_of``; ``kept``: the keys the class keeps (None:
    unknown, then only the record is checked). ``exact``: keys it does not keep are refused too (a
    checkpoint that records no optimizer class: ``max_exp_avg_sq`` or ``momentum_buffer`` say another kind)."""
    extra = sorted(present - kept) if exact and kept is not None and present else []
    if extra:
        return (f"parameter {param} has the optimizer state {extra} that {kind} does not keep (it keeps "
                f"{sorted(kept)}): it was saved from another kind of optimizer")
    if stateless is not None and param in stateless:
        return None if not present else (f"parameter {param} is recorded as having no optimizer state, yet the "
                                          f"index holds {sorted(present)} for it")
    if not present and stateless is None:
        return None  # saved before parameters without state were recorded: it may never have stepped
    needed = sorted(kept or ())
    missing = [k for k in needed if k not in present]
    if present and not missing:
        return None
    what = f"optimizer state {missing[0]!r}" if missing else "the optimizer state"
    return (f"{what} of parameter {param} is missing (the checkpoint holds {sorted(present) or 'none'} for it; "
            f"{kind} keeps {needed or 'state'} for every parameter it has stepped)")
