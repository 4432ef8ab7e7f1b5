"""Global gradient norm over every shard of the model, and clipping by it."""

from __future__ import annotations

import math

import torch
import torch.distributed as dist

from ..placement import Copies, Placed


def clip_grad_norm_(pm: Placed, max_norm: float, *, norm_type: float = 2.0) -> torch.Tensor:
    """Clip the gradients of ``pm`` in place so their global norm is at most ``max_norm``; return the
    norm before clipping, identical on every rank.

    A sharded parameter contributes its shard from each tp rank (KV-head replicas once); a
    parameter replicated across tp contributes once; each pipeline stage contributes its own
    parameters, a weight tied across stages once (from the first stage). dp replicas hold the same
    synchronized gradients, so they are not summed, unless each holds only its pieces of them
    (``zero=True``): then the pieces are summed over dp too; with ``dp_shard`` each rank of a group
    holds its rows of every gradient: summed over that group (not across the groups, which agree). Experts sharded over ep contribute their
    block from each member of the ep group, once (under ZeRO-1 as pieces, summed over the ranks holding
    that block too). One all-reduce over tp, one over pp (and one over dp, one over ep, one over the
    expert replicas). Under mixed precision the gradients are the float32 ones the optimizer steps.

    As ``torch.nn.utils.clip_grad_norm_``: per-tensor norms from ``torch._foreach_norm`` (no copy
    of any gradient), and the gradients multiplied by ``min(1, max_norm / (norm + 1e-6))`` kept on
    the device, so the host never waits for the norm; a NaN norm therefore makes every gradient NaN.
    """
    norm_type = float(norm_type)
    if norm_type not in (2.0, math.inf):
        raise ValueError(f"norm_type={norm_type} is not supported; use 2.0 or math.inf")
    placement = pm.placement
    tp = placement.dims.tp
    grads: dict[torch.dtype, list[torch.Tensor]] = {}
    # (slot, weight of its square, dtype) -> gradients; slots: [the rest, experts sharded over ep],
    # each reduced over the ranks holding distinct parts of it
    parts: dict[tuple[int, float, torch.dtype], list[torch.Tensor]] = {}
    for name, grad in pm.named_grads():
        grads.setdefault(grad.dtype, []).append(grad)
        if placement.is_follower(name) or grad.numel() == 0:  # an empty one adds nothing (and has no max)
            continue
        spec = placement.spec(name)
        weight = spec.norm_weight() if spec is not None else 1.0 / tp
        parts.setdefault((int(placement.copies(name) is Copies.EXPERTS), weight, grad.dtype), []).append(grad.detach())
    acc = torch.zeros(2, dtype=torch.float64, device=placement.device)
    for (slot, weight, dtype), tensors in parts.items():
        wide = torch.float32 if dtype in (torch.float16, torch.bfloat16) else None  # low-precision gradients
        norms = torch.stack(torch._foreach_norm(_cpu_chunks(tensors), norm_type, dtype=wide)).double()
        if norm_type == math.inf:
            acc[slot] = torch.maximum(acc[slot], norms.max())
        else:
            acc[slot] += norms.square().sum() * weight
    op = dist.ReduceOp.MAX if norm_type == math.inf else dist.ReduceOp.SUM
    dims, groups = placement.dims, placement.groups
    replicas = dims.replicas if pm.grads_split_over_dp else 1  # ZeRO pieces are split over dp x cp
    expert_replicas = dims.expert_replicas if pm.expert_grads_split else 1  # ... and over an expert block's holders
    main, experts = acc[:1].clone(), acc[1:].clone()
    for part, group, size in ((main, groups.tp, tp), (main, groups.replicas, replicas),
                              (main, groups.dp_shard, dims.dp_shard),  # FSDP's rows of each gradient
                              (experts, groups.ep, dims.ep),  # ep members hold distinct experts
                              (experts, groups.experts, expert_replicas)):
        if size > 1:
            dist.all_reduce(part, op=op, group=group)
    acc = torch.cat([main, experts]) if groups.ep is not None else main
    if placement.dims.pp > 1:
        dist.all_reduce(acc, op=op, group=groups.pp)
    acc = acc.max() if norm_type == math.inf else acc.sum()
    total = acc if norm_type == math.inf else acc.sqrt()
    # max_norm / (norm + 1e-6) divided as the Python floats were (``float / tensor`` would multiply
    # by a reciprocal); exactly 1, a multiplication that changes nothing, when within max_norm
    coef = torch.full_like(total, max_norm).div_(total + 1e-6).clamp_(max=1.0)
    for dtype, tensors in grads.items():
        torch._foreach_mul_(tensors, coef.to(dtype))
    return total.float()


# On the CPU, torch's float32 norm kernel sums long runs sequentially: 1.4% low on 32768 x 4096
# normal values (and so is torch.nn.utils.clip_grad_norm_ there). The norms of runs of 2**16
# elements, combined in float64, are 1.5e-7 off; asking the kernel for float64 instead copies the
# tensor (1 GiB more peak memory there, measured). A GPU's tree reduction needs neither.
CPU_NORM_RUN = 2**16


def _cpu_chunks(tensors: list[torch.Tensor]) -> list[torch.Tensor]:
    """``tensors``, on the CPU cut into views of at most ``CPU_NORM_RUN`` elements (no copy)."""
    if not tensors or tensors[0].device.type != "cpu":
        return tensors
    out = []
    for t in tensors:
        if t.numel() > CPU_NORM_RUN and t.is_contiguous():
            out.extend(t.view(-1).split(CPU_NORM_RUN))
        else:
            out.append(t)
    return out
