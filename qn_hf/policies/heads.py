"""Attention heads at a tensor-parallel degree: how many each rank holds, and whether they split."""

from __future__ import annotations

from dataclasses import dataclass, replace

from .layer_fields import layer_count, layer_value


def divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


@dataclass(frozen=True)
class HeadLayout:
    """Attention heads at a tensor-parallel degree; validates that they split (or replicate) evenly."""

    heads: int
    kv_heads: int
    head_dim: int
    tp: int

    def __post_init__(self) -> None:
        if self.heads % self.tp:
            raise ValueError(
                f"tp={self.tp} does not divide num_attention_heads={self.heads}; "
                f"use a tp among {divisors(self.heads)}"
            )
        if self.heads % self.kv_heads:
            raise ValueError(f"num_key_value_heads={self.kv_heads} does not divide num_attention_heads={self.heads}")
        if self.tp <= self.kv_heads and self.kv_heads % self.tp:
            raise ValueError(
                f"tp={self.tp} does not divide num_key_value_heads={self.kv_heads}; use a tp that divides "
                f"{self.kv_heads} or a multiple of it (KV heads are then replicated)"
            )
        if self.tp > self.kv_heads and self.tp % self.kv_heads:
            raise ValueError(
                f"tp={self.tp} exceeds num_key_value_heads={self.kv_heads} but is not a multiple of it, so KV "
                f"heads cannot be replicated evenly; use a tp among {divisors(self.heads)} that divides or is a "
                f"multiple of {self.kv_heads}"
            )

    @property
    def kv_replicas(self) -> int:
        return max(1, self.tp // self.kv_heads)

    def value(self, name: str) -> int:
        local_heads = self.heads // self.tp
        local_kv = max(1, self.kv_heads // self.tp)
        return {
            "local_heads": local_heads,
            "local_kv_heads": local_kv,
            "local_kv_groups": local_heads // local_kv,
            "local_q_width": local_heads * self.head_dim,
        }[name]


# Values an attribute patch can take, computed from the head layout at the current tp.
LAYOUT_VALUES = ("local_heads", "local_kv_heads", "local_kv_groups", "local_q_width")


def head_layout(config, *, tp: int, num_kv_heads_key: str | None) -> HeadLayout:
    """The heads of the first layer at ``tp``, each layer's checked: a config may give a layer heads of
    its own (``per_layer_config``, layer_fields.py), and tp must split every layer's."""
    if getattr(config, "num_attention_heads", None) is None and hasattr(config, "get_text_config"):
        config = config.get_text_config()  # a multimodal config keeping its heads in its text config only (Fuyu's)
    layouts = [_layer_layout(config, i, tp=tp, num_kv_heads_key=num_kv_heads_key)
               for i in range(max(layer_count(config), 1))]
    return layouts[0]


def _layer_layout(config, layer: int, *, tp: int, num_kv_heads_key: str | None) -> HeadLayout:
    heads = layer_value(config, "num_attention_heads", layer)
    kv_heads = layer_value(config, num_kv_heads_key, layer) if num_kv_heads_key else None
    width = getattr(config, "hidden_size", None)
    head_dim = layer_value(config, "head_dim", layer) or (width // heads if isinstance(width, int) else None)
    if head_dim is None:
        # MobileViT's stages each have a width of their own (hidden_sizes): no one head width to split by
        raise ValueError(f"tp={tp} ({config.model_type}): its config gives no hidden_size or head_dim, which qn_hf "
                         f"reads the attention's head width from; use tp=1 (data and pipeline parallelism still apply)")
    return HeadLayout(heads=heads, kv_heads=kv_heads or heads, head_dim=head_dim, tp=tp)


def attention_layout(module: object, layout: HeadLayout) -> HeadLayout:
    """``layout`` with the KV heads and head width of this attention module, which may differ from the
    config's: MiMo-V2's sliding-window layers have twice as many KV heads (read from its
    ``num_key_value_groups``), Gemma 4's full-attention layers their own ``head_dim``."""
    head_dim = getattr(module, "head_dim", None)
    if isinstance(head_dim, int) and not isinstance(head_dim, bool) and head_dim > 0:
        layout = replace(layout, head_dim=head_dim)
    groups = getattr(module, "num_key_value_groups", None)
    if not isinstance(groups, int) or groups <= 0 or layout.heads % groups or layout.heads // groups == layout.kv_heads:
        return layout
    return replace(layout, kv_heads=layout.heads // groups)
