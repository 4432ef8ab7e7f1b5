"""Checkpoints written while training goes on (``save_checkpoint(..., asynchronous=True)``).

A save returns at once; this rank's shards are copied into host memory (``host_copies.py``: one
pinned arena on CUDA, filled on a stream of its own while the next step's forward and backward run,
ordered before the next write to the weights), and a background thread writes the files, agrees
with the other ranks' threads, and rank 0's thread publishes the checkpoint as a synchronous save
does (``ckpt-N.partial`` renamed, ``latest`` repointed), so a kill mid-write leaves the previous
checkpoint whole.

At most one save is in flight: the next save, a load, ``wait`` and ``close`` wait for it, and its
error (any rank's) is raised there on every rank. The host memory is kept for the next save
(pinning memory each time costs more than the copy), which is safe because the previous save has
finished with it by then, until ``wait(release=True)`` or ``close``.

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
from .host_copies import HostCopies, Streams

DEFAULT_TIMEOUT = datetime.timedelta(minutes=10)  # parallelize's default for every group


class BackgroundSaves:
    """The one checkpoint save in flight for a model, its writer thread and the group it meets on."""

    def __init__(self, *, timeout: datetime.timedelta, streams: Streams | None = None) -> None:
        self.timeout = timeout
        self.copies = HostCopies(streams)  # streams: CUDA's by default (a model of them in tests)
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

    def abandon(self) -> None:
        """A save that failed before its writer started: the optimizer's next step is not held for it."""
        self.copies.abandon()
        if self._hold is not None:
            self._hold.remove()
            self._hold = None

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

    def wait(self, *, release: bool = False) -> str | None:
        """Wait for the save in flight; return its directory (None: none was in flight), or raise its error.
        ``release``: also give back the host memory kept for the next save."""
        if self._thread is not None:
            self._thread.join()
        if release:  # after the writer's end: its copy into the arena is done
            self.copies.release()
        if self._thread is None:
            return None
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
        if self._thread is not None:  # normally waited for already (ParallelModel.close); its copy must end first
            self._thread.join()
        self.copies.release()
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
