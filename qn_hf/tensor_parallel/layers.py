"""Tensor-parallel replacements for ``nn.Linear`` and transformers' ``Conv1D`` (exact types only).

Each layer is built from an existing module with ``from_module`` and keeps only this rank's shard;
parameter names (``weight``, ``bias``) and the weight layout of the module it replaces are kept,
so the model's parameter names stay the Hugging Face names. ``nn.Linear`` stores ``[out, in]``;
``Conv1D`` stores ``[in, out]`` and computes ``x @ W + b``.
"""

from __future__ import annotations

from dataclasses import replace

import torch
from torch import nn
from torch.distributed import ProcessGroup
from transformers.pytorch_utils import Conv1D

from ..comm import (
    copy_to_group,
    gather_from_group,
    group_size,
    reduce_from_group,
    reduce_scatter_sequence,
    split_to_group,
)
from ..pipeline.weight_grad import DefersWeightGrad, project
from .shard import ShardSpec


def _is_conv1d(module: nn.Module) -> bool:
    return isinstance(module, Conv1D)


def linear_dims(module: nn.Module) -> tuple[int, int, int, int]:
    """(in_features, out_features, weight dim of outputs, weight dim of inputs) of a Linear or Conv1D."""
    if _is_conv1d(module):
        return module.nx, module.nf, 1, 0
    if isinstance(module, nn.Linear):
        return module.in_features, module.out_features, 0, 1
    raise TypeError(f"expected nn.Linear or transformers Conv1D, got {type(module).__name__}")


def _frozen_like(new: nn.Module, old: nn.Module) -> nn.Module:
    """Carry ``requires_grad=False`` (frozen weights) over from the module being replaced."""
    for name, param in new.named_parameters(recurse=False):
        param.requires_grad_(getattr(old, name).requires_grad)
    return new


class _ShardedProjection(DefersWeightGrad, nn.Module):
    """Shared state of the column and row layers: the local weight (and bias) in the layout of the
    module they replace, the tp group, and the ShardSpec of the weight. Their one matrix product
    (``project``) defers its weight gradient once ``make_deferrable`` gave the layer a queue (ZB-H1)."""

    def __init__(
        self,
        *,
        weight: torch.Tensor,
        bias: torch.Tensor | None,
        group: ProcessGroup,
        weight_spec: ShardSpec,
        conv1d_layout: bool,
    ) -> None:
        super().__init__()
        self.weight = nn.Parameter(weight)
        self.bias = None if bias is None else nn.Parameter(bias)
        self.group = group
        self.weight_spec = weight_spec
        self.conv1d_layout = conv1d_layout

    def extra_repr(self) -> str:
        return f"local_weight={tuple(self.weight.shape)}, spec={self.weight_spec}"


class ColumnParallelLinear(_ShardedProjection):
    """Output features split across tp: each rank computes ``x @ W_r (+ b_r)`` for its columns.

    Input: the full activation, replicated on every tp rank (``copy_to_group``: identity forward,
    all-reduce backward, because every rank's columns contribute to the input gradient). With
    ``copy_input=False`` the caller has already entered the region once for several layers that
    share one input (q, k and v), so their input gradients are summed before a single all-reduce.
    Output: this rank's columns (``[..., out/tp]``), or all columns with ``gather_output=True``.

    Example: ``ColumnParallelLinear.from_module(mlp.up_proj, spec=ShardSpec(dim=0, tp=2, size=128),
    tp_rank=r, group=tp_group)`` keeps rows ``[64r, 64r+64)`` of ``up_proj.weight``.
    """

    def __init__(
        self,
        *,
        weight: torch.Tensor,
        bias: torch.Tensor | None,
        group: ProcessGroup,
        weight_spec: ShardSpec,
        conv1d_layout: bool,
        gather_output: bool = False,
        copy_input: bool = True,
    ) -> None:
        super().__init__(weight=weight, bias=bias, group=group, weight_spec=weight_spec, conv1d_layout=conv1d_layout)
        self.gather_output = gather_output
        self.copy_input = copy_input

    @classmethod
    def from_module(
        cls,
        module: nn.Module,
        *,
        spec: ShardSpec,
        tp_rank: int,
        group: ProcessGroup,
        gather_output: bool = False,
        copy_input: bool = True,
    ) -> ColumnParallelLinear:
        """``spec`` describes the output dimension (its ``dim`` is rewritten for the weight layout)."""
        _, out_features, out_dim, _ = linear_dims(module)
        if spec.size != out_features:
            raise ValueError(f"spec size {spec.size} != out_features {out_features}")
        weight_spec = replace(spec, dim=out_dim)
        bias = None if module.bias is None else replace(spec, dim=0).shard(module.bias.data, tp_rank)
        new = cls(
            weight=weight_spec.shard(module.weight.data, tp_rank),
            bias=bias,
            group=group,
            weight_spec=weight_spec,
            conv1d_layout=_is_conv1d(module),
            gather_output=gather_output,
            copy_input=copy_input,
        )
        return _frozen_like(new, module)

    def shard_specs(self) -> dict[str, ShardSpec | None]:
        bias_spec = replace(self.weight_spec, dim=0)
        return {"weight": self.weight_spec, **({"bias": bias_spec} if self.bias is not None else {})}

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.copy_input:
            x = copy_to_group(x, group=self.group)
        y = project(x, self.weight, self.bias, conv1d_layout=self.conv1d_layout, queue=self.weight_grad_queue)
        return gather_from_group(y, group=self.group) if self.gather_output else y


