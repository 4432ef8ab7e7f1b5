"""A pipeline stage's own view of the per-layer lists in the config."""

from __future__ import annotations

import copy

from torch import nn


def slice_layer_lists(holder: nn.Module, *, start: int, stop: int, total: int) -> None:
    """The module that loops over the blocks reads per-layer config lists by the loop's index
    (``self.config.layer_types[i]`` picks each layer's mask in Gemma 3, Cohere 2, OLMo 3, ...): it
    gets its own config copy with those lists cut to this stage's layers. The blocks keep the
    shared config (they read it by their own, global ``layer_idx``), and so do exports."""
    config = getattr(holder, "config", None)
    if config is None:
        return
    per_layer = {k: v for k, v in vars(config).items() if isinstance(v, (list, tuple)) and len(v) == total}
    if per_layer:
        own = copy.copy(config)
        for key, value in per_layer.items():
            setattr(own, key, value[start:stop])
        holder.config = own
