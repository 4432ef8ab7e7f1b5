"""What recomputation keeps of each block, held in host memory until the backward needs it.

With ``recompute`` a block keeps only its inputs until its backward (memory/recompute.py); at a long
sequence those inputs, one per block and microbatch in flight, are most of what the forward leaves
on the device. ``offload="activations"`` moves them to the host as they are saved and brings each
back for its block's backward:

* which tensors: what torch's checkpoint of a block saves outside its own recomputation, seen
  through ``saved_tensors_hooks`` around the checkpoint, that autograd made and that requires a
  gradient: a block's hidden states. The inputs that do not require one (the attention mask, the
  rotary tables) are the same tensors for every block and stay where they are; a leaf (a pipeline
  stage's received activation) stays too, since the stage holds it anyway to send its gradient back;
  what selective recomputation's cache keeps is its own and stays.
* on CUDA: each is copied into pinned host memory on a side stream, after the compute stream has
  made it (the stream waits, the host does not), and the device memory is released once that copy
  is done (``record_stream``). In the backward, unpacking a block's input starts the copy back of
  the input the same microbatch's forward saved just before it (the block the backward reaches
  next), so that copy overlaps this block's recomputation and backward; the compute stream waits for
  a copy's event, never the host. Pinned buffers come from torch's caching host allocator, which
  reuses them once the copies recorded on them are done (allocating pinned memory afresh would
  synchronize the device).
* on another device or a CPU: each is copied to the host synchronously; on a CPU the host is the
  device, so it saves nothing there, but the same packing, prefetching and release run (and are
  tested) everywhere.

The values are copied, never changed: the run equals the one without offload bit for bit. A saved
tensor written in place after it was saved is refused at its unpacking, as autograd itself would.
"""

from __future__ import annotations

import contextlib
import weakref
from collections.abc import Callable, Iterator

import torch


def moves(tensor: torch.Tensor) -> bool:
    """Whether the offload holds ``tensor``, saved by a block's checkpoint, on the host: autograd made it and it
    requires a gradient. What does not (masks, rotary tables: shared by every block), a weight or a held leaf
    stays where it is. (The planner's trace asks the same: planner/trace.py.)"""
    return tensor.requires_grad and tensor.grad_fn is not None


class _Entry:
    """One saved tensor held on the host, and its way back."""

    __slots__ = ("host", "device", "source", "version", "copied", "back", "returned", "before")

    def __init__(self, host: torch.Tensor, source: torch.Tensor, copied, before: _Entry | None) -> None:
        # the saved tensor itself only weakly (its memory is what goes), and its version when saved
        self.host, self.device, self.source, self.version = host, source.device, weakref.ref(source), source._version
        self.copied = copied  # the D2H copy's event (None where the copy was synchronous)
        self.back: torch.Tensor | None = None  # the tensor brought back (prefetched or unpacked)
        self.returned = None  # the H2D copy's event
        self.before = before  # the entry the same forward saved just before: the backward reaches it next


class ActivationOffload:
    """The saved-tensor hooks of ``offload="activations"``, entered around each block's checkpoint."""

    def __init__(self) -> None:
        self._stream: torch.cuda.Stream | None = None
        self._last: _Entry | None = None  # the entry the running forward saved last
        self.packed = self.unpacked = self.prefetched = 0  # counts, for tests and benchmarks
        self.host_bytes = self.peak_host_bytes = 0  # held on the host now, and the most at once

    @contextlib.contextmanager
    def hooks(self) -> Iterator[None]:
        with torch.autograd.graph.saved_tensors_hooks(self._pack, self._unpack):
            yield

    def chained(self, forward: Callable) -> Callable:
        """``forward`` (one microbatch through a pipeline chunk) starting a chain of its own: a prefetch stays
        within the forward that saved the entries, never reaching another microbatch's or a failed step's."""
        def run(*args, **kwargs):
            self._last = None
            try:
                return forward(*args, **kwargs)
            finally:
                self._last = None
        return run

    def round_trip(self, tensor: torch.Tensor) -> torch.Tensor:
        """``tensor`` (one ``moves`` takes) to the host and back as a block's saved input goes, without a graph:
        what the planner's calibration times (planner/calibrate.py)."""
        return self.chained(lambda: self._unpack(self._pack(tensor)))()  # a chain of its own: nothing links on

    def _pack(self, tensor: torch.Tensor):
        if not moves(tensor):
            return tensor
        self.packed += 1
        if tensor.device.type == "cuda":
            host = torch.empty(tensor.shape, dtype=tensor.dtype, device="cpu", pin_memory=True)
            stream = self._side_stream(tensor.device)
            stream.wait_stream(torch.cuda.current_stream(tensor.device))  # the compute stream made it
            with torch.cuda.stream(stream):
                host.copy_(tensor, non_blocking=True)
                copied = torch.cuda.Event()
                copied.record(stream)
            tensor.record_stream(stream)  # its memory is reused only after the copy
        else:
            host, copied = tensor.detach().to("cpu", copy=True), None
        self.host_bytes += host.numel() * host.element_size()
        self.peak_host_bytes = max(self.peak_host_bytes, self.host_bytes)
        entry = _Entry(host, tensor, copied, self._last)
        self._last = entry
        return entry

    def _unpack(self, entry):
        if not isinstance(entry, _Entry):
            return entry
        if entry.host is None:
            raise RuntimeError("an offloaded activation was unpacked twice (a second backward through the same graph); "
                               "offload='activations' hands each back once")
        source = entry.source()
        if source is not None and source._version != entry.version:  # as autograd refuses a saved tensor's
            raise RuntimeError(f"a block input offloaded to the host was modified in place after it was saved (version "
                               f"{entry.version} -> {source._version}): its backward would use the old values; "
                               f"parallelize without offload, or keep the model's forward out of place")
        self._bring_back(entry)
        before = entry.before
        if before is not None and before.back is None and before.host is not None:
            self._bring_back(before)  # the next block's input, while this one's backward runs
            self.prefetched += 1
        back = entry.back
        if entry.returned is not None:
            stream = torch.cuda.current_stream(entry.device)
            stream.wait_event(entry.returned)
            back.record_stream(stream)
        self.host_bytes -= entry.host.numel() * entry.host.element_size()
        entry.host = entry.back = None  # the pinned buffer goes back to torch's pool once its copies are done
        self.unpacked += 1
        return back  # held by the checkpoint's recomputation now, not by the entry

    def _bring_back(self, entry: _Entry) -> None:
        if entry.back is not None:
            return
        if entry.copied is None:
            entry.back = entry.host.to(entry.device)  # on a CPU the host copy itself
        else:
            stream = self._side_stream(entry.device)
            with torch.cuda.stream(stream):  # after the D2H copy: the same stream
                entry.back = entry.host.to(entry.device, non_blocking=True)
                entry.returned = torch.cuda.Event()
                entry.returned.record(stream)

    def _side_stream(self, device: torch.device) -> torch.cuda.Stream:
        if self._stream is None:
            self._stream = torch.cuda.Stream(device)
        return self._stream
