"""Fused query|key|value projections and per-head inputs, per architecture (data only; read by
``structure.py``). Which rows of a fused projection hold which head only the model's forward
knows (its ``view``), so each architecture that fuses them is listed here with its layout; the
structure derivation refuses any other fused projection. Switches of the config that change the
layout (multi-query, Falcon's new architecture) choose among layouts, the first that is on.

bloom: ``query_key_value`` viewed as ``[heads, 3, head_dim]``; ALiBi built at the model level for
all heads and passed to each attention as ``alibi``, ``(batch x heads, 1, keys)``.
falcon: ``[heads, 3, head_dim]``; with ``new_decoder_architecture`` ``[kv_heads, heads/kv_heads + 2,
head_dim]``; with ``multi_query`` ``[heads x head_dim | head_dim | head_dim]``. With ``alibi`` the model
folds the slopes of all heads into the attention mask, which no input here slices: refused.
gpt_bigcode: ``c_attn`` ``[heads, 3 x head_dim]``; with ``multi_query`` ``[hidden | head_dim | head_dim]``.
mpt: ``Wqkv`` chunked into ``[Q | K | V]``; ALiBi as ``position_bias``, ``(heads, 1, keys)``.
persimmon: ``query_key_value`` viewed as ``[heads, 3 x head_dim]`` (and Fuyu's language model, a Persimmon).
gpt_neox_japanese: ``query_key_value`` viewed as ``[heads, 3 x head_dim]``.
modernbert: ``Wqkv`` viewed as ``[3, heads, head_dim]``.
openai-gpt: ``c_attn`` split into ``[Q | K | V]``.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field

from ..arguments import Choice


class FusedLayout(Choice):
    """How a fused projection's output rows hold the heads."""

    PER_HEAD = "per head"  # each head's q, k, v rows together: a column split keeps whole heads
    PER_KV_GROUP = "per kv group"  # each KV group's queries, key, value together: tp must divide the KV heads
    BLOCKS = "blocks"  # all queries, then all keys, then all values: each block split (colwise_packed3)
    SHARED_KV = "shared kv"  # every head's queries, then the one key and value all heads share (multi-query)


class HeadAxis(Choice):
    """Where an input an attention module receives holds the heads (sliced to this rank's)."""

    BATCH_TIMES_HEADS = "batch x heads"  # dim 0 is batch x heads, heads fastest (BLOOM's alibi)
    HEADS = "heads"  # dim 0 is the heads (MPT's position_bias)
    AFTER_BATCH = "batch, heads"  # dim 1 is the heads (MPNet's and CpmAnt's relative position bias, stacks.py)


@dataclass(frozen=True)
class Fused:
    """A block's fused projection (path in the block), its layout, and the config switches that change
    it ((switch, layout), the first one on wins)."""

    projection: str
    layout: FusedLayout
    switches: tuple[tuple[str, FusedLayout], ...] = ()

    def layout_for(self, config) -> FusedLayout:
        return next((layout for switch, layout in self.switches if getattr(config, switch, False)), self.layout)


@dataclass(frozen=True)
class FusedAttention:
    """What an architecture fuses, the inputs its attention takes per head, and the switches under which
    tp is refused (switch -> why)."""

    fused: Fused
    head_inputs: Mapping[str, Mapping[str, HeadAxis]] = field(default_factory=dict)  # module in a block -> inputs
    refused_when: Mapping[str, str] = field(default_factory=dict)


FUSED: dict[str, FusedAttention] = {
    "bloom": FusedAttention(Fused("self_attention.query_key_value", FusedLayout.PER_HEAD),
                            head_inputs={"self_attention": {"alibi": HeadAxis.BATCH_TIMES_HEADS}},
                            refused_when={"slow_but_exact": "its slow_but_exact path slices the output projection by "
                                                            "pretraining_tp itself"}),
    "falcon": FusedAttention(Fused("self_attention.query_key_value", FusedLayout.PER_HEAD,
                                   switches=(("new_decoder_architecture", FusedLayout.PER_KV_GROUP),
                                             ("multi_query", FusedLayout.SHARED_KV))),
                             refused_when={"alibi": "it folds the ALiBi slopes of all heads into the attention mask"}),
    "gpt_bigcode": FusedAttention(Fused("attn.c_attn", FusedLayout.PER_HEAD,
                                        switches=(("multi_query", FusedLayout.SHARED_KV),))),
    "gpt_neox_japanese": FusedAttention(Fused("attention.query_key_value", FusedLayout.PER_HEAD)),
    "modernbert": FusedAttention(Fused("attn.Wqkv", FusedLayout.BLOCKS)),
    "openai-gpt": FusedAttention(Fused("attn.c_attn", FusedLayout.BLOCKS)),
    "mpt": FusedAttention(Fused("attn.Wqkv", FusedLayout.BLOCKS),
                          head_inputs={"attn": {"position_bias": HeadAxis.HEADS}}),
    "persimmon": FusedAttention(Fused("self_attn.query_key_value", FusedLayout.PER_HEAD)),
}
