"""Tiny models' training steps timed, for the planner's calibration of qn_hf's own host work
(``planner/overheads.py``), and ``qn-hf-plan``: the planner's command line (``planner/cli.py``)
given this runner, which the planner, below ``parallelize``, cannot reach itself."""

from __future__ import annotations

import statistics
import time

import torch
import torch.distributed as dist
from transformers import AutoModelForCausalLM, PretrainedConfig

from ..build.parallelize import parallelize
from ..config.parallel_config import ParallelConfig
from ..parallel_model import optimizer
from ..planner.cli import main as plan_main
from ..planner.overheads import GLOBAL_BATCH, SEQ

WARMUP, STEPS = 2, 5


def tiny_step_seconds(config: PretrainedConfig, parallel: ParallelConfig, device: torch.device) -> float:
    """The median of ``STEPS`` timed steps (``train_step`` and AdamW's step, after ``WARMUP``) of a
    model built from ``config`` under ``parallel``, each the slowest rank's: the same on every rank.
    Every rank of the initialized process group calls it."""
    torch.manual_seed(0)
    pm = parallelize(AutoModelForCausalLM.from_config(config).float(), parallel, device=device)
    opt = optimizer(pm, torch.optim.AdamW, lr=1e-4)
    rows = GLOBAL_BATCH // parallel.dims.dp
    seconds = []
    try:
        for step in range(WARMUP + STEPS):
            ids = torch.randint(0, config.vocab_size, (GLOBAL_BATCH, SEQ), generator=torch.Generator().manual_seed(step))
            ids = ids[pm.coords["dp"] * rows:(pm.coords["dp"] + 1) * rows].to(device)
            dist.barrier()
            start = time.perf_counter()
            opt.zero_grad()
            pm.train_step({"input_ids": ids, "labels": ids.clone()})
            opt.step()
            if device.type == "cuda":
                torch.cuda.synchronize(device)
            elapsed = torch.tensor([time.perf_counter() - start], dtype=torch.float64, device=device)
            dist.all_reduce(elapsed, op=dist.ReduceOp.MAX)
            if step >= WARMUP:
                seconds.append(elapsed.item())
    finally:
        pm.close()
    return statistics.median(seconds)


def main(argv: list[str] | None = None) -> None:
    plan_main(argv, step_seconds=tiny_step_seconds)


if __name__ == "__main__":
    main()
