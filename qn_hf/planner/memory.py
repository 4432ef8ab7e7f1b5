"""What one rank holds besides activations: weights, gradients and AdamW state, per precision and ZeRO.

Per parameter element on the rank:

* weights: the parameter dtype (the model's, or bf16/fp16 under ``mixed_precision``);
* gradients: the gradient dtype (float32 under ``mixed_precision``, else the parameter dtype), in the
  dp buckets (dp > 1) or in ``.grad``;
* optimizer (``qn_hf.optimizer`` over AdamW): ``exp_avg`` and ``exp_avg_sq`` in the master dtype,
  float32 master copies under ``mixed_precision`` (without it the masters are the weights
  themselves), and AdamW's 4-byte ``step`` per tensor stepped. Mixed precision: 2 + 4 + 12 bytes
  per parameter (and 4 per tensor); float32: 4 + 4 + 8.

ZeRO-1 (``zero=True``, dp > 1): the buckets are cut as ``GradBuckets`` cuts them (``bucket_layout``
below calls the same ``cut_into_buckets``) and padded to a multiple of dp (here and below, dp is
every rank holding the same shard: dp x cp under context parallelism; for the ep-sharded experts'
own buckets, the expert replicas holding the same block). The gradient
buffers stay whole on every rank, padding included; masters, moments and step counters exist only
for the parameter elements in this rank's piece of each bucket. Pieces differ by the padding only:
the figures are dp rank 0's (expert replica 0's), the fullest.
"""

from __future__ import annotations

from dataclasses import dataclass

from ..data_parallel.buckets import cut_into_buckets

MASTER_ELEM = 4  # float32 master weights and moments under mixed precision
STEP_BYTES = 4  # AdamW's float32 step counter, one per tensor it steps


@dataclass(frozen=True)
class Bucket:
    params: tuple[tuple[str, int], ...]  # (name, elements) in slot order
    padded: int  # elements of the buffer: the sum, rounded up to a multiple of dp under ZeRO

    def piece(self, dp: int) -> int:
        """Elements of each dp rank's piece (ZeRO)."""
        return self.padded // dp


def bucket_layout(params: list[tuple[str, int]], *, elem: int, bucket_bytes: int, pad: int,
                  separate: tuple[frozenset[str], ...] = ()) -> list[Bucket]:
    """The buckets ``GradBuckets`` (data_parallel.py) cuts from one stage's trainable parameters in
    registration order, all of one gradient dtype of ``elem`` bytes: each set in ``separate`` (under
    ZeRO: weights tied across stages, what every stage holds) in buckets of its own after the rest,
    each group cut by ``cut_into_buckets``, the function ``GradBuckets`` uses."""
    buckets = []
    apart = frozenset().union(*separate)
    for chosen in ([p for p in params if p[0] not in apart], *([p for p in params if p[0] in group] for group in separate)):
        for indices in (cut_into_buckets([n * elem for _, n in chosen], bucket_bytes=bucket_bytes) if chosen else []):
            chunk = [chosen[i] for i in indices]
            numel = sum(n for _, n in chunk)
            buckets.append(Bucket(params=tuple(chunk), padded=-(-numel // pad) * pad))
    return buckets


def owned(buckets: list[Bucket], *, dp: int) -> dict[str, int]:
    """Elements of each parameter inside dp rank 0's piece of every bucket (ZeRO)."""
    out: dict[str, int] = {}
    for bucket in buckets:
        size, offset = bucket.piece(dp), 0
        for name, numel in bucket.params:
            inside = max(0, min(offset + numel, size) - offset)
            if inside:
                out[name] = out.get(name, 0) + inside
            offset += numel
    return out


@dataclass(frozen=True)
class RankState:
    weight_bytes: int
    grad_bytes: int
    master_bytes: int  # float32 copies under mixed precision, else 0 (the weights are the masters)
    moment_bytes: int  # exp_avg + exp_avg_sq
    step_bytes: int

    @property
    def optimizer_bytes(self) -> int:
        return self.master_bytes + self.moment_bytes + self.step_bytes

    @property
    def bytes(self) -> int:
        return self.weight_bytes + self.grad_bytes + self.optimizer_bytes


def rank_state(params: list[tuple[str, int]], *, sharded: list[tuple[list[Bucket], int]], param_elem: int,
               grad_elem: int, mixed: bool) -> RankState:
    """Bytes of one rank's weights, gradients and AdamW state. ``sharded``: ZeRO-1's bucket sets as
    ``bucket_layout`` cut them, each with the number of ranks it is split over (the dp x cp buckets
    over dp x cp, the ep-sharded experts' over their expert replicas); a parameter in none of them
    keeps its whole gradient and state."""
    numel = sum(n for _, n in params)
    split = {name for buckets, _ in sharded for b in buckets for name, _ in b.params}
    whole = [(name, n) for name, n in params if name not in split]
    stepped, tensors, grads = sum(n for _, n in whole), len(whole), sum(n for _, n in whole)
    for buckets, ranks in sharded:
        mine = owned(buckets, dp=ranks)
        stepped, tensors = stepped + sum(mine.values()), tensors + len(mine)
        grads += sum(b.padded for b in buckets)
    master_elem = MASTER_ELEM if mixed else param_elem
    return RankState(weight_bytes=numel * param_elem, grad_bytes=grads * grad_elem,
                     master_bytes=stepped * MASTER_ELEM if mixed else 0, moment_bytes=2 * stepped * master_elem,
                     step_bytes=tensors * STEP_BYTES)
