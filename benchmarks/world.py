"""Starting a world of gloo ranks for a benchmark, one place for the set-up all of them share.

Each rank gets ``cores // world`` intra-op threads (``qn_hf.local_world``): oversubscribed cores make
every distributed number meaningless (torch DDP ran 11x slower here that way).
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import torch
import torch.distributed as dist

from qn_hf.local_world import LocalWorld, threads_per_rank

__all__ = ["StepPeak", "alternating_medians", "benchmark_parser", "median_step_seconds", "reset_high_water", "run_world",
           "save_tiny_llama", "status_kib", "storage_bytes", "threads_per_rank"]
BENCHMARK_TIMEOUT_S = 3600.0


def _call(body: Callable, extra: tuple) -> object:
    return body(dist.get_rank(), dist.get_world_size(), *extra)


def run_world(body: Callable, *, world: int, extra: tuple = ()) -> object:
    """Run ``body(rank, world, *extra)`` on ``world`` fresh ranks (qn_hf's launcher, the one the tests
    and qn-hf-check use); return rank 0's result."""
    with LocalWorld(world, collective_timeout=BENCHMARK_TIMEOUT_S) as ranks:
        return ranks.run(_call, timeout=BENCHMARK_TIMEOUT_S, body=body, extra=extra)[0]


def storage_bytes(tensors) -> int:
    """Bytes of the distinct storages behind ``tensors`` (views of one buffer counted once)."""
    seen, total = set(), 0
    for t in tensors:
        key = t.untyped_storage().data_ptr()
        if key not in seen:
            seen.add(key)
            total += t.untyped_storage().nbytes()
    return total


def benchmark_parser(doc: str, *, steps: int) -> argparse.ArgumentParser:
    """The options every alternating-rounds benchmark takes: ``--rounds`` and ``--steps``."""
    parser = argparse.ArgumentParser(description=doc, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--steps", type=int, default=steps)
    return parser


def alternating_medians(body: Callable, runs, *, world: int, rounds: int, extra: Callable[[str], tuple]) -> dict:
    """Each of ``runs`` timed ``rounds`` times, the runs alternating within each round (so a machine's
    drift hits all alike): ``body(rank, world, *extra(run))`` returns rank 0's seconds; the median per run."""
    times = {run: [] for run in runs}
    for _ in range(rounds):
        for run in runs:
            times[run].append(run_world(body, world=world, extra=extra(run)))
    return {run: statistics.median(values) for run, values in times.items()}


def median_step_seconds(step: Callable[[int], None], *, steps: int) -> float:
    """``step(0)`` as a warm-up, then the median wall time of ``step(1..steps)``, every rank starting
    each together (a barrier before it)."""
    step(0)
    times = []
    for n in range(steps):
        dist.barrier()
        start = time.perf_counter()
        step(n + 1)
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def status_kib(field: str) -> int:
    """A field of this process's /proc/self/status in KiB (``VmRSS``: resident now; ``VmHWM``: its high-water
    mark since the last ``reset_high_water``)."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1])
    raise RuntimeError(f"/proc/self/status has no {field}")


def reset_high_water() -> None:
    """VmHWM := VmRSS. With ``MALLOC_MMAP_THRESHOLD_`` low in the ranks' environment (set before they start)
    freed tensors go back to the system, so the mark follows the tensors alive, kernels' scratch included."""
    Path("/proc/self/clear_refs").write_text("5")


def save_tiny_llama(config: dict, *, prefix: str) -> str:
    """A Llama of ``config`` with seeded random weights, saved to a new temporary directory."""
    from transformers import AutoConfig, AutoModelForCausalLM

    path = tempfile.mkdtemp(prefix=prefix)
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(AutoConfig.for_model("llama", **config)).save_pretrained(path)
    return path


class StepPeak:
    """The most bytes a step holds above what was held before it, after any op: every storage an op
    made during the step and still alive (``LiveAllocations``: activations, gradients, an all-gather's
    output) plus the model's parameters that are plain tensors at that moment (FSDP swaps a gathered
    parameter in whole, into a storage it made at its first step and resizes, which no op of this
    step made; parameters already plain before the step are held, not counted), each storage once.
    Use as ``with StepPeak(model) as peak: step()``; ``peak.bytes``."""

    def __init__(self, model: torch.nn.Module) -> None:
        from torch.distributed.tensor import DTensor

        from qn_hf.memory.live_allocations import LiveAllocations, storage_now

        outer = self
        self.model, self.bytes, self.before = model, 0, set()

        class Sampled(LiveAllocations):
            def __torch_dispatch__(self, func, types, args=(), kwargs=None):
                out = super().__torch_dispatch__(func, types, args, kwargs)
                held = dict(filter(None, map(storage_now, self.alive_storages())))  # address -> bytes
                for p in model.parameters():
                    if not isinstance(p, DTensor) and p.untyped_storage().data_ptr() not in outer.before:
                        held.setdefault(p.untyped_storage().data_ptr(), p.untyped_storage().nbytes())
                outer.bytes = max(outer.bytes, sum(held.values()))
                return out

        self.mode = Sampled()

    def __enter__(self) -> StepPeak:
        from torch.distributed.tensor import DTensor

        self.before = {p.untyped_storage().data_ptr() for p in self.model.parameters() if not isinstance(p, DTensor)}
        self.mode.__enter__()
        return self

    def __exit__(self, *exc) -> None:
        self.mode.__exit__(*exc)
