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
model's forward runs (``HostMasks.trusting``) the mask function is given no padding mask for a square,
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
import inspect
import itertools
import re
import sys
from collections.abc import Iterator, Mapping, Sequence

import torch
from torch import nn
from transformers import AttentionInterface
from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, AttentionMaskInterface
from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

from ..config.options import LossKind
from ..policies.tp_plan import TpPlan
from .apply import CP_KEYS, AttentionSwitch, masks_reason, non_causal_attention, ring_documents

SDPA = "sdpa"
_names = itertools.count()
# modeling code that branches on the implementation being sdpa by name (DSA models pass their sparse indices
# only to other implementations); under another name it would take the other branch
_ASKS_FOR_SDPA = re.compile(r"""_attn_implementation\s*(==|!=|in|not in)[^\n]*["']sdpa["']""")


def host_masks_serve(model: nn.Module, plan: TpPlan) -> bool:
    """Whether this model's masks may be decided on the host (module docstring)."""
    # every sub-model at any depth (a vision tower's too): the name replaces the implementation of all of them
    if any(config._attn_implementation != SDPA for config in _configs(model.config)):
        return False
    if plan.loss is not LossKind.CAUSAL_LM or masks_reason(model) is not None:
        return False
    if any(non_causal_attention(name, module) for name, module in model.named_modules()):
        return False
    return not any(_ASKS_FOR_SDPA.search(_source(name)) for name in {type(m).__module__ for m in model.modules()})


def _configs(config) -> Iterator:
    yield config
    for key in getattr(config, "sub_configs", None) or {}:
        sub = getattr(config, key, None)
        if sub is not None:
            yield from _configs(sub)


def _source(module_name: str) -> str:
    """The source of a transformers modeling module (others: empty, their code is not transformers')."""
    if not module_name.startswith("transformers.models."):
        return ""
    try:
        return inspect.getsource(sys.modules[module_name])
    except (KeyError, OSError, TypeError):  # no source to read: nothing known to ask
        return ""


class Trust:
    """Whether the model forward now running was given masks that hide nothing (``HostMasks.trusting``).
    Its own small object: transformers' global registry holds the mask function, which holds this, not the model."""

    def __init__(self) -> None:
        self.on = False


class HostMasks(AttentionSwitch):
    """The model's implementation (off while generating, as every ``AttentionSwitch``) and the trust its
    mask function reads."""

    def __init__(self, model: nn.Module, *, name: str, previous: str, trust: Trust) -> None:
        super().__init__(model, name=name, previous=previous)
        self.trust = trust

    @contextlib.contextmanager
    def trusting(self, on: bool = True) -> Iterator[None]:
        """Around one model forward given ``step_masks`` (``on``); the previous value back after it, so a
        call nested inside (a user's hook) decides for itself."""
        before, self.trust.on = self.trust.on, on
        try:
            yield
        finally:
            self.trust.on = before


def apply_host_masks(model: nn.Module) -> HostMasks:
    """Register transformers' ``sdpa`` and its mask function behind the test (module docstring) for this
    model and select them."""
    sdpa_mask, trust = ALL_MASK_ATTENTION_FUNCTIONS[SDPA], Trust()

    def mask(**kwargs):
        # transformers passes every argument by keyword; a cache makes the mask offset or wider than the
        # queries (PEFT's prefixes), where the padding mask of ones and none may be told apart: kept there
        square = kwargs.get("q_length") == kwargs.get("kv_length") and _zero(kwargs.get("q_offset", 0)) \
            and _zero(kwargs.get("kv_offset", 0))
        if trust.on and square:
            kwargs["attention_mask"] = None  # the step's batch pads nothing (host-decided): the same mask, unread
        return sdpa_mask(**kwargs)

    # transformers' registries are global; the name is this model's own (as ring attention's)
    name = f"qn_hf_sdpa_{next(_names)}"
    previous = model.config._attn_implementation
    AttentionInterface.register(name, ALL_ATTENTION_FUNCTIONS[SDPA])
    AttentionMaskInterface.register(name, mask)
    model.set_attn_implementation(name)
    return HostMasks(model, name=name, previous=previous, trust=trust)


def _zero(offset: object) -> bool:
    """An offset of 0 given as a number (a static cache gives a tensor: not read here)."""
    return isinstance(offset, int) and offset == 0


def masks_needed(batch: Mapping[str, torch.Tensor], *, dropped: Sequence[str] = ()) -> bool:
    """Whether transformers must read the masks of the caller's ``batch`` (read where it is: call it before
    the batch moves): what the model is given of it (all but ``dropped``: keys only a loss reads) pads or
    packs sequences, has a prepared mask or 3-D positions, or an input besides ``CP_KEYS``."""
    given = {key: value for key, value in batch.items() if key not in dropped}
    mask, positions = given.get("attention_mask"), given.get("position_ids")
    return ("input_ids" not in given or not set(given) <= set(CP_KEYS) or (mask is not None and mask.dim() != 2)
            or (positions is not None and positions.dim() > 2) or ring_documents(given) is not None)


def step_masks(micro: list[Mapping[str, torch.Tensor]], *, dropped: Sequence[str] = ()) -> list[torch.Tensor]:
    """The attention mask each microbatch's model is given when its batch needs none read: its own 2-D
    mask where the model is given it, else ones made on the device (transformers then looks for no packed
    sequences, which ``masks_needed`` looked for on the host)."""
    return [m["attention_mask"] if "attention_mask" in m and "attention_mask" not in dropped
            else torch.ones_like(m["input_ids"]) for m in micro]
