"""Losses computed on tensor-parallel outputs, as sums over targets so microbatches add up exactly.

Hugging Face averages the loss over the non-ignored targets of the whole batch. Splitting that
batch into microbatches and dp ranks keeps the exact same value and gradients if every piece
returns its *sum* and the caller divides by the global number of targets, counted up front.
"""

from __future__ import annotations

from collections.abc import Mapping

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.distributed import ProcessGroup

from ..comm import group_size
from ..config.options import IGNORE_INDEX, LossKind


class _VocabParallelCrossEntropy(torch.autograd.Function):
    """Cross-entropy over vocab-sharded logits: all-reduce max and sums forward, local backward.

    Forward needs two collectives over tp: the max (for stability) and, stacked together, the sum of
    exponentials and the target's logit. The gradient ``softmax - onehot`` is local to each shard.
    Padding columns past the true vocabulary are excluded from the softmax.
    """

    @staticmethod
    def forward(ctx, logits, targets, vocab_start: int, vocab_size: int, group: ProcessGroup, ignore_index: int):
        ctx.in_dtype = logits.dtype
        logits = logits.float()
        n_local = logits.shape[-1]
        valid_cols = max(0, min(n_local, vocab_size - vocab_start))
        if valid_cols < n_local:
            logits = logits.clone()
            logits[..., valid_cols:] = float("-inf")
        distributed = group_size(group) > 1
        row_max = logits.max(dim=-1).values
        if distributed:
            dist.all_reduce(row_max, op=dist.ReduceOp.MAX, group=group)
        shifted = logits - row_max.unsqueeze(-1)
        exp = shifted.exp()
        ignored = targets == ignore_index
        local_t = targets - vocab_start
        here = (local_t >= 0) & (local_t < valid_cols) & ~ignored
        local_t = local_t.masked_fill(~here, 0)
        target_logit = shifted.gather(-1, local_t.unsqueeze(-1)).squeeze(-1).masked_fill(~here, 0.0)
        sums = torch.stack([exp.sum(dim=-1), target_logit])
        if distributed:
            dist.all_reduce(sums, group=group)
        sum_exp, target_logit = sums[0], sums[1]
        loss = (sum_exp.log() - target_logit).masked_fill(ignored, 0.0)
        ctx.save_for_backward(exp.div_(sum_exp.unsqueeze(-1)), local_t, here, ignored)
        return loss

    @staticmethod
    def backward(ctx, grad_loss):
        softmax, local_t, here, ignored = ctx.saved_tensors
        grad = softmax
        grad.scatter_add_(-1, local_t.unsqueeze(-1), -here.to(grad.dtype).unsqueeze(-1))
        grad.mul_((grad_loss * (~ignored).to(grad.dtype)).unsqueeze(-1))
        return grad.to(ctx.in_dtype), None, None, None, None, None




def vocab_parallel_cross_entropy(
    logits: torch.Tensor,
    targets: torch.Tensor,
    *,
    vocab_start: int,
    vocab_size: int,
    group: ProcessGroup,
    ignore_index: int = IGNORE_INDEX,
) -> torch.Tensor:
    """Per-target float32 loss (0 where ``targets == ignore_index``) from this rank's columns of the logits.

    ``logits[..., j]`` is the logit of token ``vocab_start + j``; columns at or past ``vocab_size``
    are padding and never win probability mass.
    """
    return _VocabParallelCrossEntropy.apply(logits, targets, vocab_start, vocab_size, group, ignore_index)


def local_count(batch: Mapping[str, torch.Tensor], *, shifted: bool | None, device: torch.device) -> torch.Tensor:
    """What a step's loss is a mean over, in this rank's ``batch``, as float64 ``[1]`` on ``device``:
    the built-in loss's targets (``shifted``: a causal LM's, after HF's shift), or with
    ``shifted=None`` (a ``loss_fn``, which averages its rows) the rows."""
    if shifted is None:  # torch.full: a fill on the device, nothing read back
        return torch.full((1,), float(next(iter(batch.values())).shape[0]), dtype=torch.float64, device=device)
    if "labels" not in batch:
        raise ValueError(f"batch lacks ['labels'] (has {sorted(batch)}): the built-in loss counts its targets")
    labels = batch["labels"].to(device, non_blocking=True)
    targets = (LossKind.CAUSAL_LM if shifted else LossKind.CLASSIFICATION).targets(labels)
    return (targets != IGNORE_INDEX).sum(dtype=torch.float64).reshape(1)


def loss_scales(count: torch.Tensor, *, rows: list[int], builtin: bool) -> list[torch.Tensor]:
    """What each microbatch's loss is multiplied by so that their sum is the mean over ``count``
    (float64 ``[1]``, summed over dp, or train_step's ``num_items_in_batch`` under accumulation): the
    built-in loss is summed over a microbatch's targets, so 1 / count each (1 without any target: the
    plain model's gradients are then 0); a loss_fn returns its microbatch's mean, so its rows / count,
    also when microbatches or dp ranks differ in size. The scales stay on the device (float64, as the
    Python floats they replace): reading the count back would make the host wait for the device at
    the start of every step."""
    if builtin:
        return [torch.ones_like(count).div_(count.clamp(min=1.0))[0]] * len(rows)
    return [torch.full_like(count, float(n)).div_(count)[0] for n in rows]


def nan_without_targets(loss: torch.Tensor, count: torch.Tensor) -> torch.Tensor:
    """The plain model's mean over no target is NaN (0/0; its gradients are 0, as the step's are):
    ``loss`` where ``count`` > 0, NaN where not (``torch.where``: no host read)."""
    return torch.where(count.reshape(-1)[0] > 0, loss, torch.full_like(loss, float("nan")))


def count_targets(labels: torch.Tensor, *, causal: bool) -> int:
    targets = (LossKind.CAUSAL_LM if causal else LossKind.CLASSIFICATION).targets(labels)
    return int((targets != IGNORE_INDEX).sum())


def summed_loss(logits: torch.Tensor, targets: torch.Tensor, *, kind: LossKind, vocab: tuple[int, int] | None,
                group: ProcessGroup) -> torch.Tensor:
    """The built-in loss of one microbatch, summed over its targets (``targets``: a causal LM's labels
    already shifted). ``vocab`` = (start, size) of this rank's columns when the head is vocab-parallel
    over ``group``, None when the logits hold the whole vocabulary (padding columns past its size are cut)."""
    if kind.shifted:
        start, size = vocab if vocab is not None else (0, logits.shape[-1])
        if vocab is None or group_size(group) == 1:  # the whole vocabulary is here: torch's fused kernel
            return F.cross_entropy(logits[..., :size].flatten(0, -2).float(), targets.flatten(), reduction="sum")
        return vocab_parallel_cross_entropy(logits.flatten(0, -2), targets.flatten(), vocab_start=start,
                                            vocab_size=size, group=group).sum()
    return F.cross_entropy(logits.float(), targets.flatten(), reduction="sum", ignore_index=IGNORE_INDEX)


def check_builtin_loss(kind: LossKind, config) -> None:
    """The built-in classification loss is single-label cross-entropy: refuse the problems it is not."""
    problem = getattr(config, "problem_type", None)
    if kind is LossKind.CLASSIFICATION and (config.num_labels == 1
                                            or problem in ("regression", "multi_label_classification")):
        raise ValueError(f"the built-in classification loss is single-label cross-entropy (num_labels="
                         f"{config.num_labels}, problem_type={problem!r}); pass loss_fn for this problem")
