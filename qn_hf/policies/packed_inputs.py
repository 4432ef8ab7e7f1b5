"""Inputs packed back to back instead of one per row, as data: Qwen2-VL's processor (and GLM-4V's, Qwen 3-VL's,
...) gives every image's patches in one ``pixel_values`` of ``sum(t * h * w)`` rows beside ``image_grid_thw``, one
``(t, h, w)`` row per image; a vision tower alone takes ``hidden_states`` (or ``pixel_values``) and ``grid_thw``
the same way. ``step/packed.py`` cuts such batches by rows; this module says which keys are packed and which
modules of a model are the towers that take the items."""

from __future__ import annotations

import functools
import inspect
from dataclasses import dataclass

from torch import nn


@dataclass(frozen=True)
class PackedInput:
    """A packed input: ``values``, its items' rows back to back, and ``grid``, one ``(t, h, w)`` row per item."""

    grid: str
    values: str
    token: str | None  # the config attribute of the token an item's place holds; None: one item per batch row
    token_type: int | None = None  # what mm_token_type_ids marks an item's tokens with
    per_item: tuple[str, ...] = ()  # keys of one value per item (Qwen2.5-VL's seconds per video grid step)


PACKED = (PackedInput("image_grid_thw", "pixel_values", "image_token_id", 1),
          PackedInput("video_grid_thw", "pixel_values_videos", "video_token_id", 2, ("second_per_grid_ts",)),
          PackedInput("grid_thw", "hidden_states", None),
          PackedInput("grid_thw", "pixel_values", None))


def tower_input(module: nn.Module) -> PackedInput | None:
    """The packed input ``module``'s forward takes as a tower does, one item a grid row beside its patches
    (PACKED's entries without a token); None where it takes none."""
    return _tower_input(type(module))


@functools.cache  # read once a class: a step's batch check asks of every module of the model (step/batch.py)
def _tower_input(kind: type) -> PackedInput | None:
    try:
        params = inspect.signature(kind.forward).parameters
    except (TypeError, ValueError):  # a builtin's forward has no signature to read
        return None
    return next((p for p in PACKED if p.token is None and p.grid in params and p.values in params), None)


def item_towers(model: nn.Module) -> list[nn.Module]:
    """The towers inside ``model`` (outermost, not ``model`` itself) that its forward runs on the items a batch
    packs, as many times as the rows hold kinds of items (Qwen2-VL's ``visual``, once for images and once for
    videos): a rank whose rows hold none never runs its tower, so its weights get no gradient there."""
    found: list[nn.Module] = []
    inside: set[int] = set()
    for name, module in model.named_modules():
        if not name or id(module) in inside:
            continue
        if tower_input(module) is not None and any(True for _ in module.parameters()):
            found.append(module)
            inside.update(id(m) for m in module.modules())
    return found
