"""Names of modules and parameters: wildcard patterns (``layers.*.mlp``; ``*`` is one name
component) and where the base model sits in a task model."""

from __future__ import annotations

import re
from collections.abc import Callable

from torch import nn
from transformers import PreTrainedModel


def pattern_regex(pattern: str) -> re.Pattern[str]:
    parts = [r"[^.]+" if p == "*" else re.escape(p) for p in pattern.split(".")]
    return re.compile(r"\.".join(parts) + r"\Z")


def match_modules(root: nn.Module, pattern: str) -> list[str]:
    """Names of the modules under ``root`` that ``pattern`` matches (``*`` = one name component)."""
    regex = pattern_regex(pattern)
    return [name for name, _ in root.named_modules() if name and regex.match(name)]


def match_parameters(root: nn.Module, pattern: str, *, rename: Callable[[str], str] | None = None) -> list[str]:
    """Names of the parameters under ``root`` that ``pattern`` matches (on ``rename(name)``, the
    name as the pattern knows it, when given)."""
    regex = pattern_regex(pattern)
    return [name for name, _ in root.named_parameters() if regex.match(rename(name) if rename else name)]


def base_model_and_prefix(model: nn.Module) -> tuple[nn.Module, str]:
    """HF's base model and its attribute path in ``model`` ('' when ``model`` is the base model)."""
    base = getattr(model, "base_model", model)
    if base is model:
        # A task model whose ``base_model_prefix`` names no attribute (Llama4ForCausalLM says
        # ``language_model`` but holds ``model``): its one pretrained child is the base model.
        inner = [(n, m) for n, m in model.named_children() if isinstance(m, PreTrainedModel)]
        return (inner[0][1], inner[0][0]) if len(inner) == 1 else (model, "")
    for name, module in model.named_modules():
        if module is base:
            return base, name
    raise ValueError(f"{type(model).__name__}.base_model is not one of its submodules")


def join(prefix: str, *names: str) -> str:
    """Module path parts joined by dots, empty parts left out (``join("", "a", "b") == "a.b"``)."""
    return ".".join(part for part in (prefix, *names) if part)


def submodule_or_none(root: nn.Module, name: str) -> nn.Module | None:
    """``root.get_submodule(name)``, or None where ``root`` holds no module there."""
    try:
        return root.get_submodule(name)
    except AttributeError:
        return None
