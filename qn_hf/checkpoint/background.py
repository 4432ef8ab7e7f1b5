"""Checkpoints written while training goes on (``save_checkpoint(..., asynchronous=True)``).

A save copies this rank's shards into host buffers on the calling thread (pinned memory on CUDA,
copied on the device's stream; plain memory on CPU, where the weights themselves are host tensors
that the next step would overwrite), then returns; a background thread writes the files, agrees
with the other ranks' threads, and rank 0's thread publishes the checkpoint as a synchronous save
does (``ckpt-N.partial`` renamed, ``latest`` repointed), so a kill mid-write leaves the previous
checkpoint whole.

At most one save is in flight: the next save, a load, ``wait`` and ``close`` wait for it, and its
error (any rank's) is raised there on every rank. The host buffers are kept for the next save
(allocating pinned memory each time costs more than the copy), which is safe because the
previous save has finished with them by then.

The threads meet on a gloo group of their own: collectives of one group issued from two threads
have no order across ranks, so sharing the training's groups could pair one rank's checkpoint
barrier with another's gradient all-reduce (KempnerInstitute/KempnerForge#104). torch's DCP
``async_save`` is not used because qn_hf's format is not DCP's (issue 51 adds that format); its
staging helpers are private (``torch.distributed._state_dict_utils``).
"""

from __future__ import annotations

import datetime
import threading
from collections.abc import Callable

import torch
import torch.distributed as dist
from torch.distributed import ProcessGroup

from .format import CheckpointError


class HostCopies:
    """Host buffers for one rank's shards, reused from save to save (keyed by the shard's key)."""

    def __init__(self) -> None:
        self._buffers: dict[str, torch.Tensor] = {}
        self._event: torch.cuda.Event | None = None

    def copy(self, key: str, values: torch.Tensor) -> torch.Tensor:
        buffer = self._buffers.get(key)
        if buffer is None or buffer.shape != values.shape or buffer.dtype != values.dtype:
            pinned = values.device.type == "cuda"  # page-locked, so the copy runs on the stream, not the host
            buffer = torch.empty(values.shape, dtype=values.dtype, device="cpu", pin_memory=pinned)
            self._buffers[key] = buffer
        buffer.copy_(values, non_blocking=values.device.type == "cuda")
        if values.device.type == "cuda":
            self._event = torch.cuda.Event()
            self._event.record()  # after every copy so far: the writer waits on it, the training never does
        return buffer

    def ready(self) -> None:
        """Block the calling (writer) thread until the device has finished the copies."""
        if self._event is not None:
            self._event.synchronize()
            self._event = None

    def forget(self, keep: set[str]) -> None:
        """Drop the buffers of shards this save no longer has (a resized or removed tensor)."""
        for key in set(self._buffers) - keep:
            del self._buffers[key]


class BackgroundSaves:
    """The one checkpoint save in flight for a model, its writer thread and the group it meets on."""

    def __init__(self, *, timeout: datetime.timedelta) -> None:
        self.timeout = timeout
        self.copies = HostCopies()
        self._group: ProcessGroup | None = None
        self._thread: threading.Thread | None = None
        self._path: str | None = None
        self._error: BaseException | None = None

    def group(self) -> ProcessGroup:
        """The writers' gloo group over the world, made at the first asynchronous save (every rank
        saves at the same point, so every rank makes it there)."""
        if self._group is None:
            self._group = dist.new_group(backend="gloo", timeout=self.timeout)
        return self._group

    @property
    def in_flight(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    def start(self, write: Callable[[], None], *, path: str) -> None:
        if self._thread is not None:
            raise RuntimeError("a checkpoint save is already in flight: wait() for it first")
        self._path, self._error = path, None

        def run() -> None:
            try:
                write()
            except BaseException as e:  # DCP-style errors subclass BaseException; all reach wait()
                self._error = e

        # Not a daemon: an interpreter ending normally lets the write finish instead of cutting it
        self._thread = threading.Thread(target=run, name=f"qn_hf checkpoint writer ({path})")
        self._thread.start()

    def wait(self) -> str | None:
        """Wait for the save in flight; return its directory (None: none was in flight), or raise its error."""
        if self._thread is None:
            return None
        self._thread.join()
        path, error = self._path, self._error
        self._thread, self._path, self._error = None, None, None
        if error is not None:
            if isinstance(error, CheckpointError):
                raise error
            raise CheckpointError(f"the checkpoint {path} was not written: {type(error).__name__}: {error}") from error
        return path

    def close(self) -> None:
        if self._group is not None and dist.is_initialized():
            dist.destroy_process_group(self._group)
        self._group = None


def agree(error: BaseException | None, *, group: ProcessGroup, what: str) -> None:
    """Every writer thread learns whether any rank failed ``what``, and all raise the same error."""
    gathered: list = [None] * dist.get_world_size(group)
    dist.all_gather_object(gathered, None if error is None else f"{type(error).__name__}: {error}", group=group)
    failed = [(rank, message) for rank, message in enumerate(gathered) if message is not None]
    if failed:
        rank, message = failed[0]
        raise CheckpointError(f"{what} failed on rank {rank}: {message}"
                              + (f" (and on {len(failed) - 1} more)" if len(failed) > 1 else ""))
