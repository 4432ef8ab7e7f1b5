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
written with the next step's weights. The copy stream is taken once for the model's life, from the
high-priority pool: torch hands streams out of two pools of 32 round robin, and NCCL's communicators take
theirs from the default-priority pool (``is_high_priority_stream`` False), so a copy stream taken afresh
per save eventually shares one with a communicator and holds a pipeline link behind the copy.

Memory. One arena per rank, its size the shards' bytes (each aligned to 64 bytes), page-locked with
``cudaHostRegister`` rather than allocated pinned: torch's pinned allocator rounds each block up to a
power of two and keeps it cached for the process's life (1-2x the state, per rank). The arena is kept
from save to save (pinning costs more than the copy) and released by ``release`` (``wait_checkpoint(
release=True)``, ``close``), or when the shards' sizes change. torch's DCP stager pins the same way
(``torch.distributed._state_dict_utils``, private, and it pins per tensor).
"""

from __future__ import annotations

import threading
import weakref
from collections.abc import Callable, Iterable
from typing import Protocol

import torch

ALIGN = 64  # bytes: each tensor's start in the arena (any dtype's alignment; whole cache lines for the copy)


class Streams(Protocol):
    """The device side of the copy (``CopyStreams`` on CUDA; a model of streams in tests)."""

    def point(self) -> object: ...  # an event recorded on the calling thread's current stream
    def copy(self, after: object, pairs: Iterable[tuple[torch.Tensor, torch.Tensor]]) -> object: ...
    def order_after(self, event: object) -> None: ...  # the current stream waits for the event
    def host_wait(self, event: object) -> None: ...
    def pin(self, arena: torch.Tensor) -> Callable[[], None]: ...  # returns the unpin


class CopyStreams:
    """CUDA's side: one copy stream for the model's life, events to order it against the training stream."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.stream: torch.cuda.Stream | None = None  # taken at the first copy

    def point(self) -> torch.cuda.Event:
        event = torch.cuda.Event()
        event.record(torch.cuda.current_stream(self.device))
        return event

    def copy(self, after: torch.cuda.Event, pairs: Iterable[tuple[torch.Tensor, torch.Tensor]]) -> torch.cuda.Event:
        if self.stream is None:
            self.stream = torch.cuda.Stream(self.device, priority=-1)  # see the module's note on pools
        with torch.cuda.stream(self.stream):
            self.stream.wait_event(after)
            for host, values in pairs:
                host.copy_(values, non_blocking=True)  # page-locked: queued on the stream, not waited for
            done = torch.cuda.Event()
            done.record(self.stream)
        return done

    def order_after(self, event: torch.cuda.Event) -> None:
        torch.cuda.current_stream(self.device).wait_event(event)

    def host_wait(self, event: torch.cuda.Event) -> None:
        event.synchronize()

    def pin(self, arena: torch.Tensor) -> Callable[[], None]:
        if arena.numel() == 0:
            return lambda: None
        cudart = torch.cuda.cudart()
        pointer = arena.data_ptr()
        code = int(cudart.cudaHostRegister(pointer, arena.numel(), 1))  # 1: portable, pinned for every context
        if code != 0:
            raise RuntimeError(f"cudaHostRegister of the checkpoint's {arena.numel()}-byte host arena failed ({code})")
        return lambda: cudart.cudaHostUnregister(pointer)


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

    def release(self) -> None:
        """Give the arena back (no save may be in flight): the next save allocates and pins a new one."""
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
            arena = torch.empty(size, dtype=torch.uint8)
            unpin = self._active.pin(arena) if self._active is not None else (lambda: None)
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
