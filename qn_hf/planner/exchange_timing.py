"""Timings taken by every rank at once (``calibrate.py``): agreeing values over the ranks, starting
samples together, and the waits at blocking exchanges after compute (``wait_table``).

A rank that reaches a blocking exchange (a tp all-reduce, an ep all-to-all, a pipeline's receive,
FSDP's gather) before its peers waits for the last of them. The collective fits do not see it: their
samples start on every rank together. A step does not: its ranks drift apart over the compute since
the last exchange. On this project's 2-core VM, with nothing else running, a 256-float all-to-all
after 10 ms of compute waited 1.5-2 ms more than after none on each rank, and 12-18 ms after 400 ms
(both ranks alike: jitter, not one slow rank), so the wait is measured as a function of the compute
before the exchange rather than as one figure.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable, Sequence

import torch
import torch.distributed as dist

from .calibration import WaitTable
from .compute_timing import seconds_per_call, sync

WAIT_SAMPLE_S = 0.25  # a wait sample repeats its segment and exchange at least this long (and 3 times)


def agree(values: Sequence[float], device: torch.device, op=dist.ReduceOp.MAX) -> list[float]:
    """Every rank's values reduced elementwise (by default the slowest rank's): the same on every rank."""
    t = torch.tensor(list(values), dtype=torch.float64, device=device)
    dist.all_reduce(t, op=op)
    return t.tolist()


def mean(values: Sequence[float], device: torch.device) -> list[float]:
    """Every rank's values averaged elementwise: the same on every rank. For compute timings: on a
    shared VM one rank's sample of a shape now and then ran at half speed while the other's did not
    (its median over 5 samples 50 against 87 GFLOP/s), and the slowest rank's would carry that one
    interruption into every prediction; a step lasts long enough to average such interruptions out."""
    return [v / dist.get_world_size() for v in agree(values, device, op=dist.ReduceOp.SUM)]


def align(device: torch.device) -> None:
    """Start every rank's next sample together (a barrier that needs no device id under NCCL)."""
    dist.all_reduce(torch.zeros(1, device=device))
    sync(device)


def aligned_seconds(fns: Sequence[Callable[[], object]], device: torch.device, *, repeats: int) -> list[float]:
    """Median seconds of each communicating function, every rank starting each sample together, the
    functions' samples taken in turn (so that a drift of the machine's speed meets all of them). One
    call per sample: back to back, gloo's calls on two shared cores each took up to 3x longer than
    alone (its threads' wake-ups queue behind one another), which a job's collectives, spread between
    compute, do not see."""
    samples: list[list[float]] = [[] for _ in fns]
    for turn in range(repeats + 1):  # the first turn warms up
        for fn, taken in zip(fns, samples):
            align(device)
            start = time.perf_counter()
            fn()
            sync(device)
            if turn:
                taken.append(time.perf_counter() - start)
    return [statistics.median(taken) for taken in samples]


def wait_table(device: torch.device, *, segments: Sequence[float], width: int, repeats: int,
               exchange: float) -> WaitTable:
    """The wait at a blocking exchange after each of ``segments`` seconds of compute: ``k`` rounds of
    the segment (square matmuls of ``width``, the device synchronized after them) each followed by a
    one-float all-reduce over the world, timed from its call to its end: what the rank spends in
    it, its own ``exchange`` seconds (its fit, measured with the ranks aligned) and the wait for the
    last rank to arrive. The mean over every round of ``repeats`` turns (the segments in turn) and
    over the ranks, less ``exchange``, never below zero: a step pays the mean of a wait whose
    samples are heavy-tailed. Timed inside the call rather than as rounds with the exchange against
    rounds without it: on this project's VM the difference of two totals swung from 0 to 3.4 ms at
    one segment length between runs a minute apart, the compute's own drift outweighing the wait.
    The segment's length is agreed from one matmul's time, so every rank runs the same rounds."""
    a = torch.randn(width, width, device=device)
    out = torch.empty_like(a)
    (one,) = mean([seconds_per_call(lambda: torch.mm(a, a, out=out), device, repeats=3)], device)
    flag = torch.zeros(1, device=device)
    plans = []
    for segment in segments:
        n = max(1, round(segment / one))
        plans.append((n, max(3, round(WAIT_SAMPLE_S / (n * one)))))
    spent, exchanges = [0.0] * len(plans), [0] * len(plans)
    for turn in range(repeats + 1):  # the first turn warms up
        for i, (n, k) in enumerate(plans):
            align(device)
            for _ in range(k):
                for _ in range(n):
                    torch.mm(a, a, out=out)
                sync(device)
                start = time.perf_counter()
                dist.all_reduce(flag)
                sync(device)
                if turn:
                    spent[i] += time.perf_counter() - start
                    exchanges[i] += 1
    per_exchange = mean([t / c for t, c in zip(spent, exchanges)], device)
    return WaitTable(segments=tuple(n * one for n, _ in plans),
                     waits=tuple(max(w - exchange, 0.0) for w in per_exchange))
