"""How one tensor of the unsharded model is laid out across the ranks of a tensor-parallel group.

A ``ShardSpec`` is the single source of truth for slicing a full tensor into a rank's shard and for
putting the shards back together (``save_pretrained``, later checkpoints). It covers three layouts:

* plain split: ``[ chunk0 | chunk1 | ... ]`` along ``dim``, one chunk per tp rank;
* packed parts (GPT-2's fused ``c_attn`` is ``q | k | v``): each part is split on its own and a
  rank holds ``q_r | k_r | v_r``, so the fused projection stays fused on every rank;
* replicas (GQA with ``tp > num_key_value_heads``): ``replicas`` consecutive tp ranks hold the
  same chunk, so each rank has the KV heads its query heads need;

plus padding: a vocabulary of 50257 rows is zero-padded to ``padded_size`` so that it divides.

``axis`` names whose ranks hold the chunks: the tp ranks, or for MoE experts under expert
parallelism (``axis="ep"``) the members of the ep group, each holding a contiguous block of experts
along dim 0; ``tp`` is then the number of blocks. Everything below takes that axis's rank.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from ..config.dims import Axis


@dataclass(frozen=True)
class ShardSpec:
    dim: int
    tp: int
    size: int
    parts: int = 1
    replicas: int = 1
    padded_size: int | None = None
    axis: Axis = Axis.TP

    def __post_init__(self) -> None:
        object.__setattr__(self, "axis", Axis(self.axis))  # frozen: a spelled-out "ep" becomes the member once
        if self.tp % self.replicas:
            raise ValueError(f"replicas={self.replicas} must divide tp={self.tp}")
        if self.parts > 1 and self.padded_size not in (None, self.size):
            raise ValueError("padding is only supported for unpacked tensors")
        if self.full_size % (self.parts * self.chunks):
            raise ValueError(
                f"size {self.full_size} along dim {self.dim} is not divisible into "
                f"{self.parts} part(s) x {self.chunks} chunk(s)"
            )

    @property
    def chunks(self) -> int:
        """Number of distinct chunks per part (tp ranks that hold different data)."""
        return self.tp // self.replicas

    @property
    def full_size(self) -> int:
        """Size along ``dim`` after padding."""
        return self.padded_size if self.padded_size is not None else self.size

    @property
    def local_size(self) -> int:
        return self.full_size // self.chunks

    def chunk_index(self, tp_rank: int) -> int:
        return tp_rank // self.replicas

    def local_range(self, tp_rank: int) -> tuple[int, int]:
        """[start, stop) along ``dim`` of the padded tensor, for an unpacked spec."""
        if self.parts != 1:
            raise ValueError("local_range is defined for unpacked tensors only")
        start = self.chunk_index(tp_rank) * self.local_size
        return start, start + self.local_size

    def shard(self, full: torch.Tensor, tp_rank: int) -> torch.Tensor:
        """This rank's shard of ``full`` (a copy, so the full tensor can be freed)."""
        if full.shape[self.dim] != self.size:
            raise ValueError(f"expected size {self.size} along dim {self.dim}, got shape {tuple(full.shape)}")
        if self.full_size != self.size:
            pad = [0, 0] * (full.dim() - 1 - self.dim) + [0, self.full_size - self.size]
            full = F.pad(full, pad)
        part_len = self.full_size // self.parts
        chunk_len = part_len // self.chunks
        k = self.chunk_index(tp_rank)
        pieces = [full.narrow(self.dim, p * part_len + k * chunk_len, chunk_len) for p in range(self.parts)]
        return torch.cat(pieces, dim=self.dim).clone()

    def unshard(self, shards: Sequence[torch.Tensor]) -> torch.Tensor:
        """The full tensor from every tp rank's shard, in tp-rank order (replicas are read once)."""
        if len(shards) != self.tp:
            raise ValueError(f"expected {self.tp} shards, got {len(shards)}")
        distinct = [shards[k * self.replicas] for k in range(self.chunks)]
        chunk_len = self.local_size // self.parts
        pieces = [s.narrow(self.dim, p * chunk_len, chunk_len) for p in range(self.parts) for s in distinct]
        return torch.cat(pieces, dim=self.dim).narrow(self.dim, 0, self.size)

    def pieces(self, tp_rank: int) -> list[tuple[int, int, int]]:
        """This rank's shard as contiguous ranges of the unpadded tensor along ``dim``:
        ``(global_start, global_stop, local_start)``; one per packed part, padding left out."""
        part_len = self.full_size // self.parts
        chunk_len = part_len // self.chunks
        k = self.chunk_index(tp_rank)
        out = []
        for p in range(self.parts):
            start = p * part_len + k * chunk_len
            stop = min(start + chunk_len, self.size)
            if stop > start:
                out.append((start, stop, p * chunk_len))
        return out

    def writes(self, tp_rank: int) -> bool:
        """Whether this rank is the one of its replicas that saves the shard."""
        return tp_rank % self.replicas == 0

    def norm_weight(self) -> float:
        """Share of this shard's squared norm that belongs to the global norm (replicas count once)."""
        return 1.0 / self.replicas


def over_experts(spec: ShardSpec | None) -> bool:
    """Whether ``spec`` cuts a tensor into expert blocks over the ep group (not over tp)."""
    return spec is not None and spec.axis is Axis.EP


def padded(size: int, multiple: int) -> int:
    return -(-size // multiple) * multiple
