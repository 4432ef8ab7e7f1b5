"""Global gradient norm over every shard of the model, and clipping by it."""

from __future__ import annotations

import math

import torch
import torch.distributed as dist

from .placement import Placed
from .shard import over_experts


def clip_grad_norm_(pm: Placed, max_norm: float, *, norm_type: float = 2.0) -> torch.Tensor:
    """Clip the gradients of ``pm`` in place so their global norm is at most ``max_norm``; return the
    norm before clipping, identical on every rank.

    A sharded parameter contributes its shard from each tp rank (KV-head replicas once); a
    parameter replicated across tp contributes once; each pipeline stage contributes its own
    parameters, a weight tied across stages once (from the first stage). dp replicas hold the same
    synchronized gradients, so they are not summed, unless each holds only its pieces of them
    (``zero=True``): then the pieces are summed over dp too. Experts sharded over ep contribute their
    block from each member of the ep group, once. One all-reduce over tp, one over pp (and one over
    dp, one over ep). Under mixed precision the gradients are the float32 ones the optimizer steps.
    """
    norm_type = float(norm_type)
    if norm_type not in (2.0, math.inf):
        raise ValueError(f"norm_type={norm_type} is not supported; use 2.0 or math.inf")
    placement = pm.placement
    tp = placement.dims.tp
    grads = []
    # [the rest, experts sharded over ep]: each reduced over the ranks holding distinct parts of it
    acc = torch.zeros(2, dtype=torch.float64, device=placement.device)
    for name, grad in pm.named_grads():
        grads.append(grad)
        if placement.is_follower(name):
            continue
        g = grad.detach().double()
        spec = placement.spec(name)
        slot = int(over_experts(spec))
        if norm_type == math.inf:
            acc[slot] = torch.maximum(acc[slot], g.abs().max())
        else:
            acc[slot] += g.pow(2).sum() * (spec.norm_weight() if spec is not None else 1.0 / tp)
    op = dist.ReduceOp.MAX if norm_type == math.inf else dist.ReduceOp.SUM
    replicas = placement.dims.replicas if pm.grads_split_over_dp else 1  # ZeRO pieces are split over dp x cp
    groups = placement.groups
    main, experts = acc[:1].clone(), acc[1:].clone()
    for part, group, size in ((main, groups.tp, tp), (main, groups.replicas, replicas),
                              (experts, groups.ep, placement.dims.ep)):  # ep members hold distinct experts
        if size > 1:
            dist.all_reduce(part, op=op, group=group)
    acc = torch.cat([main, experts]) if groups.ep is not None else main
    if placement.dims.pp > 1:
        dist.all_reduce(acc, op=op, group=groups.pp)
    acc = acc.max() if norm_type == math.inf else acc.sum()
    total = acc if norm_type == math.inf else acc.sqrt()
    coef = max_norm / (total.item() + 1e-6)
    if coef < 1.0:
        torch._foreach_mul_(grads, coef)
    return total.float()
