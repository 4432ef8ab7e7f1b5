"""Persistent multi-process gloo worlds for tests, on qn_hf's own launcher (``qn_hf.local_world``).

A world of N ranks is started once per test session and runs many jobs: module-level functions that
every rank calls with the same keyword arguments (``worlds.run(2, cases.parity, model="gpt2", ...)``).
Each rank runs one intra-op thread. After every job the job's process groups are released
(``_release_groups``), so a worker that ran hundreds of jobs holds no more threads than a fresh one.
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from typing import Any

from qn_hf.local_world import LocalWorld


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


class Worlds:
    """One live ``LocalWorld`` per size, started on first use and replaced when a job broke it."""

    def __init__(self) -> None:
        self._worlds: dict[int, LocalWorld] = {}

    def run(self, size: int, job: Callable[..., Any], **kwargs: Any) -> list[Any]:
        world = self._worlds.get(size)
        if world is None or not world.alive:
            world = self._worlds[size] = LocalWorld(size, threads=1, after_job=_release_groups)
        return world.run(job, **kwargs)

    def close(self) -> None:
        for world in self._worlds.values():
            world.close()
