"""Global gradient norm over every shard of the model, and clipping by it."""

from __future__ import annotations

import math

import torch
import torch.distributed as dist

from .placement import Placed


def clip_grad_norm_(pm: Placed, max_norm: float, *, norm_type: float = 2.0) -> torch.Tensor:
    """Clip the gradients of ``pm`` in place so their global norm is at most ``max_norm``; return the
    norm before clipping, identical on every rank.

    A sharded parameter contributes its shard from each tp rank (KV-head replicas once); a
    parameter replicated across tp contributes once; each pipeline stage contributes its own
    parameters, a weight tied across stages once (from the first stage). dp replicas hold the same
    synchronized gradients, so they are not summed, unless each holds only its pieces of them
    (``zero=True``): then the pieces are summed over dp too. One all-reduce over tp, one over pp
    (and one over dp). Under mixed precision the gradients are the float32 ones the optimizer steps.
    """
    norm_type = float(norm_type)
    if norm_type not in (2.0, math.inf):
        raise ValueError(f"norm_type={norm_type} is not supported; use 2.0 or math.inf")
    placement = pm.placement
    tp = placement.dims.tp
    grads, acc = [], torch.zeros((), dtype=torch.float64, device=placement.device)
    for name, grad in pm.named_grads():
        grads.append(grad)
        if placement.is_follower(name):
            continue
        g = grad.detach().double()
        if norm_type == math.inf:
            acc = torch.maximum(acc, g.abs().max())
        else:
            spec = placement.spec(name)
            acc += g.pow(2).sum() * (spec.norm_weight() if spec is not None else 1.0 / tp)
    op = dist.ReduceOp.MAX if norm_type == math.inf else dist.ReduceOp.SUM
    replicas = placement.dims.replicas if pm.grads_split_over_dp else 1  # ZeRO pieces are split over dp x cp
    for group, size in ((placement.groups.tp, tp), (placement.groups.pp, placement.dims.pp),
                        (placement.groups.replicas, replicas)):
        if size > 1:
            dist.all_reduce(acc, op=op, group=group)
    total = acc if norm_type == math.inf else acc.sqrt()
    coef = max_norm / (total.item() + 1e-6)
    if coef < 1.0:
        torch._foreach_mul_(grads, coef)
    return total.float()
