"""A random packed batch for a vision tower that takes its images back to back (Qwen2.5-VL's, GLM-4V's towers:
``hidden_states`` or ``pixel_values`` of ``sum(t * h * w)`` patch rows beside ``grid_thw``, one row per image;
``step/packed.py`` cuts it by images). A patch row is as wide as the tower's patch embedding reads: a Conv3d's
or Conv2d's input channels times its kernel, or a Linear's input features."""

from __future__ import annotations

import torch
from torch import nn

from ..policies.packed_inputs import tower_input

# each row's image, (t, h, w) in patches, in units of the merge size: different sizes, so rows differ in patches
_GRIDS = ((1, 2, 2), (1, 1, 2), (1, 2, 1))


def packed_tower_batch(model: nn.Module, *, rows: int, generator: torch.Generator) -> dict[str, torch.Tensor] | None:
    """The packed batch of ``rows`` images for ``model``, or None where its forward takes no grid of one image a
    row beside its patches (PACKED's entries without a token), or no patch width can be read."""
    packed = tower_input(model)
    if packed is None:
        return None
    width = _patch_width(model)
    if width is None:
        return None
    merge = _merge(model.config)
    grid = torch.tensor([[t, h * merge, w * merge] for t, h, w in (_GRIDS[r % len(_GRIDS)] for r in range(rows))])
    patches = int(grid.prod(dim=-1).sum())
    return {packed.values: torch.randn(patches, width, generator=generator), packed.grid: grid}


def _merge(config) -> int:
    """How many patches a side the tower merges into one token (1 where the config names none)."""
    for name in ("spatial_merge_size", "merge_kernel_size"):
        value = getattr(config, name, None)
        if isinstance(value, int):
            return value
        if isinstance(value, (list, tuple)) and value and all(isinstance(v, int) for v in value):
            return max(value)
    return 1


def _patch_width(model: nn.Module) -> int | None:
    """The width of one patch row: what the model's first convolution or linear layer reads of it."""
    for module in model.modules():
        if isinstance(module, (nn.Conv3d, nn.Conv2d)):
            size = module.in_channels
            for k in module.kernel_size:
                size *= k
            return size
        if isinstance(module, nn.Linear):
            return module.in_features
    return None
