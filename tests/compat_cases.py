"""Jobs that run inside test worlds with torch.distributed as torch 2.11 has it (qn_hf/compat.py's
fallbacks forced on the installed torch): every rank, for the duration of the job only."""

from __future__ import annotations

import warnings
from collections import Counter
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import torch.distributed as dist

# torch 2.13's names -> the names torch 2.11 has for the same collectives
RENAMED = {"all_gather_single": "all_gather_into_tensor", "reduce_scatter_single": "reduce_scatter_tensor"}


@contextmanager
def torch_2_11_collectives(*, native_zero: bool) -> Iterator[Counter]:
    """``torch.distributed`` without the collectives torch 2.13 added; the old names count their
    calls (the yielded counter) and keep quiet about their deprecation where torch 2.13 runs them.
    ``native_zero``: report the groups' backend as NCCL, so that ZeRO-1's buckets issue their
    reduce-scatter and all-gather (on gloo they take one reduce or broadcast per owner instead,
    buckets.py) and the fallbacks carry the sharded optimizer; gloo runs both collectives itself."""
    calls: Counter = Counter()
    removed = {new: getattr(dist, new) for new in RENAMED if hasattr(dist, new)}
    old = {name: getattr(dist, name) for name in RENAMED.values()}
    backend = dist.get_backend

    def counted(name: str, fn: Callable) -> Callable:
        def call(*args: Any, **kwargs: Any):
            calls[name] += 1
            with warnings.catch_warnings():
                warnings.simplefilter("ignore", FutureWarning)
                return fn(*args, **kwargs)

        return call

    for new in removed:
        delattr(dist, new)
    for name, fn in old.items():
        setattr(dist, name, counted(name, fn))
    if native_zero:
        dist.get_backend = lambda group=None: "nccl"
    try:
        yield calls
    finally:
        dist.get_backend = backend
        for name, fn in old.items():
            setattr(dist, name, fn)
        for new, fn in removed.items():
            setattr(dist, new, fn)


def on_torch_2_11(*, inner: Callable[..., dict], native_zero: bool = False, **kwargs: Any) -> dict:
    """``inner(**kwargs)`` (a job of the world) with torch 2.11's collectives; its result with the calls of
    each fallback collective under ``"fallback_calls"``."""
    with torch_2_11_collectives(native_zero=native_zero) as calls:
        out = inner(**kwargs)
    return {**out, "fallback_calls": dict(calls)}


def collective_results() -> dict:
    """compat's all-gather and reduce-scatter on small tensors (checked against a hand computation),
    with torch's deprecation warnings as errors: where the installed torch has the 2.13 names, compat
    calls them, not the deprecated old ones."""
    import torch

    from qn_hf.compat import all_gather_single, reduce_scatter_single

    rank, size = dist.get_rank(), dist.get_world_size()
    with warnings.catch_warnings():
        warnings.simplefilter("error", FutureWarning)
        gathered = torch.empty(2 * size)
        all_gather_single(gathered, torch.tensor([rank, 10.0 * rank]), group=dist.group.WORLD)
        piece = torch.empty(1)
        work = reduce_scatter_single(piece, torch.arange(float(size)) + rank, group=dist.group.WORLD, async_op=True)
        work.wait()
    return {"gathered": gathered.tolist(), "piece": piece.item(), "rank": rank, "size": size}


def fsdp_groups_both_ways(*, model_dir: str) -> dict:
    """After a step at dp=2 x dp_shard=2: every FSDP state's parameter groups as compat reads them on
    the installed torch, and as it reads them from torch 2.11's form (one optional group per state)."""
    from types import SimpleNamespace

    from torch.distributed.fsdp import FSDPModule, fully_shard

    import qn_hf
    from qn_hf.data_parallel.fsdp_internals import fsdp_param_groups
    from tests.cases import mesh_for
    from tests.models import dp_slice, load, make_batch

    pm = qn_hf.parallelize(load("llama", model_dir), dp=2, dp_shard=2, mesh=mesh_for(2, 1))
    pm.train_step(dp_slice(make_batch("llama", size=4, seed=1), dp=2, dp_rank=pm.coords["dp"]))
    root = next(m for m in pm.module.modules() if isinstance(m, FSDPModule))
    states = fully_shard.state(root)._state_ctx.all_states
    installed = [fsdp_param_groups(state) for state in states]
    older = [fsdp_param_groups(SimpleNamespace(_fsdp_param_group=state._fsdp_param_group)) for state in states]
    return {"states": len(states), "groups": sum(map(len, installed)), "same": installed == older}
