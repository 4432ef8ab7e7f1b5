"""Replacing ``torch.distributed`` functions for the duration of a block, for test instrumentation
(the NCCL call recorder, the first-use emulation).

A point-to-point function is replaced on ``torch.distributed`` and on ``distributed_c10d`` alike:
``P2POp`` checks that its function *is* ``distributed_c10d.isend`` or ``irecv``, and
``batch_isend_irecv`` calls the ops' own functions, so a replacement on one module only would be
refused there, or bypassed."""

from __future__ import annotations

from collections.abc import Callable

import torch.distributed as dist
from torch.distributed import distributed_c10d as c10d

P2P = ("isend", "irecv", "send", "recv")


class Patches:
    """Replacements to undo, in reverse order."""

    def __init__(self) -> None:
        self._saved: list[tuple[object, str, object]] = []

    def replace(self, owner: object, name: str, replacement: object) -> None:
        self._saved.append((owner, name, getattr(owner, name)))
        setattr(owner, name, replacement)

    def replace_dist(self, name: str, wrap: Callable[[Callable], Callable]) -> None:
        """``dist.name`` and ``distributed_c10d.name`` by ``wrap(the function now there)``."""
        wrapped = wrap(getattr(dist, name))
        self.replace(dist, name, wrapped)
        if getattr(c10d, name, None) is not None:
            self.replace(c10d, name, wrapped)

    def undo(self) -> None:
        for owner, name, fn in reversed(self._saved):
            setattr(owner, name, fn)
        self._saved.clear()
