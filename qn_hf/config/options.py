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


class Offload(Choice):
    """``offload``: what is held in host memory between a block's forward and its backward
    (``ACTIVATIONS``: what recomputation keeps, each block's inputs; memory/offload.py)."""

    ACTIVATIONS = "activations"


class Gather(Choice):
    """``dp_shard_gather``: how often a pipeline stage all-gathers its blocks' sharded weights in one
    step (``data_parallel/sharded.py``): once, kept until the step's last backward, or per microbatch."""

    STEP = "step"
    MICROBATCH = "microbatch"


class LossKind(Choice):
    """The losses ``train_step`` computes itself, as sums over microbatches, each equal to what a
    family of transformers' heads computes (the head is found from the model: ``policies/task.py``).
    A member equals its string (``loss="causal_lm"`` in a user's policy keeps working)."""

    CAUSAL_LM = "causal_lm"  # next-token cross-entropy over the vocabulary, labels per position
    TOKENS = "tokens"  # cross-entropy per position, labels as they are (masked LM, token classification, seq2seq LM)
    CLASSIFICATION = "classification"  # one label per row: cross-entropy, or by problem_type MSE or BCE (as HF)
    SPANS = "spans"  # extractive question answering: the start's and the end's cross-entropy, halved
    OWN = "own"  # any other loss: the model's own ``outputs.loss``, from one forward over the whole batch

    @property
    def shifted(self) -> bool:
        """Position t predicts label t+1 (HF's shift), so targets are the labels moved by one."""
        return self is LossKind.CAUSAL_LM

    @property
    def per_position(self) -> bool:
        """One label per position of the sequence (a causal or masked LM, token classification)."""
        return self in (LossKind.CAUSAL_LM, LossKind.TOKENS)

    def targets(self, labels: torch.Tensor) -> torch.Tensor:
        """What each position is scored against: with HF's shift, position t predicts label t+1 and
        the last position predicts nothing; otherwise the labels as they are."""
        return F.pad(labels[..., 1:], (0, 1), value=IGNORE_INDEX) if self.shifted else labels


class ProblemType(Choice):
    """``config.problem_type`` of a classification head, as transformers names and infers it."""

    REGRESSION = "regression"  # MSE over every label value
    SINGLE_LABEL = "single_label_classification"  # cross-entropy over the rows, -100 ignored
    MULTI_LABEL = "multi_label_classification"  # binary cross-entropy with logits over every label value
    # not a value of transformers' config: DeBERTa's rows of class probabilities without a problem_type,
    # cross-entropy against them averaged over the rows (task.py's OWN_PROBLEM_TYPES)
    SOFT_LABEL = "soft_label_classification"


class Dispatch(Choice):
    """``expert_dispatch``: how an MoE call under ep moves tokens to the ranks holding their experts
    (``expert_parallel/dispatch.py``).

    ``ALL_TO_ALL`` (the default) sends each (token, choice) pair to its expert's holder once: the
    least traffic and memory, but an all-to-all of uneven sizes, which the host must know, so each MoE
    call waits for the device once to read the routing's counts. ``ALL_GATHER`` needs no count: every
    member of the ep group gathers every member's tokens and routing (equal sizes, known from the
    shapes), runs its own experts on the pairs routed to them (transformers' experts skip the rest as
    sentinels) and the partial outputs are summed back to their tokens' rank; no device wait, at ep
    times the tokens moved (about ep/top_k times ALL_TO_ALL's traffic) and held by the experts' call.
    It needs every rank's batch of a step to have the same shapes (checked each step with the batch's
    agreement) and transformers' ``grouped_mm`` or ``batched_mm`` experts."""

    ALL_TO_ALL = "all_to_all"
    ALL_GATHER = "all_gather"
