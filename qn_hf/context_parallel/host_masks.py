"""Attention masks decided on the host at cp=1, as ring attention's are under cp.

transformers builds a model's attention mask inside its forward (``masking_utils``), and on ``sdpa``
that costs a device read per forward call of every stage: without an attention mask it looks for
packed sequences in ``position_ids`` (``find_packed_sequence_indices``: ``.all()``), with one it asks
whether the mask hides anything (``_ignore_causal_mask_sdpa``: ``fast_all``). On a GPU each read
waits for everything queued before it: a stall per microbatch and stage. The answer is in the batch
the caller hands over, which qn_hf reads on the host before it moves (``prepare``), as cp's ring does.

The mechanism is cp's: through transformers' attention interface, no forward replaced.
``apply_host_masks`` registers, under a name of this model's own, a thin wrapper of transformers'
own ``sdpa`` attention, and registers transformers' own ``sdpa`` mask function under the same name
(so a 2-D mask or none builds the mask ``sdpa`` builds), then selects it with
``set_attn_implementation``. When a step's host batch has no padding and no packed sequences, every
microbatch is given instead a 4-D ``[rows, 1, 0, sequence]`` tensor (``no_mask_token``): transformers
takes a 4-D mask as already built and passes it untouched to the attention function (no read), where
the wrapper gives ``sdpa`` what transformers' mask code gives it for such a batch: no mask (its
``is_causal`` path), or on a layer whose sliding window does not cover the keys the causal mask within
that window, built from positions on the device. Any other mask (a padded or packed batch, ``generate``,
a user's own call) goes through transformers' code unchanged. A tensor with no query rows is never a
mask transformers builds, so the two cannot be confused.

It serves the models whose masks are ring attention's (``apply.masks_reason``: cp's own refusals of a
mask it does not compute, so one rule for both): a causal LM on ``sdpa`` whose attention runs through
the interface, causal, in full or sliding-window layers only; and batches of ids, labels, attention
mask and positions alone (another input, an image's, may change the mask). Anything else keeps
transformers' own path, as the plain model runs it.
"""

from __future__ import annotations

import itertools
from collections.abc import Mapping

import torch
from torch import nn
from transformers import AttentionInterface
from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, AttentionMaskInterface
from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

from ..tensor_parallel.plan import TpPlan
from ..config.options import LossKind
from .apply import CP_KEYS, AttentionSwitch, masks_reason, non_causal_attention, ring_documents

SDPA = "sdpa"
_names = itertools.count()


def host_masks_serve(model: nn.Module, plan: TpPlan) -> bool:
    """Whether this model's masks may be decided on the host (module docstring)."""
    config, text = model.config, model.config.get_text_config()
    if config._attn_implementation != SDPA or text._attn_implementation != SDPA:
        return False
    # a causal LM's forward hands the mask to its base model alone (a head may read it itself); a config
    # that makes the causal mask bidirectional (``is_causal=False``) is transformers' power feature
    if plan.loss is not LossKind.CAUSAL_LM or not getattr(text, "is_causal", True):
        return False
    if masks_reason(model) is not None:
        return False
    return not any(non_causal_attention(name, module) for name, module in model.named_modules())


def is_no_mask(mask: torch.Tensor | None) -> bool:
    """Whether ``mask`` is ``no_mask_token``'s: 4-D with no query rows."""
    return isinstance(mask, torch.Tensor) and mask.dim() == 4 and mask.shape[2] == 0


def no_mask_token(ids: torch.Tensor) -> torch.Tensor:
    """What a microbatch's model is given as its attention mask when it needs none (no copy, no read)."""
    return ids.new_empty((ids.shape[0], 1, 0, ids.shape[1]))


def window_mask(query: torch.Tensor, key: torch.Tensor, window: int) -> torch.Tensor:
    """The causal mask within ``window`` [rows, 1, queries, keys] (True: attended), as transformers'
    ``causal_mask_function`` and ``sliding_window_overlay`` make it, from positions on the device."""
    q, k = query.shape[2], key.shape[2]
    at_q = torch.arange(k - q, k, device=query.device)[:, None]  # queries are the last q keys
    at_k = torch.arange(k, device=query.device)[None, :]
    return ((at_k <= at_q) & (at_k > at_q - window)).expand(query.shape[0], 1, q, k)


def apply_host_masks(model: nn.Module) -> AttentionSwitch:
    """Register the wrapper of ``sdpa`` (module docstring) for this model and select it; return its switch
    (``generate`` turns it off)."""
    sdpa = ALL_ATTENTION_FUNCTIONS[SDPA]

    def attention(module: nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                  attention_mask: torch.Tensor | None, **kwargs):
        if is_no_mask(attention_mask):
            window = kwargs.get("sliding_window")
            # as _ignore_causal_mask_sdpa decides: no mask (is_causal) unless a window is given that the
            # keys reach (kv_length >= window: transformers then builds the windowed mask)
            attention_mask = None if window is None or key.shape[2] < window else window_mask(query, key, window)
        return sdpa(module, query, key, value, attention_mask, **kwargs)

    # transformers' registries are global; the name is this model's own (as ring attention's)
    name = f"qn_hf_sdpa_{next(_names)}"
    previous = model.config._attn_implementation
    AttentionInterface.register(name, attention)
    AttentionMaskInterface.register(name, ALL_MASK_ATTENTION_FUNCTIONS[SDPA])
    model.set_attn_implementation(name)
    return AttentionSwitch(model, name=name, previous=previous)


def step_masks_needed(batch: Mapping[str, torch.Tensor]) -> bool:
    """Whether the host ``batch`` (read where it is, before it moves) needs transformers' masks: it
    pads or packs sequences, or has an input besides ``CP_KEYS``."""
    return "input_ids" not in batch or not set(batch) <= set(CP_KEYS) or ring_documents(batch) is not None


def no_mask_tokens(micro: list[Mapping[str, torch.Tensor]]) -> list[torch.Tensor]:
    """Each microbatch's ``no_mask_token``."""
    return [no_mask_token(m["input_ids"]) for m in micro]
