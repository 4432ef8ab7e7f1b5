"""Storages a forward allocates, counted by a ``TorchDispatchMode``: what the planner's trace keeps
alive for backward (trace.py) and the ops and bytes it prices (``Trace.ops``; ``count_ops`` for the
calibration's timings of the same ops, compute_timing.py)."""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Callable, Iterator

import torch
from torch.multiprocessing.reductions import StorageWeakRef
from torch.utils._python_dispatch import TorchDispatchMode

from .kernels import COMPUTE_OPS


def tensors(value) -> list[torch.Tensor]:
    """The strided tensors in ``value``: an op's arguments or results (tensors, alone or in lists,
    tuples and dicts), or a model's outputs as a tuple. Walked by hand: ``tree_flatten`` is a third
    of a trace's time, as every op of the forward passes through here twice."""
    if isinstance(value, torch.Tensor):
        return [value] if value.layout == torch.strided else []
    if isinstance(value, (list, tuple)):
        return [t for v in value for t in tensors(v)]
    if isinstance(value, dict):
        return [t for v in value.values() for t in tensors(v)]
    return []


class Allocations(TorchDispatchMode):
    """Every storage an op allocates while active, with the module that was running, held weakly.
    A storage first met as an op's input existed before (a weight, the input ids) and never counts.
    Also counts, per owner, the ops that wrote a new storage and the bytes written (``Trace.ops``)."""

    def __init__(self, owner) -> None:
        super().__init__()
        self._owner = owner  # -> a key for the allocations made now
        self._known: dict[int, StorageWeakRef] = {}
        self._allocated: list[tuple[StorageWeakRef, int, object]] = []
        self.ops: dict[object, list[int]] = defaultdict(lambda: [0, 0])  # owner -> [ops, bytes written]

    def _first_sight(self, t: torch.Tensor) -> StorageWeakRef | None:
        ref = StorageWeakRef(t.untyped_storage())
        known = self._known.get(ref.cdata)
        if known is not None and not known.expired():
            return None
        self._known[ref.cdata] = ref  # a new storage (possibly at a freed one's address)
        return ref

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        for t in tensors((args, kwargs)):
            self._first_sight(t)
        out = func(*args, **kwargs)
        written = 0
        for t in tensors(out):
            ref = self._first_sight(t)
            if ref is not None:
                self._allocated.append((ref, t.untyped_storage().nbytes(), self._owner()))
                written += t.untyped_storage().nbytes()
        if written:  # a view or an in-place op on a known storage allocates nothing
            count = self.ops[self._owner()]
            count[0] += 1
            count[1] += 0 if func._overloadpacket.__name__ in COMPUTE_OPS else written
        return out

    def alive(self) -> dict[object, int]:
        """Bytes still alive, by the owner key they were allocated under."""
        out: dict[object, int] = defaultdict(int)
        for _, nbytes, owner in self.held():
            out[owner] += nbytes
        return out

    def held(self) -> Iterator[tuple[int, int, object]]:
        """The storages still alive: each one's weak reference's ``cdata``, its bytes and its owner key."""
        for ref, nbytes, owner in self._allocated:
            if not ref.expired():
                yield ref.cdata, nbytes, owner


def count_ops(fn: Callable[[], object]) -> tuple[int, int]:
    """The ops ``fn`` runs that write a new storage, and the bytes those other than the products
    write: what ``Trace.ops`` counts of a forward (for the calibration's timings of the same)."""
    counter = Allocations(lambda: None)
    with counter:
        fn()
    ops, nbytes = counter.ops[None]
    return ops, nbytes
