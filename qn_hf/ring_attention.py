"""Ring attention over the context-parallel ranks: exact causal attention of a sequence split over cp.

The sequence is cut into ``2 * cp`` chunks of equal length and rank ``r`` holds two of them
(``ChunkLayout``): with the balanced layout chunks ``r`` and ``2cp-1-r``, so that under the causal
mask every rank has the same amount of work; the contiguous layout (chunks ``2r`` and ``2r+1``) is
there to measure the difference. Keys and values travel around the ring: at step ``i`` rank ``r``
holds the block of rank ``r - i``, sends it on to ``r + 1`` and receives the next from ``r - 1``
while it computes (the transfer is posted before the block's attention and waited for after it).

Each (query chunk, key chunk) pair is skipped when every key comes after every query, causal on
the diagonal and fully visible below it; within it the documents of a packed sequence and the
padding of the keys are masked. Blocks are merged with the online softmax (running maximum, sum
and weighted values in float32), as flash attention merges tiles, so the result is exact.

Like flash attention, the forward keeps only this rank's queries, keys, values, output and the
log-sum-exp of each query row; the backward goes around the ring again, recomputes each block's
probabilities from them, adds its query gradient locally and the block's key and value gradients to
an accumulator that travels with the block, so that after a full circle each rank receives the
gradients of its own keys and values from every rank's queries. A block's accumulator travels while
the next rank computes its own share of that block, so both directions of the ring overlap compute. Memory per rank is therefore
proportional to sequence/cp (no sequence x sequence term), and the bytes on cp per attention call are
(cp-1) key/value blocks forward and cp blocks with their gradients backward.
"""

from __future__ import annotations

from dataclasses import dataclass

import time

import torch
import torch.distributed as dist
from torch.distributed import ProcessGroup


@dataclass(frozen=True)
class ChunkLayout:
    """Which two of the ``2 * size`` equal chunks of the sequence each cp rank holds."""

    size: int
    balanced: bool = True

    def chunks(self, rank: int) -> tuple[int, int]:
        return (rank, 2 * self.size - 1 - rank) if self.balanced else (2 * rank, 2 * rank + 1)

    def positions(self, rank: int, length: int) -> torch.Tensor:
        """The indices into the whole sequence (of ``length``) of the tokens ``rank`` holds, in order."""
        chunk = length // (2 * self.size)
        return torch.cat([torch.arange(c * chunk, (c + 1) * chunk) for c in self.chunks(rank)])


def _exchange(send: torch.Tensor, group: ProcessGroup) -> tuple[torch.Tensor, list]:
    """Post: send ``send`` to the next rank, receive the previous rank's into a new tensor."""
    rank, size = dist.get_rank(group), dist.get_world_size(group)
    received = torch.empty_like(send)
    ops = [dist.P2POp(dist.isend, send, group=group, group_peer=(rank + 1) % size),
           dist.P2POp(dist.irecv, received, group=group, group_peer=(rank - 1) % size)]
    return received, dist.batch_isend_irecv(ops)


def _wait(works: list) -> None:
    for work in works:
        work.wait()


def _pairs(layout: ChunkLayout, rank: int, owner: int, documents: torch.Tensor, valid: torch.Tensor, chunk: int):
    """(query part, key part, visible [b, chunk, chunk]) of every pair of this rank's query chunks and
    ``owner``'s key chunks that has a visible key; the others are skipped."""
    docs = documents.unfold(1, chunk, chunk)  # [b, 2*cp, chunk]
    keep = valid.bool().unfold(1, chunk, chunk)
    for qi, qc in enumerate(layout.chunks(rank)):
        for ki, kc in enumerate(layout.chunks(owner)):
            if kc > qc:
                continue  # every key comes after every query
            visible = (docs[:, qc, :, None] == docs[:, kc, None, :]) & keep[:, kc, None, :]
            if kc == qc:
                visible = visible & torch.ones(chunk, chunk, dtype=torch.bool, device=visible.device).tril()
            yield slice(qi * chunk, (qi + 1) * chunk), slice(ki * chunk, (ki + 1) * chunk), visible[:, None]


def _scores(qf: torch.Tensor, kf: torch.Tensor, qs: slice, ks: slice, visible: torch.Tensor) -> torch.Tensor:
    """The (scaled) scores of one query part against one key part, -inf where a key is not visible."""
    return (qf[:, :, qs] @ kf[:, :, ks].transpose(-1, -2)).masked_fill(~visible, float("-inf"))


