"""Data-parallel gradient buckets: reduction over dp overlapped with the backward pass.

Each parameter's gradient lives in a slot of a flat bucket (one gradient dtype per bucket, the
fewest buckets of at most about ``bucket_bytes``, filled in reverse registration order, which is
roughly the order backward produces gradients). A post-accumulate-grad hook marks a parameter
ready; when every parameter of a bucket is ready, the bucket's reduction starts asynchronously
while backward goes on. Buckets are launched strictly in index order, so every dp rank issues the
same collectives in the same order.

Only a parameter's last gradient contribution of the step is *armed* (the last microbatch's
backward; with pipeline chunks, each chunk's last backward, or its last deferred weight pass):
earlier contributions only accumulate into the slots, so nothing crosses the dp group until the
gradients are final. ``finish`` launches
what is left (parameters that got no gradient contribute zeros) and waits for everything.

Sharded (ZeRO-1, ``shard_over_dp``): every bucket is padded to a multiple of dp and cut into dp
equal pieces; rank r owns piece r. The reduction is a reduce-scatter into the rank's own piece (in
place), which moves (dp-1)/dp of the bucket instead of an all-reduce's 2(dp-1)/dp. The parameters
become views of a flat weight buffer per bucket, so after the optimizer updated this rank's piece
one in-place all-gather per bucket gives every rank every weight; it runs asynchronously and a
module waits for its buckets only when its forward starts (``wait_weights``).
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed import ProcessGroup

from ..compat import all_gather_single, reduce_scatter_single


def bucket_size_bytes(bucket_mb: float) -> int:
    """The bucket size in bytes for ``bucket_mb`` MiB (checked positive with the configuration); at
    least one byte, so a tiny size means one parameter per bucket rather than a division by zero."""
    return max(1, int(bucket_mb * 1024 * 1024))


def cut_into_buckets(nbytes: Sequence[int], *, bucket_bytes: int) -> list[list[int]]:
    """Indices of tensors of ``nbytes`` each (one dtype, registration order) cut into buckets, filled
    in reverse order (roughly the order backward produces gradients). n = ceil(total / bucket_bytes)
    buckets of about equal size: a bucket closes once it holds total / n, so there are never more
    than n reductions, and the last bucket, whose reduction cannot overlap backward, is no bigger than
    it must be. The planner cuts with the same function."""
    total = sum(nbytes)
    target = total / max(1, math.ceil(total / bucket_bytes))
    chunks: list[list[int]] = [[]]
    size = 0
    for i in reversed(range(len(nbytes))):
        if size >= target:
            chunks.append([])
            size = 0
        chunks[-1].append(i)
        size += nbytes[i]
    return chunks


def grad_dtype(p: nn.Parameter) -> torch.dtype:
    """The dtype of ``p``'s gradient (float32 for a low-precision weight under mixed precision)."""
    return p.grad_dtype or p.dtype


@dataclass
class _Bucket:
    buffer: torch.Tensor  # gradients; sharded: padded to a multiple of the dp size
    params: list[nn.Parameter] = field(default_factory=list)
    ready: set[int] = field(default_factory=set)  # ids of ready params
    work: dist.Work | None = None
    weights: torch.Tensor | None = None  # sharded: the parameters' flat storage
    gather: dist.Work | None = None  # sharded: the pending all-gather of ``weights``


@dataclass(frozen=True)
class _Works:
    """Several asynchronous collectives waited for as one."""

    works: list[dist.Work]

    def wait(self) -> None:
        for work in self.works:
            work.wait()


@dataclass(frozen=True)
class Piece:
    """The part of one parameter inside this rank's piece of a sharded bucket: the flat range
    ``[start, stop)`` of the local parameter, and views of its gradient and weight there."""

    param: nn.Parameter
    start: int
    stop: int
    grad: torch.Tensor
    weight: torch.Tensor
    bucket: int


