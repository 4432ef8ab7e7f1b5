"""How a model looks once peft has wrapped it: which modules are LoRA layers, and the names its
modules had before peft inserted a ``base_layer`` below each wrapper (the names policies speak)."""

from __future__ import annotations

import functools
import sys
from collections.abc import Callable

from torch import nn


def lora_layer_type() -> type | None:
    # peft is imported only by a user who built a PEFT model; without it in sys.modules no module
    # of the model can be a LoRA layer, and qn_hf does not import it.
    peft = sys.modules.get("peft")
    if peft is None:
        return None
    from peft.tuners.lora import LoraLayer

    return LoraLayer


def is_lora_layer(module: nn.Module) -> bool:
    kind = lora_layer_type()
    return kind is not None and isinstance(module, kind)


def is_param_wrapper(module: nn.Module) -> bool:
    """peft's LoRA on one bare parameter (``target_parameters``): its ``parameter_name`` names it."""
    return is_lora_layer(module) and hasattr(module, "parameter_name")


def lora_layer_names(model: nn.Module) -> frozenset[str]:
    return frozenset(name for name, module in model.named_modules() if is_lora_layer(module))


def without_wrappers(name: str, wrappers: frozenset[str]) -> str:
    """``name`` as the model had it before peft: without the ``base_layer`` each LoRA layer in
    ``wrappers`` (``lora_layer_names``) inserted below itself."""
    path, kept = "", []
    for part in name.split("."):
        if not (part == "base_layer" and path in wrappers):
            kept.append(part)
        path = f"{path}.{part}" if path else part
    return ".".join(kept)


def names_before_peft(model: nn.Module) -> Callable[[str], str] | None:
    """What turns a name under ``model`` into the name it had before peft wrapped its modules
    (``without_wrappers``); None when nothing is wrapped."""
    wrappers = lora_layer_names(model)
    return functools.partial(without_wrappers, wrappers=wrappers) if wrappers else None
