"""Layers whose training output depends on the other rows of the batch: BatchNorm normalizes by the mean and
variance of the rows (and positions) it sees. Split over dp ranks, each rank would normalize by its own rows,
which is not the plain model's step; so at dp > 1 the statistics are summed over the dp ranks (every rank
that holds a part of the batch, dp_shard's included) and each rank normalizes by the whole batch's, as the
plain model does, its gradients flowing back through the sums.

torch's ``SyncBatchNorm`` does the same for GPU tensors only (its forward refuses CPU ones, so it could not
be tested where the suite runs, and one mechanism on both devices is one to test), and it replaces the
modules where this keeps them (their parameters, buffers and state-dict names, and the classes a check
names): each layer's class becomes a subclass of its own whose training forward sums its statistics with
a sum over the group both ways (``_SumBothWays``: torch's own differentiable ``all_reduce`` is deprecated,
and the replacement it names has no backward).

dp_shard needs nothing more: its ranks are dp ranks (the sums run over the whole dp group, inside the blocks
FSDP2 gathers), and BatchNorm's running statistics are buffers, which FSDP2 keeps whole on every rank.

What stays refused: recomputation (its second forward would update the running statistics twice), a batch split over
microbatches (the whole batch's statistics exist only once every microbatch has run forward, which a
schedule that runs a microbatch's backward before the next's forward cannot wait for) and over cp
(BatchNorm models have no sequence ring attention splits), and at dp > 1 a BatchNorm subclass with a forward
of its own (the mixin's forward would replace it)."""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn

from ..config.dims import ParallelDims

BATCH_STATISTICS = (nn.BatchNorm1d, nn.BatchNorm2d, nn.BatchNorm3d, nn.SyncBatchNorm)
SUMMED = (nn.BatchNorm1d, nn.BatchNorm2d, nn.BatchNorm3d)  # what sync_batch_statistics takes


def batch_statistics_layers(model: nn.Module) -> list[str]:
    return [name for name, module in model.named_modules() if isinstance(module, BATCH_STATISTICS)]


def check_batch_statistics(model: nn.Module, *, dims: ParallelDims, microbatches: int, recompute: object) -> None:
    """``ValueError`` naming the split and the layers when ``model`` holds BatchNorm and its batch is split
    where the statistics cannot be summed (cp, microbatches; dp's are), or its blocks are recomputed."""
    layers = batch_statistics_layers(model)
    if layers and recompute is not None:
        # the backward's second forward would move the running statistics a second time each step
        raise ValueError(f"recompute={recompute} ({type(model).__name__}): its BatchNorm layers ({layers[0]}, ...) "
                         f"update their running statistics in every forward, and recomputation runs each block's "
                         f"forward twice a step; train it with recompute=None")
    own_forward = [name for name in layers if not isinstance(model.get_submodule(name), nn.SyncBatchNorm)
                   and type(model.get_submodule(name)).forward is not nn.modules.batchnorm._BatchNorm.forward]
    if dims.dp > 1 and own_forward:
        layer = model.get_submodule(own_forward[0])
        raise ValueError(f"dp={dims.dp} ({type(model).__name__}): {own_forward[0]} is a {type(layer).__name__}, whose "
                         f"forward is its own, not BatchNorm's, so qn_hf cannot sum its statistics over dp without "
                         f"replacing it; train it at dp=1 (tp and pp with one microbatch take it)")
    torch_synced = [name for name, module in model.named_modules() if isinstance(module, nn.SyncBatchNorm)]
    if dims.dp > 1 and torch_synced:
        raise ValueError(f"dp={dims.dp} ({type(model).__name__}): {torch_synced[0]} is torch's SyncBatchNorm, whose "
                         f"forward sums over its own group (the world) and refuses CPU tensors; qn_hf sums BatchNorm "
                         f"statistics over dp itself: build the model with plain BatchNorm layers")
    split = [f"{name}={value}" for name, value in (("cp", dims.cp), ("microbatches", microbatches)) if value > 1]
    if not (split and layers):
        return
    shown = ", ".join(layers[:2]) + (f" and {len(layers) - 2} more" if len(layers) > 2 else "")
    raise ValueError(
        f"{' x '.join(split)} ({type(model).__name__}): its BatchNorm layers ({shown}) normalize by the statistics of "
        f"the rows they see in training, so each part of the split batch would be normalized by its own rows, not "
        f"the plain model's step; qn_hf sums the statistics across dp ranks (dp_shard's included), not yet across microbatches "
        f"or cp ranks: train it at cp=1, microbatches=1 (dp, dp_shard, tp and pp with one microbatch take it)")


