"""Styles carried out by hooks on an unchanged module: communication at its input or output.

Each hook says which activations are partial (a sum over tp ranks) or used on this rank's share
only, and where the sum happens; forward and backward are those of the comm op named.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable

import torch
from torch import nn
from torch.distributed import ProcessGroup

from ..comm import copy_to_group, gather_rows_into_region, group_rank, reduce_from_group, reduce_scatter_rows
from ..policies.fused import HeadAxis


def _enter_all(value, group: ProcessGroup):
    """Floating-point tensors enter the tp region (identity forward, all-reduce backward); others pass."""
    if isinstance(value, torch.Tensor) and value.is_floating_point():
        return copy_to_group(value, group=group)
    return value


def partial_sum_hooks(module: nn.Module, *, group: ProcessGroup, rows_split: Callable[[], bool] | None = None) -> None:
    """A module whose parameters are tp slices (MoE experts holding a slice of every expert's
    intermediate features, Inkling's shared experts): styles ``experts`` and ``all_reduce``.

    Input: the hidden states and any float weights (routing weights, gammas) are full on every rank,
    and each rank uses them for its slice only, so all of them enter the tp region (their gradients,
    partial per rank, are summed in backward; the router upstream then sees its full gradient).
    Integer inputs (routing indices) pass unchanged. Output: a partial sum over tp ranks, so it is
    all-reduced (identity backward).

    ``rows_split`` (sequence parallelism, an MoE block that runs on this rank's slice of the
    sequence): while it returns True every tensor input holds this rank's tokens as rows, so the
    rows of every rank are gathered (reduce-scatter backward of the float ones: each rank's part of
    their gradient is partial) and the partial output is reduce-scattered back to each rank's rows,
    where it would have been all-reduced: the bytes of the all-reduce, split in its two halves."""

    def rows() -> bool:
        return rows_split is not None and rows_split()

    def before(_module, args, kwargs):
        enter = ((lambda v: gather_rows_into_region(v, group=group) if isinstance(v, torch.Tensor) else v)
                 if rows() else (lambda v: _enter_all(v, group)))
        return tuple(enter(a) for a in args), {k: enter(v) for k, v in kwargs.items()}

    def after(_module, _args, output):
        if not isinstance(output, torch.Tensor):
            raise TypeError(f"{type(module).__name__} returned {type(output).__name__}; a partial-sum module must return a tensor")
        return reduce_scatter_rows(output, group=group) if rows() else reduce_from_group(output, group=group)

    module.register_forward_pre_hook(before, with_kwargs=True)
    module.register_forward_hook(after)


def identity_expert_hooks(module: nn.Module, *, group: ProcessGroup) -> None:
    """An identity expert inside sharded experts returns its full input on every rank, but the
    experts' output is summed over tp: only tp rank 0 contributes it, the others contribute zeros
    (exact for any tp, unlike dividing by tp). A product with 1 or 0 rather than a fresh zero tensor
    keeps the autograd graph the same on every rank, so backward issues its all-reduces in the
    same order everywhere."""

    def after(_module, _args, output):
        # the rank is read when the module runs: the hook is also installed on meta-device models
        # with no process group (checkpoint layouts, qn-hf-convert)
        return output * (1.0 if group_rank(group) == 0 else 0.0)

    module.register_forward_hook(after)


def mla_kv_a_hooks(module: nn.Module, *, group: ProcessGroup, rope_dim: int) -> None:
    """MLA's replicated ``kv_a_proj_with_mqa`` outputs ``[k_pass | k_rot]``. ``k_pass`` goes through
    ``kv_b_proj`` (colwise: it enters the tp region there), but ``k_rot`` is used directly by this
    rank's heads, so its gradient is partial: it enters the tp region here (all-reduce backward)."""

    def after(_module, _args, output):
        passed, rot = output.split([output.shape[-1] - rope_dim, rope_dim], dim=-1)
        return torch.cat([passed, copy_to_group(rot, group=group)], dim=-1)

    module.register_forward_hook(after)


def head_input_hooks(module: nn.Module, *, inputs: dict[str, HeadAxis], heads: int, tp: int, tp_rank: int) -> None:
    """An attention module that takes a tensor built for every head besides the hidden states (BLOOM's and
    MPT's ALiBi biases, made at the model level from the global head count, whose slopes depend on it):
    the rows of this rank's heads are taken before it runs (its gradient, if any, flows to those rows).
    ``inputs``: argument name -> where it holds the heads."""
    names = list(inspect.signature(module.forward).parameters)
    local = heads // tp
    start = tp_rank * local

    def take(value, axis: HeadAxis, name: str):
        if not isinstance(value, torch.Tensor):
            return value
        # the heads where the policy says (a shape, no sync): a tensor laid out otherwise would be cut along
        # another axis, silently
        if axis is HeadAxis.BATCH_TIMES_HEADS:
            wrong = not value.dim() or value.shape[0] % heads
        else:
            dim = 0 if axis is HeadAxis.HEADS else 1
            wrong = value.dim() <= dim or value.shape[dim] != heads
        if wrong:
            raise ValueError(f"{type(module).__name__} takes {name} of shape {tuple(value.shape)}, which does not "
                             f"hold the {heads} heads as {axis.value!r}, where tp={tp} takes each rank's; use tp=1")
        if axis is HeadAxis.HEADS:
            return value.narrow(0, start, local)
        if axis is HeadAxis.AFTER_BATCH:
            return value.narrow(1, start, local)
        rest = value.shape[1:]
        return value.reshape(-1, heads, *rest).narrow(1, start, local).reshape(-1, *rest)

    def before(_module, args, kwargs):
        args = list(args)
        for name, axis in inputs.items():
            if name in kwargs:
                kwargs = {**kwargs, name: take(kwargs[name], axis, name)}
            elif name in names and names.index(name) < len(args):
                args[names.index(name)] = take(args[names.index(name)], axis, name)
        return tuple(args), kwargs

    module.register_forward_pre_hook(before, with_kwargs=True)
