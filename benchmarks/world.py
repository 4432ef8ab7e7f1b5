"""Starting a world of gloo ranks for a benchmark, one place for the set-up all of them share.

Each rank gets ``cores // world`` intra-op threads: oversubscribed cores make every distributed
number meaningless (torch DDP ran 11x slower here that way).
"""

from __future__ import annotations

import datetime
import os
import socket
from collections.abc import Callable

import torch
import torch.distributed as dist
import torch.multiprocessing as mp


def _entry(rank: int, body: Callable, world: int, port: int, extra: tuple, results) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank))
    torch.set_num_threads(threads_per_rank(world))
    import transformers

    transformers.logging.set_verbosity_error()
    transformers.logging.disable_progress_bar()
    dist.init_process_group("gloo", timeout=datetime.timedelta(minutes=10))
    out = body(rank, world, *extra)
    if rank == 0:
        results.put(out)
    dist.destroy_process_group()


def threads_per_rank(world: int) -> int:
    return max(1, (os.cpu_count() or 1) // world)


def run_world(body: Callable, *, world: int, extra: tuple = ()) -> object:
    """Run ``body(rank, world, *extra)`` on ``world`` fresh ranks; return rank 0's result."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    results = mp.get_context("spawn").SimpleQueue()
    context = mp.spawn(_entry, args=(body, world, port, extra, results), nprocs=world, join=False)
    # Read while the ranks run: a result larger than the pipe's buffer blocks rank 0 in put() until
    # it is read. join() raises if a rank failed.
    out = None
    while True:
        if not results.empty():
            out = results.get()
        if context.join(timeout=0.5):
            break
    return results.get() if out is None else out


def storage_bytes(tensors) -> int:
    """Bytes of the distinct storages behind ``tensors`` (views of one buffer counted once)."""
    seen, total = set(), 0
    for t in tensors:
        key = t.untyped_storage().data_ptr()
        if key not in seen:
            seen.add(key)
            total += t.untyped_storage().nbytes()
    return total
