"""Tensor-parallel replacements for ``nn.Embedding`` (and the subclasses ``qn_hf.policies.embedding_types`` accepts).

``VocabParallelEmbedding`` splits the vocabulary rows; ``ColumnParallelEmbedding`` splits the
embedding dimension. Both return the full embedding on every rank, then apply the behaviour the
replaced subclass added (Gemma's ``embed_scale``, Inkling's ``embed_norm``), so the module computes
exactly what the original computed. Parameter and buffer names stay those of the original.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn
from torch.distributed import ProcessGroup

from ..comm import gather_from_group, group_size, reduce_from_group
from ..policies.embedding_types import EmbeddingAdapter, adapter_for
from .shard import ShardSpec


def _checked_adapter(module: nn.Module) -> EmbeddingAdapter:
    adapter = adapter_for(module)
    if adapter is None:
        raise TypeError(f"{type(module).__name__} is not an nn.Embedding whose forward qn_hf can reproduce")
    if module.max_norm is not None or module.scale_grad_by_freq or module.sparse:
        raise ValueError("a parallel embedding does not support max_norm, scale_grad_by_freq or sparse")
    return adapter


class _ParallelEmbedding(nn.Module):
    """The part both splits share: the local weight, the group, and the subclass's extra behaviour."""

    def __init__(self, *, weight: torch.Tensor, group: ProcessGroup, weight_spec: ShardSpec, source: nn.Module) -> None:
        super().__init__()
        self.weight = nn.Parameter(weight, requires_grad=source.weight.requires_grad)
        self.group = group
        self.weight_spec = weight_spec
        self.padding_idx = source.padding_idx
        self.behaviour = _checked_adapter(source).behaviour
        if self.behaviour == "scaled":
            # The same non-persistent buffer and float as the original, so the scale is applied in the
            # same dtype; a meta-device model gets it back from ``reset_buffers``.
            self.scalar_embed_scale = source.scalar_embed_scale
            self.register_buffer("embed_scale", source.embed_scale.clone(), persistent=False)
        elif self.behaviour == "scaled_by_float":
            self.embed_scale = source.embed_scale  # a Python float, multiplied as the original multiplies it
        elif self.behaviour == "normed":
            self.embed_norm = source.embed_norm  # replicated: it sees the full embedding

    def reset_buffers(self) -> None:
        if self.behaviour == "scaled":
            with torch.no_grad():
                self.embed_scale.fill_(self.scalar_embed_scale)

    def shard_specs(self) -> dict[str, ShardSpec | None]:
        return {"weight": self.weight_spec}

    def finish(self, full: torch.Tensor) -> torch.Tensor:
        """The replaced subclass's behaviour, on the full embedding."""
        if self.behaviour == "scaled":
            return full * self.embed_scale.to(self.weight.dtype)
        if self.behaviour == "scaled_by_float":
            return full * self.embed_scale
        if self.behaviour == "normed":
            return self.embed_norm(full)
        return full


class VocabParallelEmbedding(_ParallelEmbedding):
    """Vocabulary rows split across tp (padded so that tp divides them).

    Each rank looks up the ids that fall in its row range, writes zeros for the others, and an
    all-reduce (identity backward) assembles the full embedding on every rank.
    """

    def __init__(self, *, weight: torch.Tensor, group: ProcessGroup, weight_spec: ShardSpec, tp_rank: int,
                 source: nn.Module) -> None:
        super().__init__(weight=weight, group=group, weight_spec=weight_spec, source=source)
        self.vocab_start, self.vocab_stop = weight_spec.local_range(tp_rank)
        self.num_embeddings = weight.shape[0]
        self.embedding_dim = weight.shape[1]
        # HF keeps the padding row's gradient at zero; keep that for the rank that owns the row.
        idx = self.padding_idx
        self.local_padding_idx = idx - self.vocab_start if idx is not None and self.vocab_start <= idx < self.vocab_stop else None

    @classmethod
    def from_module(cls, module: nn.Embedding, *, spec: ShardSpec, tp_rank: int, group: ProcessGroup) -> VocabParallelEmbedding:
        _checked_adapter(module)
        if spec.size != module.num_embeddings or spec.dim != 0:
            raise ValueError(f"spec {spec} does not describe the rows of an embedding of {module.num_embeddings}")
        return cls(weight=spec.shard(module.weight.data, tp_rank), group=group, weight_spec=spec, tp_rank=tp_rank,
                   source=module)

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        if group_size(self.group) == 1:  # the whole vocabulary is here
            return self.finish(F.embedding(input_ids, self.weight, self.local_padding_idx))
        outside = (input_ids < self.vocab_start) | (input_ids >= self.vocab_stop)
        local_ids = (input_ids - self.vocab_start).masked_fill(outside, 0)
        out = F.embedding(local_ids, self.weight, self.local_padding_idx)
        out = out.masked_fill(outside.unsqueeze(-1), 0.0)
        return self.finish(reduce_from_group(out, group=self.group))

    def extra_repr(self) -> str:
        return f"rows=[{self.vocab_start}, {self.vocab_stop}), dim={self.embedding_dim}, {self.behaviour}, spec={self.weight_spec}"


class ColumnParallelEmbedding(_ParallelEmbedding):
    """Embedding dimension split across tp: each rank looks up its columns of every row; an
    all-gather (split backward) assembles the full vectors. The ids are replicated, so no gradient
    crosses ranks."""

    def __init__(self, *, weight: torch.Tensor, group: ProcessGroup, weight_spec: ShardSpec, source: nn.Module) -> None:
        super().__init__(weight=weight, group=group, weight_spec=weight_spec, source=source)
        self.num_embeddings = weight.shape[0]
        self.embedding_dim = source.embedding_dim

    @classmethod
    def from_module(cls, module: nn.Embedding, *, spec: ShardSpec, tp_rank: int, group: ProcessGroup) -> ColumnParallelEmbedding:
        _checked_adapter(module)
        if spec.size != module.embedding_dim or spec.dim != 1:
            raise ValueError(f"spec {spec} does not describe the columns of an embedding of dim {module.embedding_dim}")
        return cls(weight=spec.shard(module.weight.data, tp_rank), group=group, weight_spec=spec, source=module)

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        local = F.embedding(input_ids, self.weight, self.padding_idx)
        return self.finish(gather_from_group(local, group=self.group))


