"""Tiny models' training steps timed, for the calibration of qn_hf's own host work (``overheads.py``): the
planner sits above the transform, so it builds and runs them itself (``qn-hf-plan --calibrate``)."""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable

import torch
import torch.distributed as dist
from transformers import AutoModelForCausalLM, PretrainedConfig

from ..config.parallel_config import ParallelConfig
from ..parallel_model import ParallelModel, optimizer
from ..transform.parallelize import build
from .overheads import GLOBAL_BATCH, SEQ

WARMUP, STEPS = 2, 5


def median_step_seconds(pm: ParallelModel, opt, batch: Callable[[int], torch.Tensor], *, warmup: int,
                        steps: int) -> float:
    """The median of ``steps`` timed steps (``train_step`` and the optimizer's step, after ``warmup``
    untimed ones) of ``pm``, each the slowest rank's (a step ends when its slowest rank does): the
    same on every rank. ``batch(step)``: the step's global batch of token ids, which each dp rank
    slices by its coordinate. Every rank of the initialized process group calls it."""
    seconds = []
    for step in range(warmup + steps):
        ids = batch(step)
        rows = ids.shape[0] // pm.parallel_config.dims.dp
        ids = ids[pm.coords["dp"] * rows:(pm.coords["dp"] + 1) * rows].to(pm.device)
        dist.barrier()
        start = time.perf_counter()
        opt.zero_grad()
        pm.train_step({"input_ids": ids, "labels": ids.clone()})
        opt.step()
        if pm.device.type == "cuda":
            torch.cuda.synchronize(pm.device)
        elapsed = torch.tensor([time.perf_counter() - start], dtype=torch.float64, device=pm.device)
        dist.all_reduce(elapsed, op=dist.ReduceOp.MAX)
        if step >= warmup:
            seconds.append(elapsed.item())
    return statistics.median(seconds)


def tiny_step_seconds(config: PretrainedConfig, parallel: ParallelConfig, device: torch.device) -> float:
    """``median_step_seconds`` of a model built from ``config`` under ``parallel``, AdamW, random
    token batches of ``GLOBAL_BATCH`` x ``SEQ``: the planner's runner (``planner/overheads.py``)."""
    torch.manual_seed(0)
    pm = build(AutoModelForCausalLM.from_config(config).float(), parallel, device=device)
    try:
        return median_step_seconds(
            pm, optimizer(pm, torch.optim.AdamW, lr=1e-4), warmup=WARMUP, steps=STEPS,
            batch=lambda step: torch.randint(0, config.vocab_size, (GLOBAL_BATCH, SEQ),
                                             generator=torch.Generator().manual_seed(step)))
    finally:
        pm.close()
