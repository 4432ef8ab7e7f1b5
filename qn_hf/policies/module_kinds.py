"""What kind of module a model holds, as the plans ask it: a projection a linear style can split, or
a module that acts on each position alone (which sequence parallelism can run on a slice)."""

from __future__ import annotations

from torch import nn
from transformers.pytorch_utils import Conv1D

from ..compat import decorated_experts

_ACTIVATION_MODULES = ("torch.nn.modules.activation", "transformers.activations")


def is_projection(module: nn.Module) -> bool:
    return isinstance(module, (nn.Linear, Conv1D))


def position_wise(module: nn.Module) -> bool:
    """A module that acts on each position alone: dropout, identity, a norm over the features, or a
    parameter-free activation function (torch's or transformers')."""
    if isinstance(module, (nn.Dropout, nn.Identity, nn.LayerNorm, nn.RMSNorm)):
        return True
    if not list(module.parameters()) and (type(module).__module__ in _ACTIVATION_MODULES):
        return True
    name = type(module).__name__
    return name.endswith(("RMSNorm", "LayerNorm")) and all(p.dim() == 1 for p in module.parameters())


def is_fused_experts(module: nn.Module) -> bool:
    """transformers' fused experts form: decorated by ``use_experts_implementation`` (told by
    ``compat.decorated_experts``) and every parameter stacked over ``num_experts`` along dim 0."""
    count = getattr(module, "num_experts", None)
    params = list(module.parameters(recurse=False))
    return (decorated_experts(module) and isinstance(count, int) and bool(params)
            and all(p.dim() >= 2 and p.shape[0] == count for p in params))
