"""``CommMeter``: what it counts (group, op, bytes, including in backward), and that it is scoped to
the thread that entered it without replacing any ``torch.distributed`` function."""

from __future__ import annotations

import threading
import time
from types import SimpleNamespace

import torch
import torch.distributed as dist

import qn_hf

_GROUPS: dict[str, object] = {}


def _meter_target() -> SimpleNamespace:
    """An object exposing ``.groups`` like a ParallelModel, with distinct groups over both ranks."""
    if not _GROUPS:  # new_group is collective: every rank creates them, once per worker
        for name in ("dp", "tp", "pp", "tie", "ep", "other"):
            _GROUPS[name] = dist.new_group([0, 1])
    g = _GROUPS
    by_role = dict(replicas=g["dp"], dp=g["dp"], tp=g["tp"], pp=g["pp"], tie=g["tie"], ep=g["ep"])
    return SimpleNamespace(groups=SimpleNamespace(of=lambda role: by_role.get(role.value)))


def _rows(events) -> list[tuple]:
    return [(e.group, e.op, e.nbytes, e.numel) for e in events]


class _AllReduceBackward(torch.autograd.Function):
    """Identity forward, all-reduce backward (as tensor-parallel layers do)."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, group) -> torch.Tensor:
        ctx.group = group
        return x.clone()

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        grad = grad.contiguous()
        dist.all_reduce(grad, group=ctx.group)
        return grad, None


def case_ops() -> dict:
    pm = _meter_target()
    g = _GROUPS
    rank = dist.get_rank()
    out: dict = {}
    outside_fn = dist.all_reduce
    with qn_hf.CommMeter(pm) as meter:
        out["same all_reduce"] = dist.all_reduce is outside_fn
        out["same send"] = dist.isend is dist.distributed_c10d.isend
        start = time.perf_counter()
        x = torch.full((5,), float(rank + 1))
        dist.all_reduce(x, group=g["dp"])
        out["all_reduce value"] = x.tolist()
        dist.broadcast(torch.arange(3), src=0, group=g["tp"])
        parts = [torch.empty(4) for _ in range(2)]
        dist.all_gather(parts, torch.full((4,), float(rank)), group=g["tie"])
        out["all_gather value"] = [p.tolist() for p in parts]
        dist.all_gather_into_tensor(torch.empty(6), torch.ones(3), group=g["pp"])
        dist.reduce_scatter_tensor(torch.empty(4), torch.ones(8), group=g["dp"])
        dist.barrier()
        dist.barrier(group=g["other"])
        dist.all_reduce(torch.ones(2, dtype=torch.float64))  # default group
        dist.all_to_all_single(torch.empty(4), torch.ones(4), group=g["ep"])  # expert parallelism's token exchange
        gathered = [torch.empty(2), torch.empty(2)] if rank == 0 else None
        dist.gather(torch.ones(2), gather_list=gathered, dst=0, group=g["other"])  # not mapped: keeps its c10d name
        # point-to-point on the default group: still "pp"
        if rank == 0:
            dist.send(torch.ones(6, dtype=torch.float64), dst=1)
            dist.isend(torch.ones(2, dtype=torch.int32), dst=1).wait()
        else:
            dist.recv(torch.empty(6, dtype=torch.float64), src=0)
            dist.irecv(torch.empty(2, dtype=torch.int32), src=0).wait()
        out["forward"] = _rows(meter.events)
        out["times within"] = all(start <= e.time <= time.perf_counter() for e in meter.events)
        out["times ordered"] = [e.time for e in meter.events] == sorted(e.time for e in meter.events)

        # Backward: an autograd Function's backward and a gradient hook, both on the autograd engine.
        n = len(meter.events)
        w = torch.ones(7, requires_grad=True)
        w.register_hook(lambda grad: dist.all_reduce(grad.clone(), group=g["tp"]))
        (_AllReduceBackward.apply(w * 2, g["dp"]) * float(rank + 1)).sum().backward()
        out["grad"] = w.grad.tolist()
        out["backward"] = _rows(meter.events[n:])

        # Another thread, while the meter is active here: its collective must not be recorded.
        n = len(meter.events)
        result = {}

        def other_thread() -> None:
            t = torch.ones(11)
            dist.all_reduce(t, group=g["other"])
            result["value"] = t.tolist()

        thread = threading.Thread(target=other_thread)
        thread.start()
        thread.join()
        out["thread ran"] = result.get("value") == [2.0] * 11
        out["thread recorded"] = _rows(meter.events[n:])
    n = len(meter.events)
    dist.all_reduce(torch.ones(3), group=g["dp"])
    dist.barrier()
    out["after exit"] = len(meter.events) - n
    out["same after"] = dist.all_reduce is outside_fn
    out["totals"] = {k: (t.calls, t.nbytes) for k, t in meter.totals().items()}
    out["table"] = meter.table()
    return out


def test_counts_each_op_by_group_forward_and_backward(worlds):
    results = worlds.run(2, case_ops)
    for rank, r in enumerate(results):
        assert r["same all_reduce"] and r["same send"] and r["same after"], r  # nothing patched
        assert r["all_reduce value"] == [3.0] * 5 and r["all_gather value"] == [[0.0] * 4, [1.0] * 4]
        p2p = "send" if rank == 0 else "recv"
        assert r["forward"] == [
            ("dp", "all_reduce", 20, 5),
            ("tp", "broadcast", 24, 3),
            ("tie", "all_gather", 16, 4),  # this rank's contribution, not the gathered list
            ("pp", "all_gather_into_tensor", 12, 3),
            ("dp", "reduce_scatter_tensor", 32, 8),  # the input
            ("world", "barrier", 0, 0),
            ("other", "barrier", 0, 0),
            ("world", "all_reduce", 16, 2),
            ("ep", "all_to_all_single", 16, 4),
            ("other", "gather_", 8, 2),
            ("pp", p2p, 48, 6),  # on the default group
            ("pp", p2p, 8, 2),  # isend / irecv
        ], (rank, r["forward"])
        assert r["times within"] and r["times ordered"], r
        # backward: Function.backward all-reduces on dp (grads 1 and 2 -> 3), then the hook on tp
        assert r["backward"] == [("dp", "all_reduce", 28, 7), ("tp", "all_reduce", 28, 7)], (rank, r["backward"])
        assert r["grad"] == [6.0] * 7, r
        assert r["thread ran"] and r["thread recorded"] == [], r
        assert r["after exit"] == 0, r
        assert r["totals"][("dp", "all_reduce")] == (2, 48) and list(r["totals"]) == sorted(r["totals"]), r["totals"]
        assert r["table"].splitlines()[0].split() == ["group", "op", "calls", "bytes"]
        assert "dp    all_reduce                     2              48" in r["table"], r["table"]


def case_object_collective() -> dict:
    """A documented difference to patching ``torch.distributed``: torch-internal collectives count."""
    with qn_hf.CommMeter(_meter_target()) as meter:
        gathered = [None, None]
        dist.all_gather_object(gathered, {"rank": dist.get_rank()})
    return {"gathered": gathered, "ops": sorted({(e.group, e.op) for e in meter.events})}


def test_object_collective_is_seen_as_its_tensor_collectives(worlds):
    for r in worlds.run(2, case_object_collective):
        assert r["gathered"] == [{"rank": 0}, {"rank": 1}]
        assert r["ops"] == [("world", "all_gather")], r
