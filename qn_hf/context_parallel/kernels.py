"""The fused attention kernels one ring step calls (``ring_attention.py``): forward returns the
block's output and the float32 log-sum-exp of each query row; backward takes the global output and
log-sum-exp (flash attention's backward), so blocks merge exactly. On CPU
``_scaled_dot_product_flash_attention_for_cpu``; on CUDA flash attention for 16-bit blocks without a
mask, memory-efficient attention (with an additive bias) otherwise; with Gemma 2's logit softcapping
the block's float32 scores (``kernels``).
"""

from __future__ import annotations

import functools
from collections.abc import Callable

import torch

_aten = torch.ops.aten
NEG_INF = float("-inf")  # a masked score; a row's log-sum-exp before it sees any key

# The fused kernels: forward(q, k, v, causal, mask, scale) -> (out, lse [b, h, rows] float32) and
# backward(grad_out, q, k, v, out, lse, causal, mask, scale) -> (dq, dk, dv), k/v with their own heads.
Forward = Callable[..., tuple[torch.Tensor, torch.Tensor]]
Backward = Callable[..., tuple[torch.Tensor, torch.Tensor, torch.Tensor]]


def _cpu_forward(q, k, v, causal, mask, scale):
    return _aten._scaled_dot_product_flash_attention_for_cpu(q, k, v, 0.0, causal, attn_mask=mask, scale=scale)


def _cpu_backward(grad_out, q, k, v, out, lse, causal, mask, scale):
    return _aten._scaled_dot_product_flash_attention_for_cpu_backward(grad_out, q, k, v, out, lse, 0.0, causal,
                                                                      attn_mask=mask, scale=scale)


def _flash_forward(q, k, v, causal, mask, scale):
    out, lse, *_ = _aten._scaled_dot_product_flash_attention(q, k, v, 0.0, causal, False, scale=scale)
    return out, lse


def _flash_backward(grad_out, q, k, v, out, lse, causal, mask, scale):
    # the random state is read only with dropout, which ring attention never applies
    seed = torch.empty(2, dtype=torch.uint64, device=q.device)
    offset = torch.empty((), dtype=torch.uint64, device=q.device)
    return _aten._scaled_dot_product_flash_attention_backward(grad_out, q, k, v, out, lse, None, None, q.shape[2],
                                                              k.shape[2], 0.0, causal, seed, offset, scale=scale)


def _bias(mask: torch.Tensor | None, heads: int) -> torch.Tensor | None:
    """The mask as the efficient kernel takes it: every head (a stride-0 view) and rows aligned to
    16 elements, as torch's own SDPA prepares it."""
    if mask is None:
        return None
    b, _, rows, cols = mask.shape
    if cols % 16:
        mask = torch.nn.functional.pad(mask, (0, 16 - cols % 16))[..., :cols]
    return mask.expand(b, heads, rows, cols)


