"""Attention masks decided on the host at cp=1, as ring attention's are under cp.

transformers builds a model's attention masks inside its forward (``masking_utils``), and on ``sdpa``
that costs a device read per forward call of every stage: without an attention mask it looks for
packed sequences in ``position_ids`` (``find_packed_sequence_indices``: ``.all()``), with one it asks
whether the mask hides anything (``_ignore_causal_mask_sdpa``: ``fast_all``). On a GPU each read
waits for everything queued before it: a stall per microbatch and stage. The answer is in the batch
the caller hands over, which qn_hf reads on the host before it moves (``prepare``), as cp's ring does.

Nothing of transformers' is replaced; one of its inputs is left out where it is known to change
nothing. ``apply_host_masks`` registers, under a name of this model's own, transformers' own ``sdpa``
attention function and, as its mask function, transformers' own ``sdpa_mask`` behind one test, and
selects the name with ``set_attn_implementation``. When a step's host batch has no padding and no packed
sequences (``masks_needed``), every microbatch's model gets a 2-D attention mask of ones (its own, or one
made on the device where the batch has none: transformers then looks for no packing), and while the
step runs (``HostMasks.trusting``) the mask function is given no padding mask for a square,
offset-free mask (no cache), which for a padding mask of ones is the same mask, built without reading
it. Everything else transformers builds as it does for ``sdpa``: windows, chunks, bidirectional
blocks, every ``or``/``and`` mask function. Outside a step (``generate``, a user's own call) and for a
batch that pads, packs or brings other inputs (an image's may carry masks of its own), nothing is left
out.

It serves a causal LM (its forward hands the mask to its base model and to what reads it as a 2-D
mask of ones or none, the same thing) whose every sub-model runs ``sdpa``, among the models ring
attention computes (``apply.masks_reason``: the same rule for both).
"""

from __future__ import annotations

import contextlib
import itertools
from collections.abc import Iterator, Mapping

import torch
from torch import nn
from transformers import AttentionInterface
from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, AttentionMaskInterface
from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

from ..config.options import LossKind
from ..tensor_parallel.plan import TpPlan
from .apply import CP_KEYS, AttentionSwitch, masks_reason, non_causal_attention, ring_documents

SDPA = "sdpa"
_names = itertools.count()


def host_masks_serve(model: nn.Module, plan: TpPlan) -> bool:
    """Whether this model's masks may be decided on the host (module docstring)."""
    config = model.config
    # every sub-model (a vision tower's config too): the name replaces the implementation of all of them
    configs = [config, *(getattr(config, key, None) for key in getattr(config, "sub_configs", {}) or {})]
    if any(c is not None and c._attn_implementation != SDPA for c in configs):
        return False
    if plan.loss is not LossKind.CAUSAL_LM or masks_reason(model) is not None:
        return False
    return not any(non_causal_attention(name, module) for name, module in model.named_modules())


class HostMasks(AttentionSwitch):
    """The model's implementation (off while generating, as every ``AttentionSwitch``) and whether the
    step now running pads nothing (``trusting``)."""

    def __init__(self, model: nn.Module, *, name: str, previous: str) -> None:
        super().__init__(model, name=name, previous=previous)
        self.trusted = False

    @contextlib.contextmanager
    def trusting(self) -> Iterator[None]:
        self.trusted = True
        try:
            yield
        finally:
            self.trusted = False


def apply_host_masks(model: nn.Module) -> HostMasks:
    """Register transformers' ``sdpa`` and its mask function behind the test (module docstring) for this
    model and select them."""
    sdpa_mask = ALL_MASK_ATTENTION_FUNCTIONS[SDPA]

    def mask(**kwargs):
        # transformers passes every argument by keyword; a cache makes the mask offset or wider than the
        # queries (PEFT's prefixes), where the padding mask of ones and none may be told apart: kept there
        square = kwargs.get("q_length") == kwargs.get("kv_length") and _zero(kwargs.get("q_offset", 0)) \
            and _zero(kwargs.get("kv_offset", 0))
        if switch.trusted and square:
            kwargs["attention_mask"] = None  # the step's batch pads nothing (host-decided): the same mask, unread
        return sdpa_mask(**kwargs)

    # transformers' registries are global; the name is this model's own (as ring attention's)
    name = f"qn_hf_sdpa_{next(_names)}"
    switch = HostMasks(model, name=name, previous=model.config._attn_implementation)
    AttentionInterface.register(name, ALL_ATTENTION_FUNCTIONS[SDPA])
    AttentionMaskInterface.register(name, mask)
    model.set_attn_implementation(name)
    return switch


def _zero(offset: object) -> bool:
    """An offset of 0 given as a number (a static cache gives a tensor: not read here)."""
    return isinstance(offset, int) and offset == 0


def masks_needed(batch: Mapping[str, torch.Tensor]) -> bool:
    """Whether transformers must read the masks of the caller's ``batch`` (read where it is: call it before
    the batch moves): it pads or packs sequences, gives a prepared mask, or has an input besides
    ``CP_KEYS``."""
    mask = batch.get("attention_mask")
    return ("input_ids" not in batch or not set(batch) <= set(CP_KEYS) or (mask is not None and mask.dim() != 2)
            or ring_documents(batch) is not None)


def step_masks(micro: list[Mapping[str, torch.Tensor]]) -> list[torch.Tensor]:
    """The attention mask each microbatch's model is given when its batch needs none read: its own 2-D
    mask, or ones made on the device (transformers then looks for no packed sequences)."""
    return [m["attention_mask"] if "attention_mask" in m else torch.ones_like(m["input_ids"]) for m in micro]
