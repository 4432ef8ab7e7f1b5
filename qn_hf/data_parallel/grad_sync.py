"""Gradient synchronization after a step's backward, in one place.

1. dp: the buckets' reductions (started during backward) finish. Unsharded, every rank then holds
   the dp-summed gradient in ``.grad``; sharded (ZeRO-1), each rank holds its pieces only. Experts
   sharded over ep have buckets of their own, summed over the ranks holding the same experts (the
   expert replicas), and under ZeRO-1 sharded over those ranks: an expert block's optimizer state is
   split among the ranks that hold that block, not over dp.
2. KV-head replicas: ranks holding copies of the same KV heads sum their gradients (each copy saw
   the queries of its own rank's heads only).
3. Replicated parameters applied to this rank's heads only (per-head norms) hold this rank's share
   of their gradient: the sum over tp is the whole gradient, then equal on every rank.
4. A weight tied across the first and last stage: both copies' gradients summed over the pair; a
   module held on every stage (Gemma 4's per-layer embeddings): its copies' gradients summed over pp.
5. Once, the proof that every other replicated gradient agrees over tp (replica_check.py).
6. float16: unscale, and record whether any rank overflowed.
7. A backward that finds ``.grad`` still holding the last sync's result (accumulating over
   ``train_step`` calls without ``no_sync``) sets it aside first, and adds it after this sync: each
   sum above would otherwise count it again (dp=2: three times the gradient of the first call).
8. Where this rank holds a part of the gradients only (tp, pp, ep, ZeRO-1's pieces), torch's own
   norm over them is refused until the next backward (grad_norm.py).

The sums of 2-4 are linear, so they commute with the dp sum and work on the sharded pieces too:
every tp rank lays its buckets out identically (same shapes), and tied weights and those held on
every stage sit in buckets of their own, so a piece covers the same elements on every rank of those groups. The loss is already
divided by the global target count, so the dp sum is the average the plain model computes.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator

import torch
from torch import nn

from ..comm import flat_all_reduce_
from ..placement import Copies, ShardPlacement
from ..tensor_parallel.replica_check import check_replicated_grads
from .buckets import GradBuckets, Piece, bucket_size_bytes, grad_dtype
from .grad_norm import guard_grads, partial_grads_refusal, unguard_grads
from .precision import LossScaler
from .sharded import kept_whole, local


class GradSync:
    def __init__(self, *, module: nn.Module, placement: ShardPlacement, grad_sum: tuple[str, ...],
                 buckets: GradBuckets | None, expert_buckets: GradBuckets | None,
                 scaler: LossScaler | None) -> None:
        self.module = module
        self.placement = placement
        self.grad_sum = grad_sum
        self.buckets = buckets
        self.expert_buckets = expert_buckets
        self.scaler = scaler
        self._replicas_checked = False
        self._guarded = False  # the gradients are re-typed so torch's norm refuses them (grad_norm.py)
        self._synced = False  # .grad holds the last sync's sums (unless zeroed since)
        self._set_aside: list[tuple[nn.Parameter, torch.Tensor]] = []  # ... taken out until the next sync
        # sharded: the layout (ids of the sets' piece lists), each piece's HF name, the split parameters
        self._piece_names: tuple[tuple[int, ...], list[str], frozenset[int]] | None = None

    @property
    def bucket_sets(self) -> tuple[GradBuckets, ...]:
        """The bucket sets that exist: over dp x cp, and over the expert replicas."""
        return tuple(b for b in (self.buckets, self.expert_buckets) if b is not None)

    @property
    def sharded(self) -> bool:
        """Whether some gradients are held only as this rank's pieces (ZeRO-1)."""
        return any(b.sharded for b in self.bucket_sets)

    @property
    def dense_sharded(self) -> bool:
        """Whether the gradients summed over dp x cp are held as pieces (ZeRO-1)."""
        return self.buckets is not None and self.buckets.sharded

    @property
    def experts_sharded(self) -> bool:
        """Whether the ep-sharded experts' gradients are held as pieces over their expert replicas."""
        return self.expert_buckets is not None and self.expert_buckets.sharded

    @property
    def reduced(self) -> bool:
        """Sharded: the last step's gradients were reduce-scattered in place and not yet consumed."""
        return any(b.reduced for b in self.bucket_sets)

    def shard(self, *, separate: list[list[nn.Parameter]]) -> None:
        """ZeRO-1: shard every bucket set over its own group (``separate``: weights tied across stages,
        and those held on every stage, each list in buckets of its own)."""
        for buckets in self.bucket_sets:
            buckets.shard_over_dp(separate=separate, model=self.module)

    @property
    def sharded_sets(self) -> tuple[GradBuckets, ...]:
        """The bucket sets held as this rank's pieces (ZeRO-1)."""
        return tuple(b for b in self.bucket_sets if b.sharded)

    def split_params(self) -> frozenset[int]:
        """Ids of the parameters whose gradients (and optimizer data) live in pieces over their group."""
        return frozenset(id(p) for b in self.sharded_sets for p in b.params)

    def pieces(self) -> list[Piece]:
        """This rank's pieces of every sharded bucket set, in a fixed order."""
        return [piece for b in self.sharded_sets for piece in b.pieces()]

    def gather_weights(self) -> None:
        for buckets in self.sharded_sets:
            buckets.gather_weights()

    def wait_weights(self) -> None:
        for buckets in self.sharded_sets:
            buckets.wait_weights()

    def zero_reduced(self) -> None:
        for buckets in self.sharded_sets:
            buckets.zero_reduced()

    def named_grads(self) -> Iterator[tuple[str, torch.Tensor]]:
        """This rank's gradients by HF name: whole ``.grad`` tensors, and, sharded, the flat pieces
        this rank owns of the parameters in sharded buckets."""
        if self.sharded:
            pieces = self.pieces()
            layout = tuple(id(b.pieces()) for b in self.sharded_sets)  # each set's pieces, made once
            if self._piece_names is None or self._piece_names[0] != layout:
                names = {id(p): n for n, p in self.module.named_parameters()}
                self._piece_names = (layout, [names[id(piece.param)] for piece in pieces], self.split_params())
            yield from zip(self._piece_names[1], (piece.grad for piece in pieces))
        split = self._piece_names[2] if self.sharded else frozenset()
        for name, p in self.module.named_parameters():
            if p.requires_grad and p.grad is not None and id(p) not in split:
                yield name, local(p.grad)  # dp_shard: this rank's rows of the summed gradient

    def arm(self, params: Iterable[nn.Parameter] | None = None) -> None:
        """The next gradient of ``params`` (default: all) is final: buckets launch as they fill."""
        params = None if params is None else list(params)
        for buckets in self.bucket_sets:
            buckets.arm(params)

    def disarm(self) -> None:
        """Before a step: nothing is armed (a failed step may have left buckets armed), and the
        gradients have their own class again."""
        for buckets in self.bucket_sets:
            buckets.disarm()
        if self._guarded:
            unguard_grads(self.module)
            self._guarded = False
        if self._synced:
            self._set_synced_aside()

    def _set_synced_aside(self) -> None:
        """Take the last sync's gradients out of ``.grad`` (a copy where ``.grad`` is a bucket's slot,
        which the next backward reuses; the tensor itself elsewhere), so this step sums its own only.
        Zeroed with ``set_to_none=False``, they are copied for nothing: None costs nothing."""
        self._synced = False
        held = [p for p in self.module.parameters() if p.grad is not None]
        if not held:  # zeroed with set_to_none, as after every optimizer step by default
            return
        slotted = {id(p) for b in self.bucket_sets for p in b.params}
        for p in held:
            self._set_aside.append((p, p.grad.clone() if id(p) in slotted else p.grad))
            p.grad = None

    def sync(self) -> None:
        for buckets in self.bucket_sets:
            buckets.finish()
        # every rank must contribute the same buffers: an unused parameter sends zeros (pieces always exist)
        split = self.split_params() if self.sharded else frozenset()
        for p in self.module.parameters():
            if p.requires_grad and p.grad is None and id(p) not in split:
                p.grad = torch.zeros_like(p, dtype=grad_dtype(p))
        grads = dict(self.named_grads())
        groups, copies = self.placement.groups, self.placement.copies
        if groups.kv is not None:
            flat_all_reduce_([g for n, g in grads.items() if copies(n) is Copies.KV_REPLICA], group=groups.kv)
        partial = [grads[n] for n in self.grad_sum if n in grads]
        if partial:
            flat_all_reduce_(partial, group=groups.tp)
        if groups.tie is not None:
            flat_all_reduce_([grads[n] for n in self.placement.tied_names(grads)], group=groups.tie)
        shared = self.placement.every_stage_names(grads)
        if shared:  # each stage's copy holds the share of its own blocks' use
            flat_all_reduce_([grads[n] for n in shared], group=groups.pp)
        if not self._replicas_checked:  # once: the dataflow that makes a gradient partial never changes
            self._replicas_checked = True
            check_replicated_grads({n: g for n, g in grads.items() if copies(n) is Copies.TP_REPLICATED},
                                   group=groups.tp)
        if self.scaler is not None:
            self.scaler.unscale_(list(grads.values()), device=self.placement.device)
        for p, held in self._set_aside:
            if p.grad is None:
                p.grad = held
            else:
                p.grad.add_(held)
        self._set_aside.clear()
        self._synced = not self.sharded  # ZeRO-1's pieces are consumed by the optimizer's zero_grad
        why = partial_grads_refusal(self.placement.dims, pieces=self.sharded)
        if why is not None:
            guard_grads(self.module, why, pieces=[(p, b.view(p)) for b in self.sharded_sets for p in b.params])
            self._guarded = True


def grad_buckets(model: nn.Module, placement: ShardPlacement, bucket_mb: float, *,
                 experts: bool) -> GradBuckets | None:
    """The buckets of the parameters summed over the ranks that hold the same copy: the ep-sharded
    experts over the expert replicas (``experts``), everything else over dp x cp. cp ranks hold the
    same weights and see different tokens of the same sequences: their gradients are partial sums
    like those of dp ranks, so one reduction covers both."""
    group, size = ((placement.groups.experts, placement.dims.expert_replicas) if experts
                   else (placement.groups.replicas, placement.dims.replicas))
    if size == 1:
        return None
    if placement.dims.dp_shard > 1:  # FSDP reduces (sharded.py), the experts' too, but not what it keeps whole
        params = [] if experts else [p for p in kept_whole(model) if p.requires_grad]
    else:
        params = [p for n, p in model.named_parameters()
                  if p.requires_grad and (placement.copies(n) is Copies.EXPERTS) == experts]
    params = [p for p in params if p.numel() > 0]  # an empty gradient has nothing to sum
    return GradBuckets(params, group=group, bucket_bytes=bucket_size_bytes(bucket_mb)) if params else None
