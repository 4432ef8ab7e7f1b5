"""Every (dp, tp, pp) for a number of GPUs, checked as ``parallelize`` checks, estimated and ranked.

Candidates keep tensor parallelism inside a node (tp divides the GPUs per node, or the whole world
when it is smaller); each one goes through the same validation ``parallelize`` runs (heads and KV
heads over tp, blocks over pp), and a rejected mesh keeps that exact message. Accepted meshes are
ranked: those that fit the GPU memory first, then by estimated tokens per second.
"""

from __future__ import annotations

from dataclasses import dataclass

from .cost import Hardware, StepTime, step_time
from .estimate import MeshEstimate, Planner


@dataclass(frozen=True)
class Candidate:
    estimate: MeshEstimate
    time: StepTime
    peak_bytes: int
    fits: bool


@dataclass(frozen=True)
class Rejected:
    dp: int
    tp: int
    pp: int
    reason: str


def meshes(gpus: int, *, gpus_per_node: int) -> list[tuple[int, int, int]]:
    out = []
    for tp in range(1, gpus + 1):
        if gpus % tp or (gpus >= gpus_per_node and gpus_per_node % tp) or tp > gpus_per_node:
            continue
        for pp in range(1, gpus // tp + 1):
            if (gpus // tp) % pp == 0:
                out.append((gpus // tp // pp, tp, pp))
    return out


def microbatches_for(pp: int, requested: int | None) -> int:
    """Microbatches per step: as requested, else 4 per stage (bubble (pp-1)/(5pp-1) < 20%)."""
    return requested if requested is not None else 4 * pp


def search(planner: Planner, *, gpus: int, hw: Hardware, microbatches: int | None, schedule: str,
           mixed_precision: str | None = None, zero: bool = False, recompute: str | None = None,
           sequence_parallel: bool = False) -> tuple[list[Candidate], list[Rejected]]:
    """Every mesh for ``gpus``, estimated with the training settings given (as ``Planner.estimate``)."""
    accepted, rejected = [], []
    for dp, tp, pp in meshes(gpus, gpus_per_node=hw.gpus_per_node):
        try:
            est = planner.estimate(dp=dp, tp=tp, pp=pp, microbatches=microbatches_for(pp, microbatches), schedule=schedule,
                                   mixed_precision=mixed_precision, zero=zero, recompute=recompute,
                                   sequence_parallel=sequence_parallel)
        except ValueError as e:
            rejected.append(Rejected(dp=dp, tp=tp, pp=pp, reason=str(e)))
            continue
        accepted.append(evaluate(est, hw=hw))
    accepted.sort(key=lambda c: (not c.fits, -c.time.tokens_per_s))
    return accepted, rejected


def evaluate(est: MeshEstimate, *, hw: Hardware) -> Candidate:
    peak = est.peak_bytes
    return Candidate(estimate=est, time=step_time(est, hw), peak_bytes=peak, fits=peak <= hw.gpu_memory)
