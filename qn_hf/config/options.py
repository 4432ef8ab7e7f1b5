"""The closed vocabularies of ``ParallelConfig`` and of policies: each option a ``Choice`` enum,
whose member equals its string, so ``mixed_precision="bf16"`` and ``Precision.BF16`` are one value,
while code compares members (``tests/test_structure.py`` refuses a string literal compared against
one of these names anywhere else in the package)."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from ..arguments import Choice

IGNORE_INDEX = -100  # HF's label for a position that is not scored

# The gradient buckets' size: as DDP's default, big enough to amortize a collective's latency, small
# enough that the first bucket's all-reduce starts early in backward.
DEFAULT_BUCKET_MB = 25.0


class Precision(Choice):
    """``mixed_precision``: the dtype the forward and backward compute in (float32 gradients and
    float32 master weights in ``qn_hf.optimizer``); fp16 adds a dynamic loss scale."""

    BF16 = "bf16"
    FP16 = "fp16"

    @property
    def dtype(self) -> torch.dtype:
        return torch.bfloat16 if self is Precision.BF16 else torch.float16

    @property
    def scaled(self) -> bool:
        """fp16's narrow range needs the loss scaled up (and gradients checked for overflow)."""
        return self is Precision.FP16


class Recompute(Choice):
    """``recompute``: each block's activations recomputed in backward, every one (``FULL``) or all but
    the products that cost FLOPs (``SELECTIVE``: matmuls and attention kept)."""

    FULL = "full"
    SELECTIVE = "selective"


class Gather(Choice):
    """``dp_shard_gather``: how often a pipeline stage all-gathers its blocks' sharded weights in one
    step (``data_parallel/sharded.py``): once, kept until the step's last backward, or per microbatch."""

    STEP = "step"
    MICROBATCH = "microbatch"


class LossKind(Choice):
    """The built-in losses a policy names. A member equals its string (policies written with
    ``loss="causal_lm"`` keep working; ``ModelPolicy`` stores the member)."""

    CAUSAL_LM = "causal_lm"  # next-token cross-entropy over the vocabulary, labels per position
    CLASSIFICATION = "classification"  # one label per sequence (ViT, sequence classification)

    @property
    def shifted(self) -> bool:
        """Position t predicts label t+1 (HF's shift), so targets are the labels moved by one."""
        return self is LossKind.CAUSAL_LM

    def targets(self, labels: torch.Tensor) -> torch.Tensor:
        """What each position is scored against: with HF's shift, position t predicts label t+1 and
        the last position predicts nothing; otherwise the labels as they are."""
        return F.pad(labels[..., 1:], (0, 1), value=IGNORE_INDEX) if self.shifted else labels
