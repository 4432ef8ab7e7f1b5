"""The host copy an asynchronous save writes from: one arena of host memory sized to this rank's shards,
filled on a copy stream of its own while training goes on, and the order that keeps the weights still
until it is filled.

Order. The copy reads the live tensors, so nothing may write them before it has: on CUDA the copy stream
waits for the training stream's point at the save (``begin``), and the training stream waits for the
copy's end before the next write (``wait_copied``): at the optimizer's next step when the save was given
the optimizer (the copy is launched by the writer thread meanwhile), at once otherwise (the copy is
launched by the save itself; any later kernel, a user's own optimizer step included, queues behind it).
Both are stream waits: the host never waits for the device here, only the writer thread does, before it
reads the arena (``written_from``). On CPU (no streams) the copy is made on the host.

Streams. ``CopyStreams`` is the device side (CUDA's streams and events); tests drive the same calls with
a model of streams on CPU that runs a copy as late as the events allow, so a missing wait shows as a file
written with the next step's weights. The copy stream is taken once for the model's life, at priority -2:
torch hands streams out of a pool of 32 per priority level round robin; NCCL's communicators take theirs
from the default level (0; -3 with ``is_high_priority_stream``) and FSDP2 its all-gather and reduce-scatter
streams from -1, so a copy stream taken afresh per save from either pool would eventually share a stream with
a communicator and hold a pipeline link or a gather behind gigabytes of copy.

Memory. One arena per rank, its size the shards' bytes (each aligned to 64 bytes), page-locked with
``cudaHostRegister`` rather than allocated pinned: torch's pinned allocator rounds each block up to a
power of two and keeps it cached for the process's life (1-2x the state, per rank). The arena is kept
from save to save (pinning costs more than the copy) and released by ``release`` (``wait_checkpoint(
release=True)``, ``close``), or when the shards' sizes change; a release first waits for the copies
queued into it. Where registering fails (a host short of lockable memory) the arena comes from torch's
pinned allocator instead, with a warning (``CopyStreams.arena`` says which error it clears).
"""

from __future__ import annotations

import ctypes
import threading
import warnings
import weakref
from collections.abc import Callable, Iterable
from typing import Protocol

import torch

ALIGN = 64  # bytes: each tensor's start in the arena (any dtype's alignment; whole cache lines for the copy)


class Streams(Protocol):
    """The device side of the copy (``CopyStreams`` on CUDA; a model of streams in tests)."""

    def point(self) -> object: ...  # an event recorded on the calling thread's current stream
    # the copies, queued after ``after``; the end's event, recorded also when a copy raised (``drain`` waits)
    def copy(self, after: object, pairs: Iterable[tuple[torch.Tensor, torch.Tensor]]) -> object: ...
    def order_after(self, event: object) -> None: ...  # the current stream waits for the event
    def host_wait(self, event: object) -> None: ...
    def drain(self) -> None: ...  # the host waits until no copy is queued (before the arena goes)
    def arena(self, size: int) -> tuple[torch.Tensor, Callable[[], None]]: ...  # page-locked bytes, their unpin


