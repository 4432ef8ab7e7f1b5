"""A pipeline chunk's own view of the per-layer lists in the config."""

from __future__ import annotations

import copy


def cut_layer_lists(config: object | None, *, start: int, stop: int, total: int,
                    count: str | None = None) -> object | None:
    """The config the module that loops over the blocks should read for blocks ``[start, stop)``.

    That module reads per-layer config lists by the loop's index (``self.config.layer_types[i]``
    picks each layer's mask in Gemma 3, Cohere 2, OLMo 3, ...): it gets its own config copy with
    those lists cut to this chunk's layers. The blocks keep the shared config (they read it by
    their own, global ``layer_idx``), and so do exports. Returns ``config`` itself when it holds no
    per-layer list. ``count``: the config key the loop counts its iterations by, where it calls one shared
    module (ALBERT's ``num_hidden_layers``; ModelPolicy.pp_loop_count): the copy counts the chunk's."""
    if config is None:
        return None
    per_layer = {k: v for k, v in vars(config).items() if isinstance(v, (list, tuple)) and len(v) == total}
    if not per_layer and count is None:
        return config
    own = copy.copy(config)
    if count is not None:
        setattr(own, count, stop - start)
    for key, value in per_layer.items():
        setattr(own, key, value[start:stop])
    return own
