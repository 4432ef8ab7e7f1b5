"""Inputs packed back to back instead of one per row. Qwen2-VL's processor (and GLM-4V's, Qwen 3-VL's, ...)
gives every image's patches in one ``pixel_values`` of ``sum(t * h * w)`` rows beside ``image_grid_thw``, one
``(t, h, w)`` row per image, the images in the order their tokens appear in ``input_ids``; a vision tower alone
takes ``hidden_states`` and ``grid_thw`` the same way, one image per row. Cutting such a batch by rows (data
parallel ranks, microbatches) must take each row's own images along: a row's images are those whose tokens it
holds, ``t * h * w / spatial_merge_size**2`` each (the vision tower merges that many patches into one token),
counted in the row's ``mm_token_type_ids`` where the batch has them (transformers' own M-RoPE reads images
there: 1 an image's token, 2 a video's), else its ``input_ids`` equal to the config's image or video token.
The counts must meet the grid's rows exactly at every row's end, or the batch is refused, never cut apart."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field

import torch

from ..policies.packed_inputs import PACKED, PackedInput


def packed_keys(batch: Mapping[str, object]) -> set[str]:
    """The keys of ``batch`` whose dim 0 is not its rows: the packed values, and grids (and values per item) of
    items placed by tokens."""
    found = set()
    for packed in PACKED:
        if packed.grid in batch and packed.values in batch:
            found |= {packed.values}
            if packed.token is not None:
                found |= {packed.grid, *(k for k in packed.per_item if k in batch)}
    return found


def placed_by_tokens(batch: Mapping[str, object]) -> list[str]:
    """The packed keys of ``batch`` whose items rows hold by their tokens, any number a row (a VLM's images)."""
    return sorted(k for p in PACKED if p.token is not None and p.grid in batch and p.values in batch
                  for k in (p.grid, p.values))


def batch_rows(batch: Mapping[str, torch.Tensor]) -> int:
    """The batch's rows: dim 0 of its first key that is not packed."""
    packed = packed_keys(batch)
    sizes = [v.shape[0] for k, v in batch.items() if k not in packed and v.dim()]
    if not sizes:
        raise ValueError(f"batch holds only packed inputs ({sorted(packed)}), no tensor of one row per example "
                         f"(input_ids) whose tokens place their items")
    return sizes[0]


@dataclass(frozen=True)
class RowLayout:
    """Where each row of a batch lies along dim 0 of every key: its own row, or (``bounds``) the span of a packed
    key holding its items (``rows + 1`` offsets, row ``r`` at ``bounds[key][r]:bounds[key][r + 1]``)."""

    rows: int
    bounds: dict[str, tuple[int, ...]] = field(default_factory=dict)
    grids: dict[str, tuple[str, ...]] = field(default_factory=dict)  # a packed key -> its grid and per-item keys

    def take(self, batch: Mapping[str, torch.Tensor], start: int, stop: int) -> dict[str, torch.Tensor]:
        """Rows ``start:stop`` of ``batch`` with their items; a packed input none of them holds is left out, with
        its grid, as a processor leaves it out of a batch without videos (the model would run its tower on none)."""
        empty = {k for k in self.grids if self.bounds[k][start] == self.bounds[k][stop]}
        empty |= {c for k in empty for c in self.grids[k]}
        return {k: v for k, v in self._span(batch, start, stop).items() if k not in empty}

    def _span(self, batch: Mapping[str, torch.Tensor], start: int, stop: int) -> dict[str, torch.Tensor]:
        return {k: v[self.bounds[k][start]:self.bounds[k][stop]] if k in self.bounds else v[start:stop]
                for k, v in batch.items()}

    def reordered(self, batch: Mapping[str, torch.Tensor], order: list[int]) -> dict[str, torch.Tensor]:
        """``batch`` with its rows in ``order``, each with its items (a row's items keep their order)."""
        rows = [self._span(batch, r, r + 1) for r in order]
        return {k: torch.cat([row[k] for row in rows]) for k in batch}

    def pad(self, batch: Mapping[str, torch.Tensor], pad: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """``batch`` with the rows ``pad`` (its row-keyed tensors) appended, each a copy of row 0 with its items."""
        extra = next(iter(pad.values())).shape[0]
        items = {k: v[self.bounds[k][0]:self.bounds[k][1]] for k, v in batch.items() if k in self.bounds}
        return {k: torch.cat([v, *([items[k]] * extra)] if k in items else [v, pad[k]]) for k, v in batch.items()}


def row_layout(batch: Mapping[str, torch.Tensor], config: object | None) -> RowLayout:
    """The layout of ``batch`` (module docstring); raises ValueError where a packed input's items cannot be told
    apart by rows. Reads the grids and token counts on the host: a batch given on the device syncs here once."""
    rows = batch_rows(batch)
    bounds: dict[str, tuple[int, ...]] = {}
    grids: dict[str, tuple[str, ...]] = {}
    for packed in PACKED:
        if packed.grid not in batch or packed.values not in batch:
            continue
        grid = batch[packed.grid]
        if grid.dim() != 2 or grid.shape[1] != 3 or grid.is_floating_point():
            raise ValueError(f"batch[{packed.grid!r}] must be integer rows of (t, h, w), got shape {tuple(grid.shape)} "
                             f"and dtype {grid.dtype}")
        patches = grid.prod(dim=-1).tolist()
        if sum(patches) != batch[packed.values].shape[0]:
            raise ValueError(f"batch[{packed.values!r}] holds {batch[packed.values].shape[0]} rows but the items of "
                             f"{packed.grid!r} have {sum(patches)} patches (t * h * w summed)")
        items = _items_per_row(batch, packed, rows=rows, patches=patches, config=config)
        item_bounds, patch_bounds = [0], [0]
        for count in items:
            item_bounds.append(item_bounds[-1] + count)
            patch_bounds.append(patch_bounds[-1] + sum(patches[item_bounds[-2]:item_bounds[-1]]))
        bounds[packed.values] = tuple(patch_bounds)
        grids[packed.values] = (packed.grid, *(k for k in packed.per_item if k in batch))
        if packed.token is not None:
            for key in grids[packed.values]:
                if batch[key].shape[0] != len(patches):
                    raise ValueError(f"batch[{key!r}] has {batch[key].shape[0]} rows, {packed.grid!r} {len(patches)}: "
                                     f"one value per item")
                bounds[key] = tuple(item_bounds)
    return RowLayout(rows=rows, bounds=bounds, grids=grids)


def _items_per_row(batch: Mapping[str, torch.Tensor], packed: PackedInput, *, rows: int, patches: list[int],
                   config: object | None) -> list[int]:
    """How many of ``packed``'s items each row holds, matched by their tokens (module docstring)."""
    if packed.token is None:
        if len(patches) != rows:
            raise ValueError(f"batch[{packed.grid!r}] has {len(patches)} rows, the batch {rows}: one item per row")
        return [1] * rows
    why = f"batch packs {packed.values!r} beside {packed.grid!r}, whose items qn_hf assigns to rows by their tokens"
    merge = getattr(getattr(config, "vision_config", None), "spatial_merge_size", None)
    if not isinstance(merge, int):
        raise ValueError(f"{why}, {merge!r} patches merged into one token here (config.vision_config."
                         f"spatial_merge_size is no integer); give each row its own batch (dp=1, microbatches=1)")
    if "mm_token_type_ids" in batch:
        marks = batch["mm_token_type_ids"] == packed.token_type
    else:
        token = getattr(config, packed.token, None)
        if not isinstance(token, int) or "input_ids" not in batch:
            raise ValueError(f"{why}, which the batch marks neither in mm_token_type_ids nor in input_ids by "
                             f"config.{packed.token}; pass the processor's mm_token_type_ids")
        marks = batch["input_ids"] == token
    held = marks.sum(dim=-1).tolist()
    tokens = [p // merge**2 for p in patches]
    counts, item = [], 0
    for row, want in enumerate(held):
        start = item
        while want > 0 and item < len(tokens):
            want -= tokens[item]
            item += 1
        if want != 0:
            raise ValueError(f"{why}: row {row} holds {held[row]} of their tokens, which no run of {packed.grid!r}'s "
                             f"items from item {start} fills exactly (an item of (t, h, w) takes t*h*w/{merge**2}); "
                             f"check the processor's outputs, or give each row its own batch (dp=1, microbatches=1)")
        counts.append(item - start)
    if item != len(tokens):
        raise ValueError(f"{why}: the rows hold the tokens of {item} of its {len(tokens)} items")
    return counts
