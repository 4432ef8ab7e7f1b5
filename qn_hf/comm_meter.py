"""Counting the calls and bytes of every collective and point-to-point transfer, by group.

A diagnostic for tests, benchmarks and the planner: inside ``with CommMeter(pm) as meter:`` each
communication this thread issues is recorded (group name, operation, payload bytes, time).

Why a dispatch mode rather than wrapping ``torch.distributed`` functions: replacing module attributes
changes them for every thread and library in the process. Every process-group call ends in a
``c10d`` dispatcher op (``c10d.allreduce_``, ``c10d.send``, ...) that a ``TorchDispatchMode`` sees;
the mode is on this thread's mode stack only, and the autograd engine carries it into backward, so
gradient hooks and autograd Functions' backward are counted and other threads are not. Collectives
torch runs internally (the all-gathers of ``dist.all_gather_object``) count as the c10d ops they are.
Every op passes through Python while a meter is active: meter a step, do not time it.

The payload is what this rank hands to the call: the tensor of an all-reduce, broadcast, send or
receive; this rank's input of an all-gather or reduce-scatter; nothing for a barrier. Point-to-point
transfers between pipeline stages are counted on ``"pp"``, those of ring attention on ``"cp"``, the hosts'
per-step exchange (``comm.host_max_``) on ``"host"``; with
cp > 1 gradients are reduced over ``"replicas"`` (the dp x cp ranks holding the same shard). Expert
parallelism's all-to-alls are on ``"ep"`` (the payload is this rank's whole input, the rows it keeps
included) and the experts' gradient sums on ``"experts"``. Sharded data parallelism's all-gathers and
reduce-scatters (FSDP's) are on ``"dp_shard"``, and under hybrid sharding its all-reduce of the
reduced shards across the groups on ``"dp_replicate"``.
"""

from __future__ import annotations

import time
from collections import defaultdict
from dataclasses import dataclass
from typing import Any, Protocol

import torch
import torch.distributed as dist
from torch.distributed import ProcessGroup
from torch.utils._python_dispatch import TorchDispatchMode

from .arguments import Choice
from .config.layout import GroupRole


class Collective(Choice):
    """The operations the meter reports, named as the ``torch.distributed`` functions are; the
    planner counts its estimates under the same members, so the two compare key for key. A member
    equals (and hashes as) its string."""

    ALL_REDUCE = "all_reduce"
    BROADCAST = "broadcast"
    ALL_GATHER = "all_gather"
    ALL_GATHER_INTO_TENSOR = "all_gather_into_tensor"
    REDUCE_SCATTER_TENSOR = "reduce_scatter_tensor"
    ALL_TO_ALL_SINGLE = "all_to_all_single"
    REDUCE = "reduce"
    BARRIER = "barrier"
    SEND = "send"
    RECV = "recv"


# c10d op name -> the operation reported; an op not listed keeps its c10d name.
_OPS = {
    "allreduce_": Collective.ALL_REDUCE, "broadcast_": Collective.BROADCAST, "allgather_": Collective.ALL_GATHER,
    "_allgather_base_": Collective.ALL_GATHER_INTO_TENSOR, "_reduce_scatter_base_": Collective.REDUCE_SCATTER_TENSOR,
    "barrier": Collective.BARRIER, "send": Collective.SEND, "recv_": Collective.RECV, "recv_any_source_": Collective.RECV,
    "reduce_": Collective.REDUCE, "alltoall_base_": Collective.ALL_TO_ALL_SINGLE,
    # torch's functional collectives (torch.ops._c10d_functional: comm.py's, and what torch.compile runs)
    "all_reduce_": Collective.ALL_REDUCE, "all_gather_into_tensor_out": Collective.ALL_GATHER_INTO_TENSOR,
}
# Namespaces of the ops that communicate: c10d's, and the functional collectives', which call c10d's
# below the dispatch mode (so these are seen instead, not as well).
_NAMESPACES = {"c10d", "_c10d_functional", "_c10d_functional_autograd"}
_P2P = {"send", "recv_", "recv_any_source_"}
_NO_PAYLOAD = {"barrier", "monitored_barrier_"}  # their tensor argument is a dummy the call makes


class _Groups(Protocol):  # what the meter reads of a ParallelModel's groups (mesh.Groups)
    def of(self, role: GroupRole) -> ProcessGroup | None: ...


class HasGroups(Protocol):  # all the meter reads of a ParallelModel
    @property
    def groups(self) -> _Groups: ...


