"""Worlds of local gloo ranks that run jobs: the one launcher the tests, the benchmarks and
``qn-hf-check`` share.

Starting processes and importing torch and transformers costs seconds per rank on a small machine, so
a ``LocalWorld`` of N ranks is started once and runs many jobs. A job is a module-level function
(sent by reference, so its module must be importable by the ranks); every rank calls it with the same
keyword arguments and the per-rank return values come back in rank order. A job that fails or hangs
on any rank tears the world down (its ranks may be stuck in a collective) and raises ``WorldFailure``
naming the ranks and their tracebacks.

Each rank gets ``threads`` intra-op threads (default: the cores divided among the ranks, at least one):
oversubscribed cores make every distributed number meaningless (torch DDP ran 11x slower that way).
"""

from __future__ import annotations

import datetime
import multiprocessing as mp
import os
import queue
import socket
import sys
import time
import traceback
from collections.abc import Callable
from typing import Any

JOB_TIMEOUT_S = 180.0
COLLECTIVE_TIMEOUT_S = 120.0
PARENT_POLL_S = 5.0  # how often an idle rank checks that its launcher still lives


class WorldFailure(AssertionError):
    """A job failed or did not finish on some rank (an AssertionError, so a test reports it as one)."""


def free_local_port() -> int:
    """A TCP port on 127.0.0.1 that nothing listens on now (for a local process group's rendezvous)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def threads_per_rank(size: int) -> int:
    return max(1, (os.cpu_count() or 1) // size)


def _worker(rank: int, size: int, port: int, jobs, results, path: list[str], threads: int,
            collective_timeout: float, after_job: Callable[[], None] | None) -> None:
    sys.path[:] = path
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(size),
                      LOCAL_RANK=str(rank), LOCAL_WORLD_SIZE=str(size))
    import torch
    import torch.distributed as dist
    import transformers

    torch.set_num_threads(threads)
    transformers.logging.set_verbosity_error()
    transformers.logging.disable_progress_bar()
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=collective_timeout))
    parent = os.getppid()
    while True:
        try:
            job = jobs.get(timeout=PARENT_POLL_S)
        except queue.Empty:
            if os.getppid() != parent:  # the launcher died without closing the world (killed): so do we
                os._exit(1)
            continue
        if job is None:
            break
        function, kwargs = job
        try:
            value = function(**kwargs)
            if after_job is not None:
                after_job()
            results.put((rank, True, value))
        except BaseException:  # noqa: BLE001 - report everything, including assertion errors
            results.put((rank, False, traceback.format_exc()))
    dist.destroy_process_group()


class LocalWorld:
    """``size`` local ranks joined in one gloo process group, waiting for jobs. ``after_job`` (a
    module-level function) runs on every rank after each job that succeeded, before its result is
    sent back (the tests release the job's process groups there)."""

    def __init__(self, size: int, *, threads: int | None = None, collective_timeout: float = COLLECTIVE_TIMEOUT_S,
                 after_job: Callable[[], None] | None = None) -> None:
        ctx = mp.get_context("spawn")
        self.size = size
        self.results = ctx.Queue()
        self.jobs = [ctx.Queue() for _ in range(size)]
        port = free_local_port()
        threads = threads_per_rank(size) if threads is None else threads
        self.procs = [ctx.Process(target=_worker, daemon=True,
                                  args=(r, size, port, self.jobs[r], self.results, list(sys.path), threads,
                                        collective_timeout, after_job))
                      for r in range(size)]
        for p in self.procs:
            p.start()
        self.alive = True

    def run(self, function: Callable[..., Any], *, timeout: float = JOB_TIMEOUT_S, **kwargs: Any) -> list[Any]:
        """``function(**kwargs)`` on every rank; the return values in rank order."""
        for q in self.jobs:
            q.put((function, kwargs))
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
            name = f"{function.__module__}:{function.__qualname__}"
            raise WorldFailure(f"{name} failed on ranks {sorted(errors)}; unfinished on ranks {missing}\n{report}")
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

    def __enter__(self) -> LocalWorld:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
