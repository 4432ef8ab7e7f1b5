"""Checkpoints written while training goes on (``save_checkpoint(..., asynchronous=True)``).

A save returns at once; a background thread copies this rank's shards into host buffers (pinned
memory on CUDA, on a stream of its own; plain memory on CPU) while the next step's forward and
backward run, and the optimizer's next step waits until the copy is done (``HostCopies``). The
thread then writes the files, agrees with the other ranks' threads, and rank 0's thread publishes
the checkpoint as a synchronous save does (``ckpt-N.partial`` renamed, ``latest`` repointed), so a
kill mid-write leaves the previous checkpoint whole. Without an optimizer to hold, the copy is made
before the save returns.

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

from ..comm import failures
from .format import CheckpointError

DEFAULT_TIMEOUT = datetime.timedelta(minutes=10)  # parallelize's default for every group


class HostCopies:
    """Host buffers for one rank's shards, reused from save to save (keyed by the shard's key), and
    the copy into them, made by the writer thread while the next step's forward and backward run.

    The saved values may change at the optimizer's next step, which therefore waits until they are
    copied (``wait_copied``, a step pre-hook): on CUDA only the device waits (the copies run on a
    stream of their own after an event recorded at the save; the step's stream waits for their
    event), on CPU the host waits for the copy to end. The pattern is DCP's asynchronous staging
    (``StagingOptions(use_async_staging=True)``), whose stager is experimental and cannot write qn_hf's
    format; the tensors here are qn_hf's own pieces, so the copy is its own too."""

    def __init__(self) -> None:
        self._buffers: dict[str, torch.Tensor] = {}
        self._copied = threading.Event()
        self._copied.set()
        self._saved_at: torch.cuda.Event | None = None  # the training stream's point the values are read at
        self._done: torch.cuda.Event | None = None  # the copies' end, on the copy stream

    def begin(self, device: torch.device) -> None:
        """On the training thread, at the save: the point in the device's stream the copies start from."""
        self._copied.clear()
        self._done = None
        self._saved_at = None
        if device.type == "cuda":
            self._saved_at = torch.cuda.Event()
            self._saved_at.record()

    def copy(self, sources: dict[str, torch.Tensor], device: torch.device) -> dict[str, torch.Tensor]:
        """Copy ``sources`` into host buffers (any thread); the next optimizer step may go on after."""
        try:
            out = {}
            if device.type == "cuda":
                stream = torch.cuda.Stream(device)
                with torch.cuda.stream(stream):
                    stream.wait_event(self._saved_at)
                    for key, values in sources.items():
                        out[key] = self._buffer(key, values, pinned=True)
                        out[key].copy_(values, non_blocking=True)  # page-locked: on the stream, not the host
                    self._done = torch.cuda.Event()
                    self._done.record(stream)
            else:
                for key, values in sources.items():
                    out[key] = self._buffer(key, values, pinned=False)
                    out[key].copy_(values)
            for key in set(self._buffers) - set(sources):  # a resized or removed tensor's old buffer
                del self._buffers[key]
            return out
        finally:
            self._copied.set()  # also after an error (reported by wait()): never leave the step waiting

    def _buffer(self, key: str, values: torch.Tensor, *, pinned: bool) -> torch.Tensor:
        buffer = self._buffers.get(key)
        if buffer is None or buffer.shape != values.shape or buffer.dtype != values.dtype:
            buffer = torch.empty(values.shape, dtype=values.dtype, device="cpu", pin_memory=pinned)
            self._buffers[key] = buffer
        return buffer

    def wait_copied(self) -> None:
        """Before anything changes the saved values (the optimizer's next step): wait for the copy."""
        self._copied.wait()
        if self._done is not None:
            torch.cuda.current_stream().wait_event(self._done)  # the device waits; the host goes on

    def written_from(self) -> None:
        """On the writer thread, before the host reads the buffers: the device has filled them."""
        if self._done is not None:
            self._done.synchronize()


class BackgroundSaves:
    """The one checkpoint save in flight for a model, its writer thread and the group it meets on."""

    def __init__(self, *, timeout: datetime.timedelta) -> None:
        self.timeout = timeout
        self.copies = HostCopies()
        self._group: ProcessGroup | None = None
        self._thread: threading.Thread | None = None
        self._path: str | None = None
        self._error: BaseException | None = None
        self._hold: torch.utils.hooks.RemovableHandle | None = None  # the optimizer's wait for the copy

    def hold_step(self, optimizer: torch.optim.Optimizer | None) -> None:
        """Make ``optimizer``'s next step wait until the save in flight has copied what it saves. A hook
        cannot remove itself while torch iterates the hooks: it stays, idle once the copy is done, until
        ``wait`` removes it."""
        if optimizer is not None:
            self._hold = optimizer.register_step_pre_hook(lambda *_: self.copies.wait_copied())

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
        if self._hold is not None:
            self._hold.remove()
            self._hold = None
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
    failed = failures(None if error is None else f"{type(error).__name__}: {error}", group=group)
    if failed:
        rank, message = failed[0]
        raise CheckpointError(f"{what} failed on rank {rank}: {message}"
                              + (f" (and on {len(failed) - 1} more)" if len(failed) > 1 else ""))
