"""Counting the calls and bytes of every collective and point-to-point transfer, by group.

A diagnostic for tests, benchmarks and the planner: inside ``with CommMeter(pm) as meter:`` the
``torch.distributed`` functions qn_hf calls are wrapped to record each call (group name, operation,
payload bytes, time), then restored. The payload is the tensor handed to the call (for an
all-gather, this rank's contribution). Point-to-point transfers only run between pipeline stages
and are counted on ``"pp"``.
"""

from __future__ import annotations

import functools
import time
from collections import defaultdict
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist

if TYPE_CHECKING:
    from .parallel_model import ParallelModel

_COLLECTIVES = ("all_reduce", "broadcast", "all_gather", "all_gather_into_tensor", "reduce_scatter_tensor", "barrier")
_P2P = ("isend", "irecv", "send", "recv")


@dataclass(frozen=True)
class CommEvent:
    group: str
    op: str
    nbytes: int
    numel: int
    time: float


@dataclass(frozen=True)
class CommTotal:
    calls: int
    nbytes: int


def _payload(op: str, args: tuple, kwargs: dict) -> torch.Tensor | None:
    if op == "barrier":
        return None
    if op == "all_gather":
        return args[1] if len(args) > 1 else kwargs["tensor"]
    if op == "all_gather_into_tensor":
        return args[1] if len(args) > 1 else kwargs["input_tensor"]
    if op == "reduce_scatter_tensor":
        return args[1] if len(args) > 1 else kwargs["input"]
    return args[0] if args else kwargs.get("tensor")


class CommMeter:
    """Records communication of ``pm``'s groups while active (not reentrant, one per process)."""

    def __init__(self, pm: ParallelModel) -> None:
        named = {"dp": pm.groups.dp, "tp": pm.groups.tp, "pp": pm.groups.pp, "kv": pm.groups.kv, "tie": pm.groups.tie}
        self._names = {id(g): n for n, g in named.items() if g is not None}
        self.events: list[CommEvent] = []
        self._saved: dict[str, object] = {}

    def _wrap(self, op: str, fn):
        @functools.wraps(fn)
        def recorded(*args, **kwargs):
            group = kwargs.get("group")
            name = "pp" if op in _P2P else self._names.get(id(group), "world" if group is None else "other")
            t = _payload(op, args, kwargs)
            nbytes = 0 if t is None else t.numel() * t.element_size()
            numel = 0 if t is None else t.numel()
            self.events.append(CommEvent(group=name, op=op.lstrip("i"), nbytes=nbytes, numel=numel, time=time.perf_counter()))
            return fn(*args, **kwargs)

        return recorded

    def __enter__(self) -> CommMeter:
        for op in _COLLECTIVES + _P2P:
            self._saved[op] = getattr(dist, op)
            setattr(dist, op, self._wrap(op, self._saved[op]))
        return self

    def __exit__(self, *exc) -> None:
        for op, fn in self._saved.items():
            setattr(dist, op, fn)
        self._saved.clear()

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
