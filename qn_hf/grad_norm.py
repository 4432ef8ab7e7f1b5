"""Global gradient norm over every shard of the model, and clipping by it."""

from __future__ import annotations

import math
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist

if TYPE_CHECKING:
    from .parallel_model import ParallelModel


def clip_grad_norm_(pm: ParallelModel, max_norm: float, *, norm_type: float = 2.0) -> torch.Tensor:
    """Clip the gradients of ``pm`` in place so their global norm is at most ``max_norm``; return the
    norm before clipping, identical on every rank.

    A sharded parameter contributes its shard from each tp rank (KV-head replicas once); a
    parameter replicated across tp contributes once; each pipeline stage contributes its own
    parameters, a weight tied across stages once (from the first stage). dp replicas hold the same
    synchronized gradients, so they are not summed. One all-reduce over tp, one over pp.
    """
    norm_type = float(norm_type)
    if norm_type not in (2.0, math.inf):
        raise ValueError(f"norm_type={norm_type} is not supported; use 2.0 or math.inf")
    tp = pm.dims.tp
    followers = {tie.follower for tie in pm.stage_plan.ties}
    grads, acc = [], torch.zeros((), dtype=torch.float64, device=pm.device)
    for name, p in pm.named_parameters():
        if p.grad is None:
            continue
        grads.append(p.grad)
        if name in followers:
            continue
        g = p.grad.detach().double()
        if norm_type == math.inf:
            acc = torch.maximum(acc, g.abs().max())
        else:
            spec = pm.specs.get(name)
            acc += g.pow(2).sum() * (spec.norm_weight() if spec is not None else 1.0 / tp)
    op = dist.ReduceOp.MAX if norm_type == math.inf else dist.ReduceOp.SUM
    for group, size in ((pm.groups.tp, tp), (pm.groups.pp, pm.dims.pp)):
        if size > 1:
            dist.all_reduce(acc, op=op, group=group)
    total = acc if norm_type == math.inf else acc.sqrt()
    coef = max_norm / (total.item() + 1e-6)
    if coef < 1.0:
        torch._foreach_mul_(grads, coef)
    return total.float()
