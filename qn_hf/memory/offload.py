"""What recomputation keeps of each block, held in host memory until the backward needs it.

With ``recompute`` a block keeps only its inputs until its backward (memory/recompute.py); at a long
sequence those inputs, one per block and microbatch in flight, are most of what the forward leaves
on the device. ``offload="activations"`` moves them to the host as they are saved and brings each
back for its block's backward:

* which tensors: what torch's checkpoint of a block saves outside its own recomputation, seen
  through ``saved_tensors_hooks`` around the checkpoint (a block's hidden states, and under pipeline
  parallelism a received activation): those that require a gradient. The inputs that do not (the
  attention mask, the rotary tables) are the same tensors for every block and stay where they are;
  what selective recomputation's cache keeps is its own and stays too.
* on CUDA: each is copied into pinned host memory on a side stream, after the compute stream has
  made it (the stream waits, the host does not), and the device memory is released once that copy
  is done (``record_stream``). In the backward, unpacking a block's input starts the copy back of
  the input saved just before it (the next block the backward reaches), so that copy overlaps this
  block's recomputation and backward; the compute stream waits for a copy's event, never the host.
  Pinned buffers are kept by shape and dtype and reused from step to step (allocating pinned memory
  synchronizes the device).
* on a CPU the activations already live in host memory: each is copied to a buffer of its own all
  the same, so that the same packing, prefetching and release run (and are tested) everywhere; it
  saves nothing there.

The values are copied, never changed: the run equals the one without offload bit for bit.
"""

from __future__ import annotations

import contextlib
from collections import defaultdict
from collections.abc import Iterator

import torch


class _Entry:
    """One saved tensor held on the host, and its way back."""

    __slots__ = ("host", "device", "copied", "back", "returned", "before")

    def __init__(self, host: torch.Tensor, device: torch.device, copied, before: _Entry | None) -> None:
        self.host, self.device, self.copied = host, device, copied  # the D2H copy's event (None on a CPU)
        self.back: torch.Tensor | None = None  # the tensor brought back (prefetched or unpacked)
        self.returned = None  # the H2D copy's event
        self.before = before  # the entry saved just before: the backward reaches it next


class ActivationOffload:
    """The saved-tensor hooks of ``offload="activations"``, entered around each block's checkpoint."""

    def __init__(self) -> None:
        self._stream: torch.cuda.Stream | None = None
        self._pool: dict[tuple, list[torch.Tensor]] = defaultdict(list)  # pinned buffers free for reuse
        self._last: _Entry | None = None
        self.packed = self.unpacked = self.prefetched = 0  # counts, for tests and benchmarks
        self.host_bytes = 0  # pinned host memory allocated (kept for reuse)

    @contextlib.contextmanager
    def hooks(self) -> Iterator[None]:
        with torch.autograd.graph.saved_tensors_hooks(self._pack, self._unpack):
            yield

    def _pack(self, tensor: torch.Tensor):
        if not tensor.requires_grad or isinstance(tensor, torch.nn.Parameter):
            return tensor  # shared by every block (masks, rotary tables) or a weight: left where it is
        self.packed += 1
        if tensor.device.type == "cuda":
            host = self._buffer(tensor)
            stream = self._side_stream(tensor.device)
            stream.wait_stream(torch.cuda.current_stream(tensor.device))  # the compute stream made it
            with torch.cuda.stream(stream):
                host.copy_(tensor, non_blocking=True)
                copied = torch.cuda.Event()
                copied.record(stream)
            tensor.record_stream(stream)  # its memory is reused only after the copy
        else:
            host, copied = tensor.detach().clone(), None
        entry = _Entry(host, tensor.device, copied, self._last)
        self._last = entry
        return entry

    def _unpack(self, entry):
        if not isinstance(entry, _Entry):
            return entry
        if entry.host is None and entry.back is None:
            raise RuntimeError("an offloaded activation was unpacked twice (a second backward through the same graph); "
                               "offload='activations' hands each back once")
        self._bring_back(entry)
        if entry.before is not None and entry.before.back is None and entry.before.host is not None:
            self._bring_back(entry.before)  # the next block's input, while this one's backward runs
            self.prefetched += 1
        back = entry.back
        if entry.returned is not None:
            stream = torch.cuda.current_stream(entry.device)
            stream.wait_event(entry.returned)
            back.record_stream(stream)
        self._release(entry)
        self.unpacked += 1
        return back  # held by the checkpoint's recomputation now, not by the entry

    def _bring_back(self, entry: _Entry) -> None:
        if entry.back is not None:
            return
        if entry.copied is None:  # on a CPU the host copy is the tensor
            entry.back = entry.host
            return
        stream = self._side_stream(entry.device)
        with torch.cuda.stream(stream):  # after the D2H copy: the same stream
            entry.back = entry.host.to(entry.device, non_blocking=True)
            entry.returned = torch.cuda.Event()
            entry.returned.record(stream)

    def _release(self, entry: _Entry) -> None:
        """The host buffer goes back to the pool once the copy back is queued: a later D2H copy into it
        runs on the same side stream, after it."""
        if entry.copied is not None and entry.host is not None:
            self._pool[(tuple(entry.host.shape), entry.host.dtype)].append(entry.host)
        entry.host = entry.back = None
        if self._last is entry:
            self._last = None

    def _buffer(self, tensor: torch.Tensor) -> torch.Tensor:
        free = self._pool.get((tuple(tensor.shape), tensor.dtype))
        if free:
            return free.pop()
        self.host_bytes += tensor.numel() * tensor.element_size()
        return torch.empty(tensor.shape, dtype=tensor.dtype, device="cpu", pin_memory=True)

    def _side_stream(self, device: torch.device) -> torch.cuda.Stream:
        if self._stream is None:
            self._stream = torch.cuda.Stream(device)
        return self._stream
