"""Which examples each step and each dp rank uses: a pure function of (seed, step, mesh).

Every step draws one *global* batch from a per-epoch permutation of the training split (seeded
with ``seed`` and the epoch), and dp rank r takes rows ``[r*B/dp, (r+1)*B/dp)`` of it. The global
batch therefore does not depend on the mesh: a run at (2, 2, 2) sees exactly the examples of the
single-process run at each step, and a resume at step k continues with step k+1's batch, with no
sampler state to save.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache

import torch

from ..arguments import plural
from .errors import UsageError


@dataclass(frozen=True)
class GlobalBatches:
    examples: int  # size of the split
    batch_size: int  # global
    seed: int

    def __post_init__(self) -> None:
        if self.batch_size > self.examples:
            raise UsageError(
                f"batch_size={self.batch_size} is larger than the training split ({plural(self.examples, 'example')}); "
                "use a smaller --batch-size or more data"
            )

    @property
    def steps_per_epoch(self) -> int:
        return self.examples // self.batch_size  # the tail of each permutation is skipped

    def global_indices(self, step: int) -> list[int]:
        """The global batch of 1-based ``step``."""
        epoch, i = divmod(step - 1, self.steps_per_epoch)
        perm = _permutation(self.examples, self.seed, epoch)
        return perm[i * self.batch_size : (i + 1) * self.batch_size]

    def local_indices(self, step: int, *, dp_rank: int, dp: int) -> list[int]:
        rows = self.global_indices(step)
        per = self.batch_size // dp
        return rows[dp_rank * per : (dp_rank + 1) * per]


@lru_cache(maxsize=2)
def _permutation(n: int, seed: int, epoch: int) -> list[int]:
    gen = torch.Generator().manual_seed(seed * 1_000_003 + epoch)
    return torch.randperm(n, generator=gen).tolist()


def eval_batches(examples: int, *, batch_size: int, limit: int = 0) -> list[tuple[list[int], int]]:
    """The validation split in order, as (indices, real rows) per global batch of ``batch_size``.
    The last batch is padded by repeating earlier rows (their labels are masked by the caller), so
    every example counts once and the batch shape fits any mesh."""
    if examples == 0:
        raise UsageError("the validation split is empty; use a larger --val-fraction or more data")
    out = []
    for start in range(0, examples, batch_size):
        rows = list(range(start, min(start + batch_size, examples)))
        real = len(rows)
        rows += [rows[i % real] for i in range(batch_size - real)]
        out.append((rows, real))
        if limit and len(out) == limit:
            break
    return out
