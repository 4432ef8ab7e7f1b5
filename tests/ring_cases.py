"""Ring attention on every rank of a test world against plain float64 softmax attention over the
whole sequence, built from the same (seeded, dtype-rounded) inputs."""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist

from qn_hf.context_parallel.ring_attention import PieceLayout, ring_attention


@dataclass(frozen=True)
class StridedLayout(PieceLayout):
    """Rank ``r`` holds pieces ``r`` and ``r + cp``: its blocks against a lower rank are neither fully
    visible nor its own positions, so they take the explicit causal mask."""

    def pieces(self, rank: int) -> tuple[int, int]:
        return rank, rank + self.size


LAYOUTS = {"balanced": True, "contiguous": False}


def layout_named(name: str, size: int) -> PieceLayout:
    return StridedLayout(size=size) if name == "strided" else PieceLayout(size=size, balanced=LAYOUTS[name])


def batch_meta(*, batch: int, seq: int, packed: bool, padded: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """(documents, valid) [batch, seq]: packed rows hold documents of uneven lengths that cross piece
    borders; padded rows are left- (queries that see no key at all) and right-padded by turns."""
    documents = torch.zeros(batch, seq, dtype=torch.long)
    valid = torch.ones(batch, seq, dtype=torch.long)
    for row in range(batch):
        if packed:
            starts = [seq // 5 + row, seq // 2 + 1, seq - 3 - row]
            for start in starts:
                documents[row, start:] += 1
        if padded:
            if row % 2 == 0:
                valid[row, : seq // 4 + 1] = 0
            else:
                valid[row, seq - seq // 3:] = 0
    return documents, valid


def plain_attention(q, k, v, *, documents, valid, scaling, window=None, softcap=None, sinks=None):
    """Softmax attention over the whole sequence, causal (within ``window``: key > query - window),
    within documents, valid keys only, scores softcapped as Gemma 2's eager attention does; a query
    that sees no key gets zeros."""
    groups = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(groups, dim=1), v.repeat_interleave(groups, dim=1)
    pos = torch.arange(q.shape[2])
    causal = pos[None, :] <= pos[:, None]
    if window is not None:
        causal &= pos[None, :] > pos[:, None] - window
    visible = (causal[None] & (documents[:, :, None] == documents[:, None, :]) & valid[:, None, :].bool())[:, None]
    scores = q @ k.transpose(-1, -2) * scaling
    if softcap is not None:
        scores = torch.tanh(scores / softcap) * softcap
    scores = scores.masked_fill(~visible, float("-inf"))
    if sinks is not None:  # gpt-oss: one more logit per head, dropped after the softmax
        column = sinks[None, :, None, None].expand(*scores.shape[:3], 1)
        probs = torch.softmax(torch.cat([scores, column], dim=-1), dim=-1)[..., :-1]
        return probs @ v
    top = scores.amax(dim=-1, keepdim=True)
    weights = (scores - top.masked_fill(top == float("-inf"), 0.0)).exp()
    probs = weights / weights.sum(dim=-1, keepdim=True).clamp_min(torch.finfo(weights.dtype).tiny)
    return probs @ v


def ring_parity(*, layout: str, heads: int, kv_heads: int, dtype: str, packed: bool, padded: bool,
                force_mask: bool = False, seq: int = 32, batch: int = 2, head_dim: int = 8, window: int | None = None,
                softcap: float | None = None, sinks: bool = False) -> dict:
    """Relative errors (max |ring - plain| / max |plain|) of this rank's output and q/k/v gradients."""
    rank, size = dist.get_rank(), dist.get_world_size()
    dt = getattr(torch, dtype)
    gen = torch.Generator().manual_seed(0)
    q, grad = (torch.randn(batch, heads, seq, head_dim, generator=gen).to(dt) for _ in range(2))
    k, v = (torch.randn(batch, kv_heads, seq, head_dim, generator=gen).to(dt) for _ in range(2))
    documents, valid = batch_meta(batch=batch, seq=seq, packed=packed, padded=padded)
    scaling = head_dim ** -0.5

    sink = torch.randn(heads, generator=gen).to(dt) if sinks else None
    ref_sink = sink.double().requires_grad_() if sinks else None
    ref_inputs = [t.double().requires_grad_() for t in (q, k, v)]
    ref_out = plain_attention(*ref_inputs, documents=documents, valid=valid, scaling=scaling, window=window,
                              softcap=softcap, sinks=ref_sink)
    ref_out.backward(grad.double())

    cut = layout_named(layout, size)
    mine = cut.positions(rank, seq)
    local = [t[:, :, mine].clone().requires_grad_() for t in (q, k, v)]
    local_sink = sink.clone().requires_grad_() if sinks else None
    out = ring_attention(*local, documents=documents, valid=valid, layout=cut, group=dist.group.WORLD,
                         scaling=scaling, masked=True if force_mask else None, window=window, softcap=softcap,
                         sinks=local_sink)
    out.backward(grad[:, :, mine])
    sink_err = None
    if sinks:  # each rank's share (its queries); the sum over cp is the whole gradient
        whole = local_sink.grad.double()
        dist.all_reduce(whole)
        sink_err = ((whole - ref_sink.grad).abs().max() / ref_sink.grad.abs().max()).item()

    def error(got: torch.Tensor, want: torch.Tensor) -> float:
        assert got.dtype == dt and got.shape == want.shape, (got.dtype, got.shape, want.shape)
        return ((got.double() - want).abs().max() / want.abs().max()).item()

    # queries that see no key (left padding): zeros out, no gradient
    unseen = ref_out.detach()[:, :, mine].abs().amax(dim=(1, 3)) == 0
    rows = [t.detach().transpose(1, 2)[unseen] for t in (out, local[0].grad)]
    return {"out": error(out, ref_out.detach()[:, :, mine]),
            **{name: error(t.grad, ref.grad[:, :, mine]) for name, t, ref in zip("qkv", local, ref_inputs)},
            "unseen rows": int(unseen.sum()), "unseen exactly zero": all(bool((r == 0).all()) for r in rows),
            "sinks": sink_err}
