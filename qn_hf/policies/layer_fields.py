"""Config fields read layer by layer: the one home for every config field qn_hf reads that a layer
may hold a value of its own.

Newer configs (Gemma 4, hybrid models) keep some fields per layer: ``config.per_layer_config[i]``
(transformers 5.23's heterogeneous configs), where Gemma 4's full-attention layers have their own
``head_dim`` and KV heads. Reading such a field off the config itself raises transformers'
``AmbiguousGlobalPerLayerAttributeError``, so a reader that assumes one value for the model would
fail, or read a value some layers do not have. Releases without per-layer configs (5.17 to 5.22)
have no ``is_heterogeneous``: every field is the model's, read as before.
"""

from __future__ import annotations

_MISSING = object()


def layer_count(config) -> int:
    return int(getattr(config, "num_hidden_layers", 0) or 0)


def is_per_layer(config, name: str) -> bool:
    """Whether ``name`` is one of the fields some layer of ``config`` overrides."""
    return bool(getattr(config, "is_heterogeneous", False)) and name in config.per_layer_attributes


def layer_value(config, name: str, layer: int, default=None):
    """``name`` as layer ``layer`` sees it: its own value where the config holds one per layer."""
    if is_per_layer(config, name):
        return getattr(config.per_layer_config[layer], name, default)
    return getattr(config, name, default)


def layer_values(config, name: str, default=None) -> tuple:
    """``name`` for every layer, in order (one entry for a config without layers)."""
    if not is_per_layer(config, name):
        value = getattr(config, name, default)
        return (value,) * max(layer_count(config), 1)
    return tuple(layer_value(config, name, i, default) for i in range(layer_count(config)))


def any_layer(config, name: str, default=None) -> bool:
    """Whether any layer has a truthy ``name`` (a switch some layers turn on)."""
    return any(layer_values(config, name, default))