@dataclass(frozen=True)
class CommEvent:
    group: str
    op: Collective | str  # a c10d op the meter does not name keeps its own name
    nbytes: int
    numel: int
    time: float


@dataclass(frozen=True)
class CommTotal:
    calls: int
    nbytes: int


def _tensors(value: Any) -> list[torch.Tensor]:  # c10d ops take tensors, lists, lists of lists
    if isinstance(value, torch.Tensor):
        return [value]
    if isinstance(value, (list, tuple)):
        return [t for v in value for t in _tensors(v)]
    return []


class _Recorder(TorchDispatchMode):
    """Passes every op through; reports each c10d op that takes a process group to the meter."""

    def __init__(self, meter: CommMeter) -> None:
        super().__init__()
        self.meter = meter

    def __torch_dispatch__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        if func.namespace in _NAMESPACES:
            self.meter._record(func, args, kwargs or {})
        return func(*args, **(kwargs or {}))


class CommMeter:
    """Records the communication this thread (and its backward passes) issues while active.

    Not reentrant: one ``with`` at a time per meter (distinct meters may nest, each records it all).
    """

    def __init__(self, pm: HasGroups) -> None:
        # every group by its role's name, in GroupRole's order (the gradient sum first: at cp=1 it is the dp group,
        # which keeps the name dp)
        named = {role.value: pm.groups.of(role) for role in GroupRole}
        # By name, as the dispatcher hands over a boxed group, not the Python object. A named group
        # that is the default group (a mesh dim spanning the world) is reported by its name.
        self._names = {group.group_name: n for n, group in named.items() if group is not None}
        self.events: list[CommEvent] = []
        self._mode: _Recorder | None = None

    def _record(self, func: Any, args: tuple, kwargs: dict) -> None:
        schema = func._schema.arguments
        values = {**{a.name: v for a, v in zip(schema, args)}, **kwargs}
        boxed = [values.get(a.name) for a in schema if str(a.type).endswith("c10d.ProcessGroup")]
        if boxed:
            name = self._group_name(ProcessGroup.unbox(boxed[0]).group_name)
        elif isinstance(values.get("group_name"), str):  # a functional collective names its group
            name = self._group_name(values["group_name"])
        else:  # not a communication (c10d.check_for_nan, _c10d_functional.wait_tensor)
            return
        op = func._opname
        if op in _P2P and name not in (GroupRole.SEQUENCE, GroupRole.HOST):  # pipeline links: a group of their own each
            name = GroupRole.STAGES.value
        # This rank's input: the "input*" arguments of gathers/scatters, else the in-place "tensors".
        inputs = [a.name for a in schema if a.name.startswith("input")]
        inputs = inputs or [a.name for a in schema if a.name in ("tensors", "tensor")]
        payload = [] if op in _NO_PAYLOAD else [t for n in inputs for t in _tensors(values.get(n))]
        self.events.append(CommEvent(
            group=name, op=_OPS.get(op, op), nbytes=sum(t.numel() * t.element_size() for t in payload),
            numel=sum(t.numel() for t in payload), time=time.perf_counter(),
        ))

    def _group_name(self, group_name: str) -> str:
        world = dist.group.WORLD
        is_world = world is not None and group_name == world.group_name
        return self._names.get(group_name, "world" if is_world else "other")

    def __enter__(self) -> CommMeter:
        if self._mode is not None:
            raise RuntimeError("this CommMeter is already active")
        self._mode = _Recorder(self)
        self._mode.__enter__()
        return self

    def __exit__(self, *exc: object) -> None:
        mode, self._mode = self._mode, None
        if mode is not None:
            mode.__exit__(*exc)

    def totals(self) -> dict[tuple[str, str], CommTotal]:
        """(group, op) -> calls and bytes."""
        calls: dict[tuple[str, str], int] = defaultdict(int)
        nbytes: dict[tuple[str, str], int] = defaultdict(int)
        for e in self.events:
            calls[(e.group, e.op)] += 1
            nbytes[(e.group, e.op)] += e.nbytes
        return {k: CommTotal(calls=calls[k], nbytes=nbytes[k]) for k in sorted(calls)}

    def table(self) -> str:
        rows = [f"{'group':<6}{'op':<24}{'calls':>8}{'bytes':>16}"]
        rows += [f"{g:<6}{op:<24}{t.calls:>8}{t.nbytes:>16,}" for (g, op), t in self.totals().items()]
        return "\n".join(rows)
