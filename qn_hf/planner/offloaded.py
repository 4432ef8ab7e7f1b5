"""What ``offload="activations"`` would move to the host, seen on the planner's meta trace (trace.py).

Each block's torch checkpoint runs inside saved-tensor hooks that note, without changing anything, every tensor
the checkpoint saves that the offload's own predicate takes (``memory/offload.moves``), with the block saving it:
one trace prices recomputation with and without offload. Two figures per block, as the offload moves them: the
host holds each saved tensor (its own bytes: a sequence slice of a larger storage is copied alone), and the device
lets go of each storage once (its whole bytes, under its first saver; a storage two blocks save is copied twice).
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Callable

import torch
from torch.multiprocessing.reductions import StorageWeakRef
from torch.utils.checkpoint import checkpoint

from ..memory.offload import moves
from .allocations import Allocations


class OffloadNotes:
    """The saves the offload would move during one traced forward."""

    def __init__(self) -> None:
        self._saves: list[tuple[int, str, int]] = []  # (storage, block saving it, the tensor's bytes)

    def checkpointed(self, function: Callable, *args, block: str, options: dict):
        """torch's checkpoint of ``function`` (``options``: its keywords), ``block``'s saves noted."""
        def note(t: torch.Tensor) -> torch.Tensor:
            if moves(t):
                self._saves.append((StorageWeakRef(t.untyped_storage()).cdata, block, t.numel() * t.element_size()))
            return t

        with torch.autograd.graph.saved_tensors_hooks(note, lambda t: t):  # outside the checkpoint's own
            return checkpoint(function, *args, preserve_rng_state=False, **options)

    def by_block(self, allocations: Allocations) -> dict[tuple[str, bool | None], tuple[int, int]]:
        """(block, the stand-in's split flag its storage was made under) -> (bytes the host holds, bytes the device
        lets go), of the saves whose storage the forward made and still holds."""
        alive = {cdata: (nbytes, owner[1]) for cdata, nbytes, owner in allocations.held()}
        out: dict[tuple[str, bool | None], list[int]] = defaultdict(lambda: [0, 0])
        released: set[int] = set()
        for cdata, block, nbytes in self._saves:
            if cdata in alive:
                whole, region = alive[cdata]
                out[(block, region)][0] += nbytes
                out[(block, region)][1] += 0 if cdata in released else whole
                released.add(cdata)
        return {k: (v[0], v[1]) for k, v in out.items()}


def per_rank(offloaded: dict[tuple[str, bool | None], tuple[int, int]], split: Callable[[str, bool | None], bool], *,
              tp: int) -> dict[str, tuple[float, float]]:
    """``Recording.offloaded`` by block, one tp rank's (``split``: whether a block's bytes are split over tp)."""
    out: dict[str, list[float]] = defaultdict(lambda: [0.0, 0.0])
    for (block, region), (host, device) in offloaded.items():
        share = tp if split(block, region) else 1
        out[block][0] += host / share
        out[block][1] += device / share
    return {k: (v[0], v[1]) for k, v in out.items()}
