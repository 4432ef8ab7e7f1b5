"""Sharded data parallelism (``dp_shard`` > 1): weights, gradients and optimizer state sharded over
groups of ``dp_shard`` dp ranks (ZeRO-3 / FSDP), gradients all-reduced across the groups (hybrid
sharding), with torch's own ``fully_shard`` (FSDP2) doing all of it.

``fully_shard`` serves as it is: it keeps the module tree and the parameter names (each parameter
becomes a DTensor sharded on dim 0 over the dp_shard ranks, so ``pm.named_parameters()`` stays HF's),
all-gathers a block's weights before its forward and backward and reduce-scatters its gradients
after, prefetching the next block's all-gather, and it takes whatever qn_hf's tensor parallelism left
on the module as plain tensors (the local tp shard, sharded again over dp_shard). What qn_hf sets:

* one FSDP group per block (``stage_plan.layers``) and one for the rest (the root: embeddings, final
  norm, head), so at most one block's weights are whole at a time besides the root's;
* gradients summed, not averaged: qn_hf's loss is already each rank's share of the global mean (its
  targets over the global count, ``ParallelModel._run``), as the dp buckets sum it. FSDP's default
  divides by the data-parallel size, and a divide factor of 1 reduces with a pre-multiplied sum that
  gloo lacks, so the sum is forced (``set_force_sum_reduction_for_comms``);
* under mixed precision FSDP's own policy: the sharded parameters stay float32 (they are the master
  weights, so ``qn_hf.optimizer`` keeps no copy), all-gathered in the compute dtype, gradients
  reduce-scattered in float32 — the memory the issue asks for (16/S bytes per parameter for AdamW).
"""

from __future__ import annotations

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import FSDPModule, MixedPrecisionPolicy, fully_shard
from torch.distributed.tensor import DTensor, distribute_tensor


class ShardedParameters:
    """The FSDP groups of one rank's model: applied once, then gradient sync switched per step."""

    def __init__(self, model: nn.Module, *, mesh: DeviceMesh, blocks: list[nn.Module],
                 compute_dtype: torch.dtype | None, experts: list[nn.Module] = (),
                 expert_mesh: DeviceMesh | None = None) -> None:
        """``experts``: the modules expert parallelism sharded over ep. Their weights differ between ep
        ranks, so they get groups of their own over ``expert_mesh`` (the ranks holding the same experts,
        as their gradients are summed today), first, before the blocks that hold them; without such
        ranks (each expert block held once) FSDP leaves them alone."""
        policy = MixedPrecisionPolicy(param_dtype=compute_dtype, reduce_dtype=torch.float32 if compute_dtype else None)
        ignored = None
        if expert_mesh is not None:
            for module in experts:
                fully_shard(module, mesh=expert_mesh, mp_policy=policy)
        elif experts:
            ignored = {p for module in experts for p in module.parameters()}
        for block in blocks:
            fully_shard(block, mesh=mesh, mp_policy=policy, ignored_params=ignored)
        fully_shard(model, mesh=mesh, mp_policy=policy, ignored_params=ignored)
        self.model = model
        self.mesh = mesh
        self.experts_sharded = bool(experts) and expert_mesh is not None
        self.units: list[FSDPModule] = [m for m in model.modules() if isinstance(m, FSDPModule)]
        for unit in self.units:  # every group: the factor is per group, not inherited from the root
            unit.set_gradient_divide_factor(1.0)
            unit.set_force_sum_reduction_for_comms(True)

    def set_gradient_sync(self, sync: bool) -> None:
        """Inside ``pm.no_sync()``: keep the whole gradients and reduce them at the next synced step."""
        for unit in self.units:
            unit.set_requires_gradient_sync(sync, recurse=False)


def local(tensor: torch.Tensor) -> torch.Tensor:
    """This rank's part of a sharded tensor (a view: in-place changes reach the DTensor), or the
    tensor itself."""
    return tensor.to_local() if isinstance(tensor, DTensor) else tensor


@torch.no_grad()
def gathered_state(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """``state`` (a ``state_dict(keep_vars=True)``, whose tied entries are one object) with every
    dp_shard-sharded tensor gathered whole, tied entries still one object. Collective over the
    dp_shard ranks, one tensor at a time, in the state's order (the same on every rank). FSDP's
    own ``unshard`` does not serve here: its state-dict hook hands out the sharded parameters."""
    whole: dict[int, torch.Tensor] = {}
    for tensor in state.values():
        if id(tensor) not in whole:
            whole[id(tensor)] = tensor.detach().full_tensor() if isinstance(tensor, DTensor) else tensor
    return {name: whole[id(tensor)] for name, tensor in state.items()}


def row_range(tensor: torch.Tensor) -> tuple[int, int] | None:
    """For a dp_shard-sharded tensor: the first of this rank's rows along dim 0 and how many it holds
    (torch.chunk's split, which FSDP's Shard(0) follows: ceil(n / S) rows per rank, the last ranks
    fewer or none); None for a tensor held whole. Its rows are a flat range of the whole tensor,
    which is how the checkpoint writes them (as it writes ZeRO-1's pieces)."""
    if not isinstance(tensor, DTensor):
        return None
    mesh, n = tensor.device_mesh, tensor.shape[0]
    size, rank = mesh.size(mesh.ndim - 1), mesh.get_local_rank(mesh.ndim - 1)
    per = -(-n // size)
    first = min(rank * per, n)
    rows = tensor.to_local().shape[0]
    if rows != min(per, n - first):
        raise RuntimeError(f"a dp_shard shard of {rows} rows where torch.chunk gives {min(per, n - first)} of {n}")
    return first, rows


def writes_rows(tensor: torch.Tensor) -> bool:
    """Whether this rank's rows of a dp_shard-sharded tensor are the ones a checkpoint takes: those of
    the first group along a hybrid mesh's replicate dim (the other groups hold the same rows)."""
    mesh = tensor.device_mesh
    return mesh.ndim == 1 or mesh.get_local_rank(0) == 0


def sharded_like(value: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    """``value`` (whole, on every rank) as ``like`` holds it: this rank's rows of it as a DTensor
    when ``like`` is dp_shard-sharded (no transfer: every rank has the value), else as it is."""
    if not isinstance(like, DTensor):
        return value
    return distribute_tensor(value.to(like.device), like.device_mesh, like.placements, src_data_rank=None)
