"""Data-parallel gradient buckets: all-reduce over dp overlapped with the backward pass.

Each parameter's gradient lives in a slot of a flat bucket (one dtype per bucket, the fewest
buckets of at most about ``bucket_bytes``, filled in reverse registration order, which is roughly the order backward
produces gradients). A post-accumulate-grad hook marks a parameter ready; when every parameter of a
bucket is ready, the bucket's all-reduce starts asynchronously while backward goes on. Buckets are
launched strictly in index order, so every dp rank issues the same collectives in the same order.

Only the backward of the step's last microbatch is *armed*: earlier microbatches only accumulate
into the slots, so nothing crosses the dp group until the gradients are final. ``finish`` launches
what is left (parameters that got no gradient contribute zeros) and waits for everything.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed import ProcessGroup

DEFAULT_BUCKET_MB = 25.0


def bucket_size_bytes(bucket_mb: float) -> int:
    """The bucket size in bytes for ``bucket_mb`` MiB (checked positive with the configuration); at
    least one byte, so a tiny size means one parameter per bucket rather than a division by zero."""
    return max(1, int(bucket_mb * 1024 * 1024))


@dataclass
class _Bucket:
    buffer: torch.Tensor
    params: list[nn.Parameter] = field(default_factory=list)
    ready: set[int] = field(default_factory=set)  # ids of ready params
    work: dist.Work | None = None


class GradBuckets:
    """Flat gradient buckets over ``params`` with asynchronous all-reduce (sum) over ``group``."""

    def __init__(self, params: list[nn.Parameter], *, group: ProcessGroup, bucket_bytes: int) -> None:
        self.group = group
        self.armed = False
        self.buckets: list[_Bucket] = []
        self._slot: dict[int, tuple[_Bucket, int]] = {}
        self._next = 0
        self._handles = []
        for dtype in dict.fromkeys(p.dtype for p in params):
            group_params = [p for p in reversed(params) if p.dtype == dtype]
            # n = ceil(bytes / bucket_bytes) buckets of about equal size: a bucket closes once it
            # holds bytes / n, so there are never more than n all-reduces per dtype, and the last
            # bucket, whose all-reduce cannot overlap backward, is no bigger than it must be.
            total = sum(p.numel() * p.element_size() for p in group_params)
            target = total / math.ceil(total / bucket_bytes)
            chunks: list[list[nn.Parameter]] = [[]]
            size = 0
            for p in group_params:
                if size >= target:
                    chunks.append([])
                    size = 0
                chunks[-1].append(p)
                size += p.numel() * p.element_size()
            for chunk in chunks:
                bucket = _Bucket(
                    buffer=torch.zeros(sum(p.numel() for p in chunk), dtype=dtype, device=chunk[0].device), params=chunk
                )
                offset = 0
                for p in chunk:
                    self._slot[id(p)] = (bucket, offset)
                    offset += p.numel()
                self.buckets.append(bucket)
        for p in params:
            self._handles.append(p.register_post_accumulate_grad_hook(self._on_grad))

    def view(self, p: nn.Parameter) -> torch.Tensor:
        bucket, offset = self._slot[id(p)]
        return bucket.buffer[offset : offset + p.numel()].view_as(p)

    def bind(self, p: nn.Parameter) -> None:
        """Make ``p.grad`` the bucket slot (copying a gradient autograd created elsewhere, e.g.
        after ``zero_grad(set_to_none=True)``); later accumulation then lands in the bucket."""
        slot = self.view(p)
        if p.grad is None:
            slot.zero_()
        elif p.grad.data_ptr() != slot.data_ptr():
            slot.copy_(p.grad)
        p.grad = slot

    def arm(self) -> None:
        """The next backward is the last of the step: launch buckets as they fill."""
        self.armed = True
        self._next = 0
        for bucket in self.buckets:
            bucket.ready.clear()
            bucket.work = None

    def _on_grad(self, p: nn.Parameter) -> None:
        self.bind(p)
        if self.armed:
            bucket, _ = self._slot[id(p)]
            bucket.ready.add(id(p))
            self._launch_in_order(only_full=True)

    def _launch_in_order(self, *, only_full: bool) -> None:
        while self._next < len(self.buckets):
            bucket = self.buckets[self._next]
            if only_full and len(bucket.ready) < len(bucket.params):
                return
            bucket.work = dist.all_reduce(bucket.buffer, group=self.group, async_op=True)
            self._next += 1

    def finish(self) -> None:
        """Launch the buckets not yet launched (unused parameters count as zero) and wait for all."""
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
