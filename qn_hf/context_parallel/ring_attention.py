"""Ring attention over the context-parallel ranks: exact causal attention of a sequence split over cp.

The sequence is cut into ``2 * cp`` pieces of equal length and rank ``r`` holds two of them
(``PieceLayout``): with the balanced layout pieces ``r`` and ``2cp-1-r``, so that under the causal
mask every rank has the same amount of work; the contiguous layout (pieces ``2r`` and ``2r+1``) is
there to measure the difference. Keys and values travel around the ring: at step ``i`` rank ``r``
holds the block of rank ``r - i``, sends it on to ``r + 1`` and receives the next from ``r - 1``
while it computes (the transfer is posted before the block's attention and waited for after it).

Each ring step is one call of torch's fused attention (``kernels.py``), which returns the block's output and the
log-sum-exp of each query row: ``_scaled_dot_product_flash_attention_for_cpu`` on CPU; on CUDA
flash attention for 16-bit blocks without a mask, memory-efficient attention (with an additive
bias) otherwise. Which rows and columns the call covers follows from the global positions alone
(``ring_block``): every key before every query needs no mask, the rank's own block (the same
positions on both sides) is the kernel's causal mask, anything else an explicit one. Documents of
a packed sequence and padded keys add an explicit mask to every block, and only then (the own
block keeps the kernel's causal flag too, so that the kernel skips the tiles above the diagonal). Blocks are
merged by log-sum-exp in float32 (``out = out * e^(lse - new) + out_i * e^(lse_i - new)``), as flash
attention merges tiles, so the result is exact. Grouped-query attention runs unexpanded where the
kernel allows it (CPU, CUDA flash); CUDA's memory-efficient kernel needs as many KV heads as query
heads, so they are expanded for it.

Like flash attention, the forward keeps only this rank's queries, keys, values, output (in their
dtype) and the float32 log-sum-exp of each query row; the backward goes around the ring again and
calls the kernel's backward with the global output and log-sum-exp, which recomputes the block's
share of the probabilities and gives exactly that block's share of the query, key and value
gradients. The query gradient adds up locally in float32, the key and value gradients in a float32
accumulator that travels with the block, so that after a full circle each rank receives the
gradients of its own keys and values from every rank's queries. A block's accumulator travels while
the next rank computes its own share of that block, so both directions of the ring overlap compute.
Memory per rank is therefore linear in sequence/cp, except the masks of masked blocks, built per
block and step and dropped after it ([b, 1, rows, columns] in the query's dtype); the bytes on cp
per attention call are (cp-1) key/value blocks forward and cp blocks with their gradients backward.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch.distributed import ProcessGroup

from .kernels import NEG_INF, kernels


@dataclass(frozen=True)
class PieceLayout:
    """Which two of the ``2 * size`` equal pieces of the sequence each cp rank holds."""

    size: int
    balanced: bool = True

    def pieces(self, rank: int) -> tuple[int, int]:
        return (rank, 2 * self.size - 1 - rank) if self.balanced else (2 * rank, 2 * rank + 1)

    def positions(self, rank: int, length: int, *, device: torch.device | str | None = None) -> torch.Tensor:
        """The indices into the whole sequence (of ``length``) of the tokens ``rank`` holds, in order."""
        piece = length // (2 * self.size)
        return torch.cat([torch.arange(p * piece, (p + 1) * piece, device=device) for p in self.pieces(rank)])


@dataclass(frozen=True)
class RingBlock:
    """The one kernel call of a ring step: this rank's query rows against the held block's key rows."""

    queries: slice
    keys: slice
    full: bool  # every key comes before every query: no causal mask
    causal: bool  # the same positions on both sides, increasing: the kernel's causal mask is the global one


def _nearest(qp: int, kp: int, piece: int) -> int:
    """The smallest query - key distance between query piece ``qp`` and key piece ``kp <= qp``."""
    return (qp - kp - 1) * piece + 1 if kp < qp else 0


def _farthest(qp: int, kp: int, piece: int) -> int:
    return (qp - kp + 1) * piece - 1


def ring_block(layout: PieceLayout, *, rank: int, owner: int, piece: int, window: int | None = None) -> RingBlock | None:
    """What ``rank``'s queries compute against ``owner``'s keys under the causal mask (and, with a
    sliding ``window``, transformers' ``key > query - window``), or None when no query sees any key
    of the block: with a window, a block wholly before every query's window is skipped, no kernel
    call. The rows and columns are those of the piece pairs with a visible key (one rectangle: the
    pairs of two pieces each). The rectangle needs no mask when every key in it is visible to every
    query; the kernel's causal flag serves when both sides hold the same positions and the window
    cuts nothing in it. ``piece``: the number of tokens in one piece."""
    mine, theirs = layout.pieces(rank), layout.pieces(owner)
    reach = float("inf") if window is None else window  # visible: 0 <= query - key < reach
    pairs = [(qi, ki) for qi, qp in enumerate(mine) for ki, kp in enumerate(theirs)
             if kp <= qp and _nearest(qp, kp, piece) < reach]
    if not pairs:
        return None
    q0, q1 = min(p[0] for p in pairs), max(p[0] for p in pairs) + 1
    k0, k1 = min(p[1] for p in pairs), max(p[1] for p in pairs) + 1
    rect = [(qp, kp) for qp in mine[q0:q1] for kp in theirs[k0:k1]]
    return RingBlock(queries=slice(q0 * piece, q1 * piece), keys=slice(k0 * piece, k1 * piece),
                     full=all(kp < qp and _farthest(qp, kp, piece) < reach for qp, kp in rect),
                     causal=mine[q0:q1] == theirs[k0:k1] and all(_farthest(qp, kp, piece) < reach
                                                                 for qp, kp in rect if kp <= qp))


def ring_blocks(layout: PieceLayout, *, rank: int, owner: int, piece: int, window: int | None = None) -> list[RingBlock]:
    """The kernel calls of one ring step: under the causal mask alone ``ring_block``'s one rectangle
    (or none). With a sliding window one call per piece pair that has a visible key: a rectangle
    over two pieces would compute the pairs the window hides as well, and mask all of them; per pair,
    a piece pair wholly inside every window needs no mask, the diagonal pair the kernel's causal flag
    (when the window is at least a piece), and only the pairs at the window's edge a mask."""
    if window is None:
        block = ring_block(layout, rank=rank, owner=owner, piece=piece)
        return [] if block is None else [block]
    blocks = []
    for qi, qp in enumerate(layout.pieces(rank)):
        for ki, kp in enumerate(layout.pieces(owner)):
            if kp > qp or _nearest(qp, kp, piece) >= window:
                continue
            inside = _farthest(qp, kp, piece) < window  # every key of the pair within every query's window
            blocks.append(RingBlock(queries=slice(qi * piece, (qi + 1) * piece), keys=slice(ki * piece, (ki + 1) * piece),
                                    full=kp < qp and inside, causal=kp == qp and inside))
    return blocks


def needs_mask(*, documents: torch.Tensor, valid: torch.Tensor) -> bool:
    """Whether any sequence of the batch packs several documents or has padding (one host sync)."""
    return bool(((documents != documents[:, :1]).any() | (valid == 0).any()).item())


def _mask(plan: RingBlock, *, layout: PieceLayout, rank: int, owner: int, documents: torch.Tensor,
          valid: torch.Tensor, dtype: torch.dtype, window: int | None) -> tuple[torch.Tensor, torch.Tensor]:
    """(additive mask [b, 1, rows, columns] with -inf where a key is hidden, whether each query row
    [b, rows] sees any key): causal by global position, within the window, within a document, valid
    keys only."""
    length, device = documents.shape[1], documents.device
    at_q = layout.positions(rank, length, device=device)[plan.queries]
    at_k = layout.positions(owner, length, device=device)[plan.keys]
    # [b, rows, columns], narrowed in place: one quadratic boolean besides the mask, not one per term
    visible = documents[:, at_q, None] == documents[:, None, at_k]
    visible &= valid[:, None, at_k].bool()
    if not plan.full:
        visible &= at_k[None, None, :] <= at_q[None, :, None]
        if window is not None:
            visible &= at_k[None, None, :] > at_q[None, :, None] - window
    mask = torch.zeros(visible.shape, dtype=dtype, device=device).masked_fill_(visible.logical_not(), NEG_INF)
    return mask[:, None], visible.any(dim=-1)


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


def _merge(out: torch.Tensor, lse: torch.Tensor, block_out: torch.Tensor, block_lse: torch.Tensor,
           seen: torch.Tensor | None) -> None:
    """Fold one block's output and log-sum-exp into the running ones (views into the call's)."""
    if seen is not None:  # a row that sees no key of this block: the kernel's output and lse mean nothing
        block_lse = block_lse.masked_fill(~seen[:, None], NEG_INF)
        block_out = block_out.masked_fill(~seen[:, None, :, None], 0.0)
    new = torch.logaddexp(lse, block_lse)
    safe = new.masked_fill(new == NEG_INF, 0.0)  # rows with no visible key yet: both weights 0
    out.mul_((lse - safe).exp().unsqueeze(-1)).add_(block_out * (block_lse - safe).exp().unsqueeze(-1))
    lse.copy_(new)


@dataclass(frozen=True)
class Attending:
    """What every ring step's attention reads besides the tensors it computes on: which pieces the cp
    ranks hold, each token's document and whether it may be attended to ([b, sequence] for the whole
    sequence), whether a mask is needed at all, the scores' scaling, the sliding window and the softcap."""

    layout: PieceLayout
    documents: torch.Tensor
    valid: torch.Tensor
    masked: bool
    scaling: float
    window: int | None = None
    softcap: float | None = None


def attend_block(q: torch.Tensor, block: torch.Tensor, out: torch.Tensor, lse: torch.Tensor, *, rule: Attending,
                 rank: int, owner: int) -> None:
    """One ring step's forward on ``rank``: fold the attention of its queries ``q`` over the keys and
    values of ``owner``'s pieces (``block``: [2, b, kv_heads, s, d], as it travels the ring) into the
    running float32 ``out`` and ``lse``. The ring calls it once per step; a one-process simulation of
    a ring (``make gpu-check``'s kernel check) calls it for every rank and owner."""
    r = rule
    for plan in ring_blocks(r.layout, rank=rank, owner=owner, piece=q.shape[2] // 2, window=r.window):
        mask, seen = (_mask(plan, layout=r.layout, rank=rank, owner=owner, documents=r.documents, valid=r.valid,
                            dtype=q.dtype, window=r.window) if r.masked or not (plan.full or plan.causal) else (None, None))
        attend, _ = kernels(q, masked=mask is not None, softcap=r.softcap)
        rows, cols = plan.queries, plan.keys
        block_out, block_lse = attend(q[:, :, rows], block[0][:, :, cols], block[1][:, :, cols], plan.causal, mask,
                                      r.scaling)
        _merge(out[:, :, rows], lse[:, :, rows], block_out, block_lse, seen)


def backward_inputs(grad_out: torch.Tensor, lse: torch.Tensor, *, masked: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """The output gradient and log-sum-exp the backward steps take: a query that sees no key anywhere
    (padding) got zeros, so no gradient, whatever arrives for it, and a finite lse so that the
    kernel's exp(score - lse) is 0 rather than NaN."""
    seen = lse > NEG_INF
    grad_out = grad_out.masked_fill(~seen.unsqueeze(-1), 0.0) if masked else grad_out
    return grad_out, lse.masked_fill(~seen, 0.0)


def attend_block_backward(grad_out: torch.Tensor, q: torch.Tensor, block: torch.Tensor, out: torch.Tensor,
                          lse: torch.Tensor, grad_q: torch.Tensor, *, rule: Attending, rank: int,
                          owner: int) -> list[tuple[slice, torch.Tensor, torch.Tensor]]:
    """One ring step's backward on ``rank`` (``grad_out`` and ``lse`` from ``backward_inputs``, ``out``
    the forward's output): add its queries' gradient over ``owner``'s block to the float32 ``grad_q``
    and return this rank's share of that block's key and value gradients, (key rows, grad k, grad v)
    per kernel call."""
    shares, r = [], rule
    for plan in ring_blocks(r.layout, rank=rank, owner=owner, piece=q.shape[2] // 2, window=r.window):
        mask = (_mask(plan, layout=r.layout, rank=rank, owner=owner, documents=r.documents, valid=r.valid,
                      dtype=q.dtype, window=r.window)[0] if r.masked or not (plan.full or plan.causal) else None)
        _, attend_backward = kernels(q, masked=mask is not None, softcap=r.softcap)
        rows, cols = plan.queries, plan.keys
        grad_q_i, grad_k_i, grad_v_i = attend_backward(
            grad_out[:, :, rows], q[:, :, rows], block[0][:, :, cols], block[1][:, :, cols], out[:, :, rows],
            lse[:, :, rows].contiguous(), plan.causal, mask, r.scaling)
        grad_q[:, :, rows] += grad_q_i
        shares.append((cols, grad_k_i, grad_v_i))
    return shares


class _RingAttention(torch.autograd.Function):
    """Forward: fused attention per ring step, merged by log-sum-exp; backward: the ring again, fused backward."""

    @staticmethod
    def forward(ctx, q, k, v, sinks, rule: Attending, group: ProcessGroup, events: list | None):
        rank, size = dist.get_rank(group), rule.layout.size
        out = torch.zeros(q.shape, dtype=torch.float32, device=q.device)
        lse = torch.full(q.shape[:3], NEG_INF, dtype=torch.float32, device=q.device)
        block = torch.stack([k, v])  # travels the ring as one tensor
        for step in range(size):
            incoming, works = _exchange(block, group) if step < size - 1 else (None, [])
            started = time.perf_counter()
            attend_block(q, block, out, lse, rule=rule, rank=rank, owner=(rank - step) % size)
            computed = time.perf_counter()
            _wait(works)
            if events is not None:
                events.append(("forward", step, started, computed, time.perf_counter()))
            block = incoming if incoming is not None else block
        if sinks is not None:  # one more logit per head in every row's softmax, with no value: it only scales
            total = torch.logaddexp(lse, sinks.float()[None, :, None])
            out.mul_((lse - total).exp().unsqueeze(-1))
            lse = total
        out = out.to(q.dtype)
        ctx.save_for_backward(q, k, v, sinks, out, lse)
        ctx.rule, ctx.group, ctx.events = rule, group, events  # the rule's tensors need no gradient
        return out

    @staticmethod
    def backward(ctx, grad_out):
        q, k, v, sinks, out, lse = ctx.saved_tensors
        rule, group = ctx.rule, ctx.group
        rank, size = dist.get_rank(group), rule.layout.size
        grad_out, lse = backward_inputs(grad_out, lse, masked=rule.masked)
        grad_sinks = None
        if sinks is not None:  # the sink's probability times (its value's product with dO, 0, minus rowsum(dO * O))
            delta = (grad_out.float() * out.float()).sum(dim=-1)
            grad_sinks = -((sinks.float()[None, :, None] - lse).exp() * delta).sum(dim=(0, 2)).to(sinks.dtype)
        grad_q = torch.zeros(q.shape, dtype=torch.float32, device=q.device)
        block = torch.stack([k, v])
        # The accumulator of the block in hand arrives from the previous rank while this rank computes
        # its own share of that block, added right after it arrives and sent on.
        grads, grad_works = torch.zeros(block.shape, dtype=torch.float32, device=block.device), []
        for step in range(size):
            incoming, works = _exchange(block, group) if step < size - 1 else (None, [])
            started = time.perf_counter()
            shares = attend_block_backward(grad_out, q, block, out, lse, grad_q, rule=rule, rank=rank,
                                           owner=(rank - step) % size)
            computed = time.perf_counter()
            _wait(grad_works)  # the accumulator of this block, from the previous rank
            for cols, grad_k_i, grad_v_i in shares:
                grads[0][:, :, cols] += grad_k_i
                grads[1][:, :, cols] += grad_v_i
            # it goes on with the block; after the last step it returns to the block's owner
            grads, grad_works = _exchange(grads, group)
            _wait(works)
            if ctx.events is not None:
                ctx.events.append(("backward", step, started, computed, time.perf_counter()))
            block = incoming if incoming is not None else block
        _wait(grad_works)
        return grad_q.to(q.dtype), grads[0].to(k.dtype), grads[1].to(v.dtype), grad_sinks, None, None, None


def ring_attention(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, *, documents: torch.Tensor,
                   valid: torch.Tensor, layout: PieceLayout, group: ProcessGroup, scaling: float,
                   masked: bool | None = None, events: list | None = None, window: int | None = None,
                   softcap: float | None = None, sinks: torch.Tensor | None = None) -> torch.Tensor:
    """Causal attention of this rank's queries over the whole sequence's keys.

    ``query`` is [b, heads, s, d] and ``key``/``value`` [b, kv_heads, s, d] for this rank's
    ``s = 2 * piece`` tokens (``layout``); ``documents`` and ``valid`` are [b, sequence] for the whole
    sequence (document index of each token, and whether it may be attended to). ``masked`` says
    whether the batch has several documents in a sequence or padding (``needs_mask``; looked up here,
    one host sync, when None). ``window``: a sliding window (key > query - window, transformers'
    rule); ``softcap``: scores become ``softcap * tanh(scores / softcap)`` before the softmax;
    ``sinks`` [heads] (gpt-oss): one more logit per head in every query's softmax, attached to no
    value (its gradient is this rank's queries' share; the sum over cp is the data-parallel one). Returns
    [b, heads, s, d] in the query's dtype. ``events`` (a list) receives one ``(pass, step, started,
    computed, received)`` time record per ring step, for a timeline."""
    if masked is None:
        masked = needs_mask(documents=documents, valid=valid)
    rule = Attending(layout=layout, documents=documents, valid=valid, masked=masked, scaling=scaling, window=window,
                     softcap=softcap)
    return _RingAttention.apply(query, key, value, sinks, rule, group, events)
