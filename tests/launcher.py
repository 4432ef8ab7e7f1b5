"""Persistent multi-process gloo worlds for tests.

Starting processes and importing torch and transformers costs seconds per rank on two cores, so a
world of N ranks is started once per test session and runs many jobs. A job is a module-level
function named ``"package.module:function"``; every rank calls it with the same keyword arguments
and the per-rank return values come back in rank order. A job that fails or hangs on any rank tears
the world down (its ranks may be stuck in a collective) and the next job starts a fresh one.
"""

from __future__ import annotations

import datetime
import importlib
import multiprocessing as mp
import os
import queue
import socket
import sys
import time
import traceback
from typing import Any

JOB_TIMEOUT_S = 180.0
COLLECTIVE_TIMEOUT_S = 120.0


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _worker(rank: int, size: int, port: int, jobs, results, path: list[str]) -> None:
    sys.path[:] = path
    os.environ.update(
        MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(size),
        LOCAL_RANK=str(rank), LOCAL_WORLD_SIZE=str(size),
    )
    import torch
    import torch.distributed as dist
    import transformers

    torch.set_num_threads(1)
    transformers.logging.set_verbosity_error()
    transformers.logging.disable_progress_bar()
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=COLLECTIVE_TIMEOUT_S))
    while True:
        job = jobs.get()
        if job is None:
            break
        target, kwargs = job
        try:
            module_name, fn_name = target.split(":")
            value = getattr(importlib.import_module(module_name), fn_name)(**kwargs)
            _release_groups()
            results.put((rank, True, value))
        except BaseException:  # noqa: BLE001 - report everything, including assertion errors
            results.put((rank, False, traceback.format_exc()))
    dist.destroy_process_group()


def _release_groups() -> None:
    """Destroy every process group a job created, the world's own excepted. Each gloo group keeps
    three threads (one a TCP event loop that wakes on its own) for as long as it exists, and every
    ``parallelize`` creates a dozen or more; a world that ran a few hundred jobs held over a thousand
    threads per rank and spent most of the two cores in them (the suite ran 3x slower). torch keeps
    no public list of groups: ``_world.pg_map`` is the registry ``new_group`` writes to. The barrier
    first: no rank destroys a group while another may still be receiving on it."""
    import gc

    import torch.distributed as dist
    from torch.distributed import distributed_c10d as c10d

    dist.barrier()
    gc.collect()  # the job's ParallelModel and DeviceMesh hold the groups until collected
    cases = sys.modules.get("tests.cases")  # its meshes live as long as the worker
    kept = {c10d.GroupMember.WORLD, *(cases.mesh_groups() if cases is not None else ())}
    for group in list(c10d._world.pg_map):
        if group not in kept:
            dist.destroy_process_group(group)


class World:
    """``size`` ranks joined in one gloo process group, waiting for jobs."""

    def __init__(self, size: int) -> None:
        ctx = mp.get_context("spawn")
        self.size = size
        self.results = ctx.Queue()
        self.jobs = [ctx.Queue() for _ in range(size)]
        port = _free_port()
        self.procs = [
            ctx.Process(target=_worker, args=(r, size, port, self.jobs[r], self.results, list(sys.path)), daemon=True)
            for r in range(size)
        ]
        for p in self.procs:
            p.start()
        self.alive = True

    def run(self, target: str, *, timeout: float = JOB_TIMEOUT_S, **kwargs: Any) -> list[Any]:
        for q in self.jobs:
            q.put((target, kwargs))
        values: dict[int, Any] = {}
        errors: dict[int, str] = {}
        deadline = time.monotonic() + timeout
        while len(values) + len(errors) < self.size:
            remaining = deadline - time.monotonic()
            if errors:  # the others may be blocked in a collective: give them a moment, no more
                remaining = min(remaining, 5.0)
            if remaining <= 0:
                break
            try:
                rank, ok, value = self.results.get(timeout=min(remaining, 1.0))
            except queue.Empty:
                if any(not p.is_alive() for p in self.procs):  # a rank died without reporting
                    break
                continue
            (values if ok else errors)[rank] = value
        if errors or len(values) < self.size:
            self.close()
            missing = sorted(set(range(self.size)) - set(values) - set(errors))
            report = "\n".join(f"--- rank {r} ---\n{tb}" for r, tb in sorted(errors.items()))
            raise AssertionError(f"{target} failed on ranks {sorted(errors)}; unfinished on ranks {missing}\n{report}")
        return [values[r] for r in range(self.size)]

    def close(self) -> None:
        if not self.alive:
            return
        self.alive = False
        for q in self.jobs:
            q.put(None)
        deadline = time.monotonic() + 10
        for p in self.procs:
            p.join(timeout=max(deadline - time.monotonic(), 0.1))
        for p in self.procs:
            if p.is_alive():
                p.kill()
                p.join()


class Worlds:
    """One live ``World`` per size, started on first use and replaced when a job broke it."""

    def __init__(self) -> None:
        self._worlds: dict[int, World] = {}

    def run(self, size: int, target: str, **kwargs: Any) -> list[Any]:
        world = self._worlds.get(size)
        if world is None or not world.alive:
            world = self._worlds[size] = World(size)
        return world.run(target, **kwargs)

    def close(self) -> None:
        for world in self._worlds.values():
            world.close()
