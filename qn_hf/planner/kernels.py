"""The kernels training runs, as the planner's meta trace runs them (one ``TorchFunctionMode``).

* Attention: ``scaled_dot_product_attention`` becomes the flash kernel, whose meta implementation
  gives the real shapes: it keeps q, k, v, the output and a float32 log-sum-exp per row, never the
  query x key matrix that meta tensors' unfused path would build.
* Grouped matmul: transformers' fused MoE experts (their ``grouped_mm`` implementation, the
  default) call ``torch._grouped_mm``, whose meta kernel takes bfloat16 only. On meta tensors of
  any dtype a stand-in allocates the product and keeps what the real op's autograd keeps: both
  operands (the weight is a view of a parameter, already there) and the offsets.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch.overrides import TorchFunctionMode


def _fused_attention(query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None, enable_gqa=False):
    if isinstance(attn_mask, torch.Tensor) and attn_mask.requires_grad:
        # a learned bias in the mask (T5's relative position bias): the memory-efficient kernel, which
        # trains it (the flash kernel takes no gradient for its mask); it keeps the bias for backward
        return torch.ops.aten._scaled_dot_product_efficient_attention(
            query, key, value, attn_mask.expand(query.shape[0], query.shape[1], query.shape[2], key.shape[2]),
            True, dropout_p, is_causal, scale=scale)[0]
    # The flash kernel takes fewer KV heads than query heads as they are (enable_gqa's meaning).
    return torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(
        query, key, value, dropout_p, is_causal, attn_mask=attn_mask, scale=scale)[0]


class _GroupedMM(torch.autograd.Function):
    """Forward: ``torch._grouped_mm``'s product and saved tensors, on meta; no backward (not run)."""

    @staticmethod
    def forward(ctx, a: torch.Tensor, b: torch.Tensor, offs: torch.Tensor | None) -> torch.Tensor:
        ctx.save_for_backward(a, b, offs)
        return a.new_empty((a.shape[0], b.shape[-1]))

    @staticmethod
    def backward(ctx, grad):  # pragma: no cover - the trace runs no backward
        raise NotImplementedError("the planner's grouped-matmul stand-in has no backward")


# Ops whose time the model counts from FLOPs (matrix products, attention), not from bytes written.
COMPUTE_OPS = frozenset({"mm", "addmm", "bmm", "baddbmm", "_grouped_mm", "_scaled_dot_product_flash_attention",
                          "_scaled_dot_product_efficient_attention", "_scaled_dot_product_flash_attention_for_cpu",
                          "_scaled_dot_product_cudnn_attention", "_efficient_attention_forward",
                          "_flash_attention_forward"})


class TrainingKernels(TorchFunctionMode):
    """Attention as the fused kernel; a 2-D by 3-D grouped matmul on meta as ``_GroupedMM``."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is F.scaled_dot_product_attention:
            return _fused_attention(*args, **kwargs)
        if func is torch._grouped_mm and args[0].is_meta and args[0].dim() == 2 and args[1].dim() == 3:
            return _GroupedMM.apply(args[0], args[1], kwargs.get("offs"))
        return func(*args, **kwargs)
