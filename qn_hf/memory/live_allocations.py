"""Counting the memory an operation allocates and keeps, from the tensors themselves.

``LiveAllocations`` is a dispatch mode: every storage an op creates while it is active is recorded
(a storage an op only reads or writes in place existed before and is not counted), and
``alive_bytes`` sums those still alive. Around a forward, what is alive when its backward starts is
what the backward keeps: autograd's saved tensors, the inputs a checkpointed block holds, selective
recomputation's cache, each storage once, whichever mechanism holds it. The planner's activation
estimates and the memory benchmarks are checked with it; no allocator statistics, so it works on
CPU as on GPU.
"""

from __future__ import annotations

import torch
from torch.multiprocessing.reductions import StorageWeakRef
from torch.utils._python_dispatch import TorchDispatchMode, is_traceable_wrapper_subclass
from torch.utils._pytree import tree_flatten


def _storages(values) -> list[torch.UntypedStorage]:
    # a wrapper subclass (FSDP's DTensor parameters) has no storage of its own: its ops reach this mode
    # again on the plain tensors it wraps, which are counted then
    return [v.untyped_storage() for v in values if isinstance(v, torch.Tensor)
            and not is_traceable_wrapper_subclass(v) and v.untyped_storage().nbytes()]


class LiveAllocations(TorchDispatchMode):
    """Storages allocated by ops while active, and how many of their bytes are still alive (a
    freed address that is reused counts as the new storage). Each storage is filed under the
    ``label`` set when it was made (hooks can set it around modules to attribute memory to them)."""

    def __init__(self) -> None:
        super().__init__()
        self.label = ""
        self._old: dict[int, StorageWeakRef] = {}  # storages first seen as an input: they existed before
        self._new: dict[int, tuple[StorageWeakRef, int, str]] = {}

    def _alive(self, ptr: int) -> bool:
        """Whether a storage recorded at ``ptr`` is still there: alive and not moved, since a storage
        FSDP frees by resizing (a gathered weight) keeps living at another address, or none."""
        new = self._new.get(ptr)
        old = self._old.get(ptr)
        return any(ref is not None and (now := storage_now(ref)) is not None and now[0] == ptr
                   for ref in (new and new[0], old))

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        for t in _storages(tree_flatten((args, kwargs))[0]):
            if not self._alive(t.data_ptr()):
                self._old[t.data_ptr()] = StorageWeakRef(t)
        out = func(*args, **kwargs)
        for t in _storages(tree_flatten(out)[0]):
            if not self._alive(t.data_ptr()):
                self._new[t.data_ptr()] = (StorageWeakRef(t), t.nbytes(), self.label)
        return out

    def alive_storages(self, label: str | None = None) -> list[StorageWeakRef]:
        """The storages still alive of those made while active (only those filed under ``label``)."""
        return [ref for ref, _, made in self._new.values() if not ref.expired() and label in (None, made)]

    def alive_bytes(self, label: str | None = None) -> int:
        """Bytes of ``alive_storages``, each at its size now (``storage_bytes``)."""
        return sum(map(storage_bytes, self.alive_storages(label)))


def storage_now(ref: StorageWeakRef) -> tuple[int, int] | None:
    """A storage's address and bytes now, None once freed. Both can change while it lives: FSDP frees a
    gathered weight by resizing its storage to nothing and gathers it again into the same storage.
    One lock of the weak handle (torch's; no public call), so a storage another thread frees
    meanwhile reads as freed."""
    storage = torch.UntypedStorage._new_with_weak_ptr(ref.cdata)
    return None if storage is None else (storage.data_ptr(), storage.nbytes())


def storage_bytes(ref: StorageWeakRef) -> int:
    """A storage's bytes now (``storage_now``), 0 once freed."""
    now = storage_now(ref)
    return 0 if now is None else now[1]
