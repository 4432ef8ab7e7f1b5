"""Global gradient norm over every shard of the model, and clipping by it; torch's own norm refused
where it would see a part of the gradients only."""

from __future__ import annotations

import math
import sys
from collections.abc import Iterable

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor

from ..config.dims import Axis, ParallelDims
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
    with torch._C.DisableTorchFunctionSubclass():  # the gradients guarded below are plain tensors here
        return _clip(pm, max_norm, norm_type=float(norm_type))


def _clip(pm: Placed, max_norm: float, *, norm_type: float) -> torch.Tensor:
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


# -- torch's own norm over a part of the gradients ----------------------------------------------------
# ``torch.nn.utils.clip_grad_norm_(pm.parameters(), c)`` (and ``get_total_norm``) sums the squares of
# what this rank holds: at tp its shards, at pp its stage, at ep its experts, so every rank clips by a
# different, smaller norm. Where that is so, the synchronized gradients are re-typed (their class
# only: the same objects, so FSDP2's accumulation into a DTensor's local tensor and the buckets' views
# stay valid, and nothing is copied) to a subclass whose ``__torch_function__`` refuses a call made from
# torch's norm functions and passes every other call through as the plain type. ``as_subclass`` cannot
# re-type a DTensor, and DTensor has no public constructor to build a subclass from. Under ZeRO-1 the
# gradients are this rank's pieces and ``.grad`` is None, which torch's function reads as a norm of 0
# (no clipping): the parameter's bucket slot stands in, refusing every call.
# ``disarm`` before the next backward gives the gradients back their own class.
_TORCH_NORMS = frozenset({"get_total_norm", "_get_total_norm", "clip_grad_norm_", "clip_grad_norm"})


def _called_from_torch_norm() -> bool:
    frame = sys._getframe(2)  # past this function and __torch_function__
    for _ in range(3):  # torch's norm calls the function directly (its no-grad decorator is above it)
        if frame is None:
            return False
        if frame.f_globals.get("__name__") == "torch.nn.utils.clip_grad" and frame.f_code.co_name in _TORCH_NORMS:
            return True
        frame = frame.f_back
    return False


def _why(args: object) -> str:
    """The refusal carried by the first guarded gradient among ``args`` (a list of them included)."""
    for arg in args if isinstance(args, (list, tuple)) else (args,):
        if isinstance(arg, (list, tuple)):
            found = _why(arg)
            if found:
                return found
        elif isinstance(arg, _Guarded):
            return arg.__dict__.get("qn_hf_refusal", "")
    return ""


class _Guarded:
    """A gradient torch's global-norm functions must not read (its ``qn_hf_refusal`` says why)."""

    refuse_everything = False

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        if cls.refuse_everything or _called_from_torch_norm():
            raise ValueError(_why(args))
        with torch._C.DisableTorchFunctionSubclass():
            return func(*args, **(kwargs or {}))


class PartialGrad(_Guarded, torch.Tensor):
    """This rank's part of a gradient (a tp shard, a stage's, an ep rank's experts')."""


class PartialDGrad(_Guarded, DTensor):
    """The same, held by FSDP2 as this rank's rows of a DTensor."""


class PiecesStandIn(_Guarded, torch.Tensor):
    """ZeRO-1: the gradient lives in pieces over the dp ranks; any call on this stand-in is refused."""

    refuse_everything = True


_PLAIN = {PartialGrad: torch.Tensor, PartialDGrad: DTensor}


def partial_grads_refusal(dims: ParallelDims, *, pieces: bool) -> str | None:
    """Why torch's norm over ``pm.parameters()`` would differ from the model's, or None where it is the
    true norm (plain dp, cp, dp_shard's DTensors)."""
    parts = dims.in_use((Axis.TP, Axis.PP, Axis.EP)) + (["zero=True"] if pieces else [])
    if not parts:
        return None
    return (f"torch.nn.utils.clip_grad_norm_ (and get_total_norm) over pm.parameters() sees only this rank's part "
            f"of the gradients at {', '.join(parts)}: its norm is not the model's, and it would differ from rank to "
            f"rank; use qn_hf.clip_grad_norm_(pm, max_norm), which returns the global norm on every rank")


def guard_grads(module: nn.Module, why: str, *, pieces: Iterable[tuple[nn.Parameter, torch.Tensor]] = ()) -> None:
    """Re-type ``module``'s gradients so torch's norm refuses them with ``why``; ``pieces``: (parameter,
    its bucket slot) of the gradients ZeRO-1 holds in pieces, given ``.grad`` stand-ins."""
    for p, slot in pieces:
        p.grad = slot.as_subclass(PiecesStandIn)
        p.grad.qn_hf_refusal = (f"{why}; under ZeRO-1 the gradients live in pieces over the dp ranks after "
                                f"train_step (pm.named_grads() gives this rank's): .grad holds a stand-in")
    for p in module.parameters():
        grad = p.grad
        if grad is None or isinstance(grad, _Guarded):
            continue
        if type(grad) is torch.Tensor or type(grad) is DTensor:
            grad.__class__ = PartialDGrad if isinstance(grad, DTensor) else PartialGrad
            grad.qn_hf_refusal = why


def unguard_grads(module: nn.Module) -> None:
    """The gradients' own classes back (stand-ins dropped), before a backward accumulates into them."""
    for p in module.parameters():
        grad = p.grad
        if isinstance(grad, PiecesStandIn):
            p.grad = None
        elif isinstance(grad, _Guarded):
            grad.__class__ = _PLAIN[type(grad)]
