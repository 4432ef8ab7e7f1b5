"""Starting a world of gloo ranks for a benchmark, one place for the set-up all of them share.

Each rank gets ``cores // world`` intra-op threads (``qn_hf.local_world``): oversubscribed cores make
every distributed number meaningless (torch DDP ran 11x slower here that way).
"""

from __future__ import annotations

from collections.abc import Callable

import torch.distributed as dist

from qn_hf.local_world import LocalWorld, threads_per_rank

__all__ = ["run_world", "storage_bytes", "threads_per_rank"]
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
