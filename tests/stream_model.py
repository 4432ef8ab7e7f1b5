"""A model of CUDA's streams on CPU for ``checkpoint.host_copies``: work queued on the copy stream runs as late
as its events allow (only when some stream or the host waits for an event recorded after it), and the training
stream is the host itself (CPU tensors change when the host runs the op). A missing stream wait therefore shows
as a copy that reads the weights after the next step wrote them, which CUDA allows and a CPU run never does."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterable

import torch


class _Event:
    def __init__(self, work: Callable[[], None] | None = None) -> None:
        self.work = work


class LateStreams:
    """``host_copies.Streams`` with copies deferred until waited for; counts pinning and copies launched."""

    def __init__(self, *, host_delay_s: float = 0.0) -> None:
        self.host_delay_s = host_delay_s  # before the host's own wait for the device: a slow device
        self._lock = threading.Lock()
        self._queue: list[_Event] = []  # the copy stream, in order
        self.pinned: list[int] = []  # bytes of each arena pinned
        self.unpinned = 0
        self.copies_launched = 0
        self.ran_late = 0  # copies run at a wait (rather than never)

    def point(self) -> _Event:
        return _Event()  # the training stream is the host: everything before it has run

    def copy(self, after: _Event, pairs: Iterable[tuple[torch.Tensor, torch.Tensor]]) -> _Event:
        pairs = list(pairs)
        self.copies_launched += 1

        def run() -> None:
            for host, values in pairs:
                host.copy_(values)

        done = _Event(run)
        with self._lock:
            self._queue.append(done)
        return done

    def _run_through(self, event: _Event) -> None:
        """A stream's work runs in order: everything queued up to ``event``."""
        with self._lock:
            while event in self._queue:
                first = self._queue.pop(0)
                first.work()
                self.ran_late += 1

    def order_after(self, event: _Event) -> None:  # later host ops are later training-stream ops
        self._run_through(event)

    def host_wait(self, event: _Event) -> None:
        time.sleep(self.host_delay_s)
        self._run_through(event)

    def drain(self) -> None:
        with self._lock:
            queued = self._queue[-1] if self._queue else None
        if queued is not None:
            self._run_through(queued)

    def arena(self, size: int) -> tuple[torch.Tensor, Callable[[], None]]:
        self.pinned.append(size)

        def unpin() -> None:
            self.unpinned += 1

        return torch.empty(size, dtype=torch.uint8), unpin