class _Synced:
    """Mixed into a BatchNorm layer's own class (``sync_batch_statistics``): where the layer normalizes by
    its batch (training, or no running statistics), the batch is the whole one, summed over ``_qn_group``."""

    _qn_group: dist.ProcessGroup

    def forward(self, input: torch.Tensor) -> torch.Tensor:
        self._check_input_dim(input)
        if not (self.training or self.running_mean is None):
            return super().forward(input)  # eval with running statistics: nothing of the batch's
        return _synced_batch_norm(self, input)


class _SumBothWays(torch.autograd.Function):
    """The sum over a group, whose gradient is the sum of the ranks' gradients: every rank's loss depends on
    every rank's rows through the statistics."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
        ctx.group = group
        out = x.clone()
        dist.all_reduce(out, group=group)
        return out

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        grad = grad.clone()  # autograd may hand the same gradient to another branch
        dist.all_reduce(grad, group=ctx.group)
        return grad, None


def _summed(x: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
    return _SumBothWays.apply(x, group)


def _synced_batch_norm(layer: nn.modules.batchnorm._BatchNorm, x: torch.Tensor) -> torch.Tensor:
    # two passes (mean, then the squared distances from it), as torch's own kernels do, rather than the sum of
    # squares less the squared mean, which cancels digits; statistics in float32 at least (a half-precision
    # compute dtype's are widened; float64's stay float64)
    reduced = [0] + list(range(2, x.dim()))
    shape = [1, -1] + [1] * (x.dim() - 2)
    wide = torch.promote_types(x.dtype, torch.float32)
    xf = x.to(wide)
    count = torch.full((1,), xf.numel() / xf.shape[1], dtype=wide, device=x.device)
    sums = _summed(torch.cat([xf.sum(reduced), count]), layer._qn_group)
    n = sums[-1:].detach()
    mean = sums[:-1] / n
    centered = xf - mean.view(shape)
    var = _summed((centered * centered).sum(reduced), layer._qn_group) / n
    if layer.training and layer.track_running_stats:
        with torch.no_grad():
            layer.num_batches_tracked.add_(1)
            # a tensor factor where momentum is None (a running average): no host sync
            factor = (1.0 / layer.num_batches_tracked.float()) if layer.momentum is None else layer.momentum
            # torch updates the running variance with the unbiased estimate
            unbiased = var.detach() * (n / (n - 1).clamp(min=1))
            for running, batch in ((layer.running_mean, mean.detach()), (layer.running_var, unbiased)):
                running.copy_(running * (1 - factor) + batch * factor)
    out = centered * torch.rsqrt(var + layer.eps).view(shape)
    if layer.affine:
        out = out * layer.weight.to(wide).view(shape) + layer.bias.to(wide).view(shape)
    return out.to(x.dtype)


def sync_batch_statistics(model: nn.Module, group: dist.ProcessGroup) -> list[str]:
    """Make every BatchNorm layer of ``model`` normalize by the whole batch split over ``group`` in training;
    returns their names. The layers keep their parameters, buffers and names; each one's class becomes a
    subclass of its own (made once per class) that sums the statistics."""
    made: dict[type, type] = {}
    names = []
    for name, module in model.named_modules():
        # a subclass of BatchNorm (a model's own) keeps its class under the mixin; SyncBatchNorm is refused
        if not isinstance(module, SUMMED) or isinstance(module, (_Synced, nn.SyncBatchNorm)):
            continue
        cls = type(module)
        if cls not in made:
            made[cls] = type(f"DataParallel{cls.__name__}", (_Synced, cls), {"__module__": __name__})
        module.__class__ = made[cls]
        module._qn_group = group
        names.append(name)
    return names

