"""Whether boxes tile a shape exactly once, in time linear in the boxes (the index check of a tensor's pieces)."""

from __future__ import annotations

import itertools
import math

Box = list[list[int]]  # [[start, stop], ...] per dimension


def corner_sums(boxes: list[Box], split: list[int]) -> dict[tuple[int, ...], int]:
    """The boxes' signed corners, summed: a box's indicator is the alternating sum of the orthants
    above its 2**d corners, so boxes tile a shape exactly once if and only if their corners add up
    to the shape's own. Linear in the pieces (comparing every pair is quadratic: 10k pieces took
    minutes). Dimensions in which every box spans the whole shape (not in ``split``) contribute the
    same factor to every box and are left out."""
    total: dict[tuple[int, ...], int] = {}
    for box in boxes:
        if any(a == b for a, b in box):
            continue  # an empty box covers nothing
        for corner in itertools.product(*[((box[d][0], 1), (box[d][1], -1)) for d in split]):
            point = tuple(c for c, _ in corner)
            total[point] = total.get(point, 0) + math.prod(sign for _, sign in corner)
    return {p: v for p, v in total.items() if v}