def _heads(t: torch.Tensor, heads: int) -> torch.Tensor:
    return t.repeat_interleave(heads // t.shape[1], dim=1) if t.shape[1] != heads else t


def _efficient_forward(q, k, v, causal, mask, scale):
    heads = q.shape[1]
    out, lse, *_ = _aten._scaled_dot_product_efficient_attention(q, _heads(k, heads), _heads(v, heads),
                                                                 _bias(mask, heads), True, 0.0, causal, scale=scale)
    return out, lse[:, :, :q.shape[2]]  # the kernel pads its rows to a multiple of 32


def _efficient_backward(grad_out, q, k, v, out, lse, causal, mask, scale):
    heads, kv_heads, rows = q.shape[1], k.shape[1], q.shape[2]
    padded = lse.new_zeros(*lse.shape[:2], -(-rows // 32) * 32)  # the layout the forward gave
    padded[:, :, :rows] = lse
    seed = torch.empty((), dtype=torch.long, device=q.device)  # read only with dropout
    dq, dk, dv, _ = _aten._scaled_dot_product_efficient_attention_backward(
        grad_out, q, _heads(k, heads), _heads(v, heads), _bias(mask, heads), out, padded, seed, seed, 0.0,
        [True, True, True, False], causal, scale=scale)
    if kv_heads != heads:  # each KV head's gradient is the sum over the query heads it served
        dk, dv = (g.unflatten(1, (kv_heads, heads // kv_heads)).sum(dim=2) for g in (dk, dv))
    return dq, dk, dv


def _capped_scores(q, k, causal, mask, scale, cap):
    """(softcapped scores with the masks applied [b, h, rows, cols], tanh of the raw scores over
    ``cap``), in float32; k/v expanded to the query heads."""
    raw = torch.matmul(q.float(), _heads(k, q.shape[1]).float().transpose(-1, -2)) * scale
    tanh = torch.tanh(raw / cap)
    scores = tanh * cap
    if causal:  # the same positions on both sides: the upper triangle is the future
        rows, cols = scores.shape[-2:]
        scores = scores.masked_fill(torch.ones(rows, cols, dtype=torch.bool, device=q.device).triu(1), NEG_INF)
    if mask is not None:
        scores = scores + mask.float()
    return scores, tanh


def _softcap_forward(q, k, v, causal, mask, scale, *, cap):
    scores, _ = _capped_scores(q, k, causal, mask, scale, cap)
    lse = torch.logsumexp(scores, dim=-1)
    probs = (scores - lse.masked_fill(lse == NEG_INF, 0.0).unsqueeze(-1)).exp()  # rows with no key: all 0
    return torch.matmul(probs, _heads(v, q.shape[1]).float()).to(q.dtype), lse


def _softcap_backward(grad_out, q, k, v, out, lse, causal, mask, scale, *, cap):
    """Flash attention's backward with the global ``lse`` and output, through ``cap * tanh(s / cap)``."""
    heads, kv_heads = q.shape[1], k.shape[1]
    scores, tanh = _capped_scores(q, k, causal, mask, scale, cap)
    probs = (scores - lse.unsqueeze(-1)).exp()
    grad_out = grad_out.float()
    grad_v = torch.matmul(probs.transpose(-1, -2), grad_out)
    grad_p = torch.matmul(grad_out, _heads(v, heads).float().transpose(-1, -2))
    delta = (grad_out * out.float()).sum(dim=-1, keepdim=True)
    grad_s = probs * (grad_p - delta) * (1 - tanh * tanh) * scale  # d(cap * tanh(x / cap)) / dx = 1 - tanh^2
    grad_q = torch.matmul(grad_s, _heads(k, heads).float())
    grad_k = torch.matmul(grad_s.transpose(-1, -2), q.float())
    if kv_heads != heads:  # each KV head's gradient is the sum over the query heads it served
        grad_k, grad_v = (g.unflatten(1, (kv_heads, heads // kv_heads)).sum(dim=2) for g in (grad_k, grad_v))
    return grad_q.to(q.dtype), grad_k.to(k.dtype), grad_v.to(v.dtype)


def kernels(query: torch.Tensor, *, masked: bool, softcap: float | None = None) -> tuple[Forward, Backward]:
    """The fused attention (forward, backward) for a block of ``query``'s device and dtype. With
    ``softcap`` (Gemma 2's ``cap * tanh(scores / cap)`` before the softmax) no fused kernel of torch
    computes it, on CPU or CUDA (flex attention's score_mod does, but returns no backward from a
    given global log-sum-exp, which the ring's merge needs): the block is computed from its float32
    scores, [b, heads, rows, columns] for the block's one call."""
    if softcap is not None:
        return (functools.partial(_softcap_forward, cap=softcap), functools.partial(_softcap_backward, cap=softcap))
    if query.device.type == "cpu":
        return _cpu_forward, _cpu_backward
    if query.device.type == "cuda":
        if not masked and query.dtype in (torch.float16, torch.bfloat16):
            return _flash_forward, _flash_backward
        return _efficient_forward, _efficient_backward
    raise ValueError(f"ring attention has no fused attention kernel for {query.device.type} tensors")
