"""Layers whose training output depends on the other rows of the batch: BatchNorm normalizes by the mean and
variance of the rows (and positions) it sees. Split over dp ranks, cp ranks or microbatches, each part would be
normalized by its own statistics, which is not the plain model's step; refused until qn_hf sums the statistics
across the parts. torch's ``SyncBatchNorm`` does that for dp, but only for GPU tensors (it refuses CPU ones, so
it could not be tested here) and not across microbatches of one rank."""

from __future__ import annotations

from torch import nn

from ..config.dims import ParallelDims

BATCH_STATISTICS = (nn.BatchNorm1d, nn.BatchNorm2d, nn.BatchNorm3d, nn.SyncBatchNorm)


def check_batch_statistics(model: nn.Module, *, dims: ParallelDims, microbatches: int) -> None:
    """``ValueError`` naming the split and the layers when ``model`` holds BatchNorm and its batch is split."""
    split = [f"{name}={value}" for name, value in (("dp", dims.dp), ("cp", dims.cp), ("microbatches", microbatches))
             if value > 1]
    if not split:
        return
    layers = [name for name, module in model.named_modules() if isinstance(module, BATCH_STATISTICS)]
    if not layers:
        return
    shown = ", ".join(layers[:2]) + (f" and {len(layers) - 2} more" if len(layers) > 2 else "")
    raise ValueError(
        f"{' x '.join(split)} ({type(model).__name__}): its BatchNorm layers ({shown}) normalize by the statistics of "
        f"the rows they see in training, so each part of the split batch would be normalized by its own rows, not "
        f"the plain model's step; qn_hf sums no batch statistics across ranks or microbatches yet: train it at "
        f"dp=1, cp=1, microbatches=1 (tp and pp with one microbatch take it)")