class GradBuckets:
    """Flat gradient buckets over ``params`` with asynchronous reduction (sum) over ``group``."""

    def __init__(self, params: list[nn.Parameter], *, group: ProcessGroup, bucket_bytes: int) -> None:
        self.group = group
        self.params = params
        self.bucket_bytes = bucket_bytes
        self.armed = False
        self._final: set[int] = set()  # ids of the armed parameters: their next gradient is final
        self.sharded = False
        self.reduced = False  # sharded: the last step's gradients were reduce-scattered in place
        self.buckets: list[_Bucket] = []
        self._slot: dict[int, tuple[_Bucket, int]] = {}
        # per parameter, its gradient slot as a view (made once: binding runs for every gradient)
        self._views: dict[int, torch.Tensor] = {}
        self._pieces: list[Piece] | None = None  # sharded: this rank's pieces, once laid out
        self._next = 0
        self._layout(params, separate=[])
        self._handles = [p.register_post_accumulate_grad_hook(self._on_grad) for p in params]

    def _layout(self, params: list[nn.Parameter], *, separate: list[list[nn.Parameter]]) -> None:
        """Cut ``params`` into buckets; each list in ``separate`` gets buckets of its own, last, so
        ranks whose other parameters differ (pipeline stages sharing a tied weight, or modules held
        on every stage) still lay those out identically."""
        pad = dist.get_world_size(self.group) if self.sharded else 1
        self.buckets, self._slot = [], {}
        mine = {id(p) for p in params}
        separate = [[p for p in apart if id(p) in mine] for apart in separate]
        apart = {id(p) for group in separate for p in group}
        for chosen in ([p for p in params if id(p) not in apart], *separate):
            for dtype in dict.fromkeys(grad_dtype(p) for p in chosen):
                group_params = [p for p in chosen if grad_dtype(p) == dtype]
                sizes = [p.numel() * dtype.itemsize for p in group_params]  # the gradients' bytes
                for indices in cut_into_buckets(sizes, bucket_bytes=self.bucket_bytes):
                    chunk = [group_params[i] for i in indices]
                    numel = sum(p.numel() for p in chunk)
                    bucket = _Bucket(buffer=torch.zeros(-(-numel // pad) * pad, dtype=dtype, device=chunk[0].device),
                                     params=chunk)
                    offset = 0
                    for p in chunk:
                        self._slot[id(p)] = (bucket, offset)
                        offset += p.numel()
                    self.buckets.append(bucket)
        self._views = {id(p): self._view(self._slot[id(p)][0].buffer, p) for p in params}
        self._pieces = None

    def shard_over_dp(self, *, separate: list[list[nn.Parameter]], model: nn.Module) -> None:
        """Switch to ZeRO-1: padded buckets, reduce-scatter, parameters viewing flat weight buffers.
        Gradients accumulated so far move into the new buckets. Each module of ``model`` that holds
        parameters waits for their buckets' all-gather when its forward starts."""
        grads = {id(p): p.grad for p in self.params}
        for p in self.params:
            p.grad = None
        self.sharded = True
        self._layout(self.params, separate=separate)
        with torch.no_grad():
            for bucket in self.buckets:
                bucket.weights = torch.zeros(bucket.buffer.numel(), dtype=bucket.params[0].dtype,
                                             device=bucket.buffer.device)
                for p in bucket.params:
                    view = self._view(bucket.weights, p)
                    view.copy_(p.data)
                    p.data = view
        for p in self.params:
            if grads[id(p)] is not None:
                p.grad = grads[id(p)]
                self.bind(p)
        for module in model.modules():
            own = [p for p in module.parameters(recurse=False) if id(p) in self._slot]
            if own:
                self._handles.append(module.register_forward_pre_hook(lambda *_, own=own: self.wait_weights(own)))

    def _view(self, flat: torch.Tensor, p: nn.Parameter) -> torch.Tensor:
        _, offset = self._slot[id(p)]
        return flat[offset : offset + p.numel()].view_as(p)

    def view(self, p: nn.Parameter) -> torch.Tensor:
        return self._views[id(p)]

    def bind(self, p: nn.Parameter) -> None:
        """Make ``p.grad`` the bucket slot (copying a gradient autograd created elsewhere, e.g.
        after ``zero_grad(set_to_none=True)``); later accumulation then lands in the bucket."""
        slot = self.view(p)
        if p.grad is slot:  # accumulated in place into the slot
            return
        if p.grad is None:
            slot.zero_()
        elif p.grad.data_ptr() != slot.data_ptr():
            slot.copy_(p.grad)
        p.grad = slot

    def arm(self, params: Iterable[nn.Parameter] | None = None) -> None:
        """The gradients of ``params`` (default: every parameter) become final with their next
        accumulation: launch buckets as they fill. The first call of a step resets the buckets;
        later calls add parameters (a pipeline chunk's, once its last backward is next)."""
        if not self.armed:
            self.armed = True
            self._next = 0
            self._final.clear()
            for bucket in self.buckets:
                bucket.ready.clear()
                bucket.work = None
        self._final.update(id(p) for p in (self.params if params is None else params))

    def disarm(self) -> None:
        """Forget a step that failed after arming (its armed parameters and launch position), so the
        next step's early microbatches only accumulate; in-flight reductions are dropped with it."""
        self.armed = False
        self._final.clear()

    def _on_grad(self, p: nn.Parameter) -> None:
        self.bind(p)
        if self.armed and id(p) in self._final:
            bucket, _ = self._slot[id(p)]
            bucket.ready.add(id(p))
            self._launch_in_order(only_full=True)

    def _launch_in_order(self, *, only_full: bool) -> None:
        while self._next < len(self.buckets):
            bucket = self.buckets[self._next]
            if only_full and len(bucket.ready) < len(bucket.params):
                return
            if self.sharded:
                bucket.work = self._reduce_scatter(bucket.buffer)
            else:
                bucket.work = dist.all_reduce(bucket.buffer, group=self.group, async_op=True)
            self._next += 1

    def finish(self) -> None:
        """Launch the buckets not yet launched (unused parameters count as zero) and wait for all.
        Sharded, only this rank's pieces hold the reduced gradients afterwards: ``.grad`` is cleared
        (read them through ``pieces``) and the optimizer's ``zero_grad`` must run before the next step."""
        if not self.armed:
            return
        for bucket in self.buckets[self._next :]:
            for p in bucket.params:
                if id(p) not in bucket.ready:
                    self.bind(p)
        self._launch_in_order(only_full=False)
        for bucket in self.buckets:
            bucket.work.wait()
        self.armed = False
        if self.sharded:
            self.reduced = True
            for p in self.params:
                p.grad = None

    # -- sharded (ZeRO-1) ----------------------------------------------------------------------------
    def _piece(self, flat: torch.Tensor) -> torch.Tensor:
        size = flat.numel() // dist.get_world_size(self.group)
        return flat[dist.get_rank(self.group) * size :][:size]

    def pieces(self) -> list[Piece]:
        """Every parameter's part of this rank's pieces, bucket by bucket (fixed once sharded: made
        once, then read at every step's sync and clip)."""
        if self._pieces is None:
            self._pieces = self._make_pieces()
        return self._pieces

    def _make_pieces(self) -> list[Piece]:
        out = []
        for i, bucket in enumerate(self.buckets):
            size = bucket.buffer.numel() // dist.get_world_size(self.group)
            lo = dist.get_rank(self.group) * size
            for p in bucket.params:
                _, offset = self._slot[id(p)]
                start, stop = max(lo, offset), min(lo + size, offset + p.numel())
                if start < stop:
                    out.append(Piece(param=p, start=start - offset, stop=stop - offset, grad=bucket.buffer[start:stop],
                                     weight=bucket.weights[start:stop], bucket=i))
        return out

    def zero_reduced(self) -> None:
        """The optimizer's ``zero_grad``: the reduced pieces are consumed."""
        for bucket in self.buckets:
            self._piece(bucket.buffer).zero_()
        self.reduced = False

    def gather_weights(self) -> None:
        """Start the all-gather of every bucket's weights (after the optimizer updated this rank's
        pieces), the buckets the forward reaches first (the last ones) first."""
        for bucket in reversed(self.buckets):
            bucket.gather = self._all_gather(bucket.weights)

    # gloo's reduce-scatter and all-gather copy through intermediate buffers: on 53 MiB at dp=2 they
    # took 73 and 78 ms where its all-reduce took 38 ms, while one reduce or broadcast per piece took
    # 39 and 21 ms in all (benchmarks/data_parallel.py --zero). On gloo both are therefore issued as
    # one reduce/broadcast per owner, which moves the same bytes a ring does; NCCL gets its own
    # collectives. The returned handle waits for all of them.
    def _reduce_scatter(self, flat: torch.Tensor) -> dist.Work | _Works:
        if dist.get_backend(self.group) != "gloo":
            return reduce_scatter_single(self._piece(flat), flat, group=self.group, async_op=True)
        return _Works([dist.reduce(piece, dst=dist.get_global_rank(self.group, i), group=self.group, async_op=True)
                       for i, piece in enumerate(flat.chunk(dist.get_world_size(self.group)))])

    def _all_gather(self, flat: torch.Tensor) -> dist.Work | _Works:
        if dist.get_backend(self.group) != "gloo":
            return all_gather_single(flat, self._piece(flat), group=self.group, async_op=True)
        return _Works([dist.broadcast(piece, src=dist.get_global_rank(self.group, i), group=self.group, async_op=True)
                       for i, piece in enumerate(flat.chunk(dist.get_world_size(self.group)))])

    def wait_weights(self, params: list[nn.Parameter] | None = None) -> None:
        """Wait for the gathers holding ``params`` (all when None) to land."""
        chosen = self.buckets if params is None else [self._slot[id(p)][0] for p in params if id(p) in self._slot]
        for bucket in chosen:
            if bucket.gather is not None:
                bucket.gather.wait()
                bucket.gather = None