class _RingAttention(torch.autograd.Function):
    """Forward: online-softmax over the ring; backward: the ring again with recomputed probabilities."""

    @staticmethod
    def forward(ctx, q, k, v, documents, valid, layout: ChunkLayout, group: ProcessGroup, scaling: float,
                events: list | None):
        rank, size = dist.get_rank(group), layout.size
        chunk, groups = q.shape[2] // 2, q.shape[1] // k.shape[1]
        qf = q.float() * scaling
        top = qf.new_full(qf.shape[:3], float("-inf"))
        total = qf.new_zeros(qf.shape[:3])
        acc = qf.new_zeros(qf.shape)
        block = torch.stack([k, v])  # travels the ring as one tensor
        for step in range(size):
            incoming, works = _exchange(block, group) if step < size - 1 else (None, [])
            started = time.perf_counter()
            kf, vf = (t.float().repeat_interleave(groups, dim=1) for t in block)  # GQA: a KV head serves its group
            for qs, ks, visible in _pairs(layout, rank, (rank - step) % size, documents, valid, chunk):
                scores = _scores(qf, kf, qs, ks, visible)
                new_top = torch.maximum(top[:, :, qs], scores.amax(dim=-1))
                safe = new_top.masked_fill(new_top == float("-inf"), 0.0)  # rows with no visible key yet
                weights = (scores - safe.unsqueeze(-1)).exp()
                decay = (top[:, :, qs] - safe).exp()
                total[:, :, qs] = total[:, :, qs] * decay + weights.sum(dim=-1)
                acc[:, :, qs] = acc[:, :, qs] * decay.unsqueeze(-1) + weights @ vf[:, :, ks]
                top[:, :, qs] = new_top
            computed = time.perf_counter()
            _wait(works)
            if events is not None:
                events.append(("forward", step, started, computed, time.perf_counter()))
            block = incoming if incoming is not None else block
        seen = total > 0  # a query with no visible key (padding) gets zeros, and no gradient
        out = acc / total.clamp_min(torch.finfo(total.dtype).tiny).unsqueeze(-1)
        lse = torch.where(seen, top + total.clamp_min(torch.finfo(total.dtype).tiny).log(), float("inf"))
        ctx.save_for_backward(q, k, v, documents, valid, out, lse)
        ctx.layout, ctx.group, ctx.scaling, ctx.events = layout, group, scaling, events
        return out.to(q.dtype)

    @staticmethod
    def backward(ctx, grad_out):
        q, k, v, documents, valid, out, lse = ctx.saved_tensors
        layout, group, scaling = ctx.layout, ctx.group, ctx.scaling
        rank, size = dist.get_rank(group), layout.size
        chunk, groups = q.shape[2] // 2, q.shape[1] // k.shape[1]
        qf, go = q.float() * scaling, grad_out.float()
        delta = (go * out).sum(dim=-1)  # the softmax backward's row term, sum_j p_ij dp_ij
        grad_q = torch.zeros_like(qf)
        block = torch.stack([k, v])
        # The accumulator of the block in hand arrives from the previous rank while this rank computes
        # its own contribution (kept apart in ``mine``), and is sent on right after the two are added.
        grads, grad_works = torch.zeros(block.shape, dtype=torch.float32, device=block.device), []
        for step in range(size):
            incoming, works = _exchange(block, group) if step < size - 1 else (None, [])
            started = time.perf_counter()
            kf, vf = (t.float().repeat_interleave(groups, dim=1) for t in block)
            grad_k, grad_v = torch.zeros_like(kf), torch.zeros_like(vf)
            for qs, ks, visible in _pairs(layout, rank, (rank - step) % size, documents, valid, chunk):
                scores = _scores(qf, kf, qs, ks, visible)
                probs = (scores - lse[:, :, qs].unsqueeze(-1)).exp()
                grad_v[:, :, ks] += probs.transpose(-1, -2) @ go[:, :, qs]
                grad_scores = probs * (go[:, :, qs] @ vf[:, :, ks].transpose(-1, -2) - delta[:, :, qs].unsqueeze(-1))
                grad_q[:, :, qs] += grad_scores @ kf[:, :, ks]
                grad_k[:, :, ks] += grad_scores.transpose(-1, -2) @ qf[:, :, qs]
            b, h, s, d = grad_k.shape  # each KV head's gradient is the sum over the query heads it served
            mine = torch.stack([grad_k.view(b, h // groups, groups, s, d).sum(dim=2),
                                grad_v.view(b, h // groups, groups, s, d).sum(dim=2)])
            computed = time.perf_counter()
            _wait(grad_works)  # the accumulator of this block, from the previous rank
            # it goes on with the block; after the last step it returns to the block's owner
            grads, grad_works = _exchange(grads + mine, group)
            _wait(works)
            if ctx.events is not None:
                ctx.events.append(("backward", step, started, computed, time.perf_counter()))
            block = incoming if incoming is not None else block
        _wait(grad_works)
        # the scores were taken from the scaled queries: the query gradient takes the scale once more,
        # the key gradient (accumulated from scaled queries) already has it
        return (grad_q * scaling).to(q.dtype), grads[0].to(k.dtype), grads[1].to(v.dtype), None, None, None, None, None, None


def ring_attention(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, *, documents: torch.Tensor,
                   valid: torch.Tensor, layout: ChunkLayout, group: ProcessGroup, scaling: float,
                   events: list | None = None) -> torch.Tensor:
    """Causal attention of this rank's queries over the whole sequence's keys.

    ``query`` is [b, heads, s, d] and ``key``/``value`` [b, kv_heads, s, d] for this rank's
    ``s = 2 * chunk`` tokens (``layout``); ``documents`` and ``valid`` are [b, sequence] for the whole
    sequence (document index of each token, and whether it may be attended to). Returns
    [b, heads, s, d] in the query's dtype. ``events`` (a list) receives one
    ``(pass, step, started, computed, received)`` time record per ring step, for a timeline."""
    return _RingAttention.apply(query, key, value, documents, valid, layout, group, scaling, events)