class CopyStreams:
    """CUDA's side: one copy stream for the model's life, events to order it against the training stream."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.stream: torch.cuda.Stream | None = None  # taken at the first copy
        self._last: torch.cuda.Event | None = None  # the last copy's end

    def point(self) -> torch.cuda.Event:
        event = torch.cuda.Event()
        event.record(torch.cuda.current_stream(self.device))
        return event

    def copy(self, after: torch.cuda.Event, pairs: Iterable[tuple[torch.Tensor, torch.Tensor]]) -> torch.cuda.Event:
        if self.stream is None:
            self.stream = torch.cuda.Stream(self.device, priority=-2)  # see the module's note on pools
        with torch.cuda.stream(self.stream):
            self.stream.wait_event(after)
            done = torch.cuda.Event()
            try:
                for host, values in pairs:
                    host.copy_(values, non_blocking=True)  # page-locked: queued on the stream, not waited for
            finally:  # after an error too: the copies queued before it still write into the arena
                done.record(self.stream)
                self._last = done
        return done

    def order_after(self, event: torch.cuda.Event) -> None:
        torch.cuda.current_stream(self.device).wait_event(event)

    def host_wait(self, event: torch.cuda.Event) -> None:
        event.synchronize()

    def drain(self) -> None:
        if self._last is not None:
            self._last.synchronize()

    def arena(self, size: int) -> tuple[torch.Tensor, Callable[[], None]]:
        arena = torch.empty(size, dtype=torch.uint8)
        if size == 0:
            return arena, lambda: None
        cudart = torch.cuda.cudart()
        pointer = arena.data_ptr()
        code = int(cudart.cudaHostRegister(pointer, size, 1))  # 1: portable, pinned for every context
        if code == 0:
            return arena, lambda: cudart.cudaHostUnregister(pointer)
        # The failed call's error stays the thread's "last error", which torch reads after its next kernel
        # launch and would raise there as that kernel's (sglang-project/sglang#38832); torch's binding has no
        # cudaGetLastError, so it is cleared through the process's own runtime library
        _clear_last_error()
        warnings.warn(f"cudaHostRegister of the checkpoint's {size}-byte host arena failed "
                      f"({cudart.cudaGetErrorString(cudart.cudaError(code))}): using torch's pinned allocator (its "
                      f"blocks are rounded up to a power of two and cached)", stacklevel=3)
        return torch.empty(size, dtype=torch.uint8, pin_memory=True), lambda: None


def _clear_last_error() -> None:
    """cudaGetLastError of every CUDA runtime library this process loaded (Linux: /proc/self/maps)."""
    try:
        with open("/proc/self/maps") as maps:
            libraries = {line.split()[-1] for line in maps if "libcudart" in line.split()[-1]}
    except OSError:
        return
    for path in sorted(libraries):
        ctypes.CDLL(path).cudaGetLastError()


class HostCopies:
    """This rank's shards in host memory for the save in flight (one arena, reused from save to save) and
    the order of their copy against training (see the module's note)."""

    def __init__(self, streams: Streams | None = None) -> None:
        self._streams = streams  # None: CUDA's, taken at the first save on a CUDA device
        self._active: Streams | None = None  # this save's (None: host copies)
        self._copied = threading.Event()  # the copy is made (host) or queued (streams)
        self._copied.set()
        self._saved_at: object | None = None  # the training stream's point the values are read at
        self._done: object | None = None  # the copies' end, on the copy stream
        self._arena: torch.Tensor | None = None
        self._layout: tuple = ()
        self._views: dict[str, torch.Tensor] = {}
        self._unpin: weakref.finalize | None = None

    @property
    def copy_stream(self) -> torch.cuda.Stream | None:
        """The CUDA stream every save of this model copies on (None before the first, or off CUDA)."""
        return self._streams.stream if isinstance(self._streams, CopyStreams) else None

    @property
    def host_bytes(self) -> int:
        """The bytes of host memory kept for the next save (the arena's size; 0 once released)."""
        return 0 if self._arena is None else self._arena.numel()

    def begin(self, device: torch.device) -> None:
        """On the training thread, at the save: the point in the training stream the copies start from."""
        if self._streams is None and device.type == "cuda":
            self._streams = CopyStreams(device)
        self._active = self._streams
        self._copied.clear()
        self._done = None
        self._saved_at = self._active.point() if self._active is not None else None

    def copy(self, sources: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """Copy ``sources`` into the arena (either thread); return the arena's views, by key."""
        try:
            out = self._carve(sources)
            pairs = [(out[key], values) for key, values in sources.items()]
            if self._active is not None:
                self._done = self._active.copy(self._saved_at, pairs)
            else:
                for host, values in pairs:
                    host.copy_(values)
            return out
        finally:
            self._copied.set()  # also after an error (reported by wait()): never leave the step waiting

    def wait_copied(self) -> None:
        """On the training thread, before anything changes the saved values: order it after the copy."""
        self._copied.wait()  # the copy is queued (or, on the host, made)
        if self._done is not None:
            self._active.order_after(self._done)  # the device waits; the host goes on

    def written_from(self) -> None:
        """On the writer thread, before the host reads the arena: the device has filled it."""
        if self._done is not None:
            self._active.host_wait(self._done)

    def abandon(self) -> None:
        """A save that failed before its writer started: nothing holds the next step any more."""
        self._done = None
        self._copied.set()

    def release(self) -> None:
        """Give the arena back (no save in flight): once the copies queued into it are done (also those of a
        save that failed midway); the next save allocates and pins a new one."""
        if self._active is not None:
            self._active.drain()
        if self._unpin is not None:
            self._unpin()
        self._arena, self._layout, self._views, self._unpin = None, (), {}, None

    def _carve(self, sources: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """The arena's views for ``sources``' keys, shapes and dtypes (a new arena when they changed)."""
        layout = tuple((key, tuple(t.shape), t.dtype) for key, t in sources.items())
        if layout != self._layout:
            self.release()
            offsets, size = {}, 0
            for key, shape, dtype in layout:
                offsets[key] = size
                size += -(-_nbytes(shape, dtype) // ALIGN) * ALIGN
            arena, unpin = (self._active.arena(size) if self._active is not None
                            else (torch.empty(size, dtype=torch.uint8), lambda: None))
            # A finalizer, so that an arena never released (a model not closed) is unpinned before it is freed
            self._unpin = weakref.finalize(self, _quietly, unpin)
            self._views = {key: arena[offsets[key]:offsets[key] + _nbytes(shape, dtype)].view(dtype).view(shape)
                           for key, shape, dtype in layout}
            self._arena, self._layout = arena, layout
        return dict(self._views)


def _nbytes(shape: tuple[int, ...], dtype: torch.dtype) -> int:
    return torch.Size(shape).numel() * dtype.itemsize


def _quietly(unpin: Callable[[], None]) -> None:
    try:
        unpin()
    except Exception:  # at interpreter exit CUDA may be gone first; the process's memory goes with it
        pass
