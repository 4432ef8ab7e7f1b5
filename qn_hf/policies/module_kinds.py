"""What kind of module a model holds, as the plans ask it: a projection a linear style can split, or
a module that acts on each position alone (which sequence parallelism can run on a slice)."""

from __future__ import annotations

from torch import nn
from transformers.pytorch_utils import Conv1D

from ..compat import decorated_experts
from .embedding_types import forward_body

_ACTIVATION_MODULES = ("torch.nn.modules.activation", "transformers.activations")


def is_projection(module: nn.Module) -> bool:
    return isinstance(module, (nn.Linear, Conv1D))


def in_out_features(module: nn.Module) -> tuple[int, int]:
    """A projection's input and output widths (a ``Conv1D`` keeps them as ``nx``/``nf``)."""
    return (module.nx, module.nf) if isinstance(module, Conv1D) else (module.in_features, module.out_features)


# The forward bodies (statements, whitespace-normalized) of nn.Linear subclasses that compute exactly what
# nn.Linear does, written another way (Falcon's FalconLinear): a parallel linear layer reproduces them.
_PLAIN_LINEAR_BODIES = (
    "hidden_states = input @ self.weight.T\nif self.bias is None:\nreturn hidden_states\nreturn hidden_states + self.bias",
)


def plain_linear(module: nn.Module) -> bool:
    """An exact ``nn.Linear`` or ``Conv1D``, or an ``nn.Linear`` subclass whose forward is ``x @ W.T + b``
    (``_PLAIN_LINEAR_BODIES``): what the parallel linear layers reproduce. Read from the source, so a
    transformers release that changes such a forward is refused, not silently mis-trained."""
    if type(module) in (nn.Linear, Conv1D):
        return True
    if not isinstance(module, nn.Linear):
        return False
    owner = next(c for c in type(module).__mro__ if "forward" in c.__dict__)
    return owner is nn.Linear or forward_body(owner.forward) in _PLAIN_LINEAR_BODIES


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