class RowParallelLinear(_ShardedProjection):
    """Input features split across tp: each rank computes ``x_r @ W_r``, summed by an all-reduce.

    Input: this rank's slice of the features (the output of a ColumnParallelLinear or of attention
    over this rank's heads), or with ``split_input=True`` the full features, replicated, of which
    this rank takes its slice (split forward, all-gather backward: each rank's slice of the input
    gradient comes from its own weights). Output: the full activation on every rank
    (``reduce_from_group``: all-reduce forward, identity backward). The bias is replicated and
    added once, after the sum. With ``sequence_parallel=True`` the sum is reduce-scattered along the
    sequence instead (all-gather backward): each rank gets the whole sum for its slice of the
    sequence, and the bias is added to that slice only (its gradient is then partial per rank and
    summed over tp, ``sequence_parallel.py``).
    """

    def __init__(self, *, split_input: bool = False, sequence_parallel: bool = False, **kwargs) -> None:
        super().__init__(**kwargs)
        self.split_input = split_input
        self.sequence_parallel = sequence_parallel

    @classmethod
    def from_module(cls, module: nn.Module, *, spec: ShardSpec, tp_rank: int, group: ProcessGroup,
                    split_input: bool = False, sequence_parallel: bool = False) -> RowParallelLinear:
        """``spec`` describes the input dimension (its ``dim`` is rewritten for the weight layout)."""
        in_features, _, _, in_dim = linear_dims(module)
        if spec.size != in_features:
            raise ValueError(f"spec size {spec.size} != in_features {in_features}")
        weight_spec = replace(spec, dim=in_dim)
        new = cls(
            weight=weight_spec.shard(module.weight.data, tp_rank),
            bias=None if module.bias is None else module.bias.data.clone(),
            group=group,
            weight_spec=weight_spec,
            conv1d_layout=_is_conv1d(module),
            split_input=split_input,
            sequence_parallel=sequence_parallel,
        )
        return _frozen_like(new, module)

    def shard_specs(self) -> dict[str, ShardSpec | None]:
        return {"weight": self.weight_spec, **({"bias": None} if self.bias is not None else {})}

    def deferrable_parameters(self) -> list[str]:
        # With tp > 1 the bias is added after the sum, outside the product: its gradient comes in B.
        return super().deferrable_parameters() if group_size(self.group) == 1 else ["weight"]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.split_input:
            x = split_to_group(x, group=self.group)
        if group_size(self.group) == 1:  # nothing to sum: keep the bias fused in the matmul
            return project(x, self.weight, self.bias, conv1d_layout=self.conv1d_layout, queue=self.weight_grad_queue)
        partial = project(x, self.weight, None, conv1d_layout=self.conv1d_layout, queue=self.weight_grad_queue)
        if self.sequence_parallel:
            y = reduce_scatter_sequence(partial, group=self.group)
        else:
            y = reduce_from_group(partial, group=self.group)
        return y if self.bias is None else y + self.bias


class SharedKVColumnLinear(nn.Module):
    """A multi-query fused projection (``[heads x head_dim | head_dim | head_dim]``: every head's queries,
    then the one key and value all heads share) on one tp rank: the whole weight, kept on every rank,
    of which this rank computes the rows of its heads' queries and the shared key and value, in that
    layout (``[local heads x head_dim | head_dim | head_dim]``, what the attention's forward splits with
    its patched head count). No column split keeps the shared rows with every rank's queries, so the
    weight is not split; each rank's gradient covers its rows, and the sum over tp (``grad_sum``) is the
    whole gradient. Input: replicated (it enters the tp region unless its module's entry did)."""

    def __init__(self, *, weight: torch.Tensor, bias: torch.Tensor | None, rows: torch.Tensor, group: ProcessGroup,
                 copy_input: bool) -> None:
        super().__init__()
        self.weight = nn.Parameter(weight)
        self.bias = None if bias is None else nn.Parameter(bias)
        self.register_buffer("rows", rows, persistent=False)
        self.group = group
        self.copy_input = copy_input

    @classmethod
    def from_module(cls, module: nn.Linear, *, heads: int, head_dim: int, tp: int, tp_rank: int, group: ProcessGroup,
                    copy_input: bool) -> SharedKVColumnLinear:
        if module.out_features != (heads + 2) * head_dim:
            raise ValueError(f"a multi-query fused projection holds (heads + 2) x head_dim = ({heads} + 2) x {head_dim} "
                             f"rows, not {module.out_features}")
        local = heads // tp
        queries = torch.arange(tp_rank * local * head_dim, (tp_rank + 1) * local * head_dim)
        shared = torch.arange(heads * head_dim, (heads + 2) * head_dim)
        new = cls(weight=module.weight.data.clone(), bias=None if module.bias is None else module.bias.data.clone(),
                  rows=torch.cat([queries, shared]).to(module.weight.device), group=group, copy_input=copy_input)
        return _frozen_like(new, module)

    def shard_specs(self) -> dict[str, ShardSpec | None]:
        return {"weight": None, **({"bias": None} if self.bias is not None else {})}

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # its rows are gathered from the weight: ZB-H1 does not defer this product's weight gradient
        if self.copy_input:
            x = copy_to_group(x, group=self.group)
        bias = None if self.bias is None else self.bias.index_select(0, self.rows)
        return nn.functional.linear(x, self.weight.index_select(0, self.rows), bias)
