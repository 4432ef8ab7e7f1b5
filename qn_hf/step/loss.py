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
from ..config.options import IGNORE_INDEX, LossKind, ProblemType
from ..policies.task import SPAN_KEYS, TaskHead
from ..tensor_parallel.apply import VocabShard
from .packed import batch_rows


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


# What each kind's loss is: K terms, each a sum over its items divided by the step's count of them,
# added with these weights (question answering halves the start's and the end's cross-entropy).
TERM_WEIGHTS: dict[LossKind, tuple[float, ...]] = {LossKind.SPANS: (0.5, 0.5)}


def term_weights(kind: LossKind | None) -> tuple[float, ...]:
    """The weights of ``kind``'s terms (one term of weight 1 for all but question answering; a
    ``loss_fn``, ``kind=None``, is one term)."""
    return TERM_WEIGHTS.get(kind, (1.0,)) if kind is not None else (1.0,)


def problem_type(config, labels: torch.Tensor, *, problem_types: bool, own: bool = False) -> ProblemType:
    """What a classifier's loss is, as transformers decides it: ``config.problem_type`` when set, else
    regression for one label, single-label for integer labels, multi-label otherwise. A head that
    does not follow ``problem_type`` (multiple choice) is single-label cross-entropy always; ``own``:
    DeBERTa's rules without a problem_type (one label: regression; one label per row: single-label;
    rows of labels: soft labels)."""
    if not problem_types:
        return ProblemType.SINGLE_LABEL
    if getattr(config, "problem_type", None):
        return ProblemType(config.problem_type)
    if config.num_labels == 1:
        return ProblemType.REGRESSION
    if own:
        return ProblemType.SINGLE_LABEL if labels.dim() == 1 or labels.shape[-1] == 1 else ProblemType.SOFT_LABEL
    if labels.dtype in (torch.long, torch.int):
        return ProblemType.SINGLE_LABEL
    return ProblemType.MULTI_LABEL


def scored_labels(batch: Mapping[str, torch.Tensor], head: TaskHead) -> torch.Tensor:
    """The labels as the head scores them: -100 where its ``attention_mask`` leaves a position out (the
    token classifiers that do so), and for DeBERTa's own rules every negative label."""
    labels = batch["labels"]
    if head.mask_labels and "attention_mask" in batch:
        labels = labels.masked_fill(batch["attention_mask"].to(labels.device) != 1, IGNORE_INDEX)
    if head.own_problem_types and not labels.is_floating_point():
        labels = labels.masked_fill(labels < 0, IGNORE_INDEX)
    return labels


def span_positions(batch: Mapping[str, torch.Tensor], key: str, *, length: int) -> torch.Tensor:
    """``start_positions`` or ``end_positions`` as the span loss scores them: one per row, clamped to
    [0, length], where ``length`` (the sequence's) means ignored."""
    positions = batch[key]
    if positions.dim() > 1:
        positions = positions.squeeze(-1)
    return positions.clamp(0, length)


def local_count(batch: Mapping[str, torch.Tensor], *, kind: LossKind | None, head: TaskHead | None = None,
                problem: ProblemType | None = None, device: torch.device) -> torch.Tensor:
    """What a step's loss is a mean over, in this rank's ``batch``, as float64 ``[K]`` on ``device``
    (one count per term of ``kind``'s loss; ``kind=None``, a ``loss_fn``, which averages its rows:
    the rows). Counted on the device: a fill or a sum, nothing read back."""
    rows = batch_rows(batch)
    if kind is None or kind is LossKind.OWN:  # a loss_fn's rows; OWN runs one forward: its own mean, once
        value = float(rows) if kind is None else 1.0
        return torch.full((1,), value, dtype=torch.float64, device=device)
    missing = [k for k in (SPAN_KEYS if kind is LossKind.SPANS else ("labels",)) if k not in batch]
    if missing:
        raise ValueError(f"batch lacks {missing} (has {sorted(batch)}): the built-in loss counts its targets")
    if kind is LossKind.SPANS:
        length = _sequence_length(batch)
        counts = [(span_positions(batch, k, length=length).to(device, non_blocking=True) != length).sum(dtype=torch.float64)
                  for k in SPAN_KEYS]
        return torch.stack(counts)
    if kind is LossKind.CLASSIFICATION and problem in (ProblemType.REGRESSION, ProblemType.MULTI_LABEL):
        return torch.full((1,), float(batch["labels"].numel()), dtype=torch.float64, device=device)
    if kind is LossKind.CLASSIFICATION and problem is ProblemType.SOFT_LABEL:
        return torch.full((1,), float(rows), dtype=torch.float64, device=device)
    labels = scored_labels(batch, head) if head is not None else batch["labels"]
    labels = labels.to(device, non_blocking=True)
    targets = batch["targets"].to(device, non_blocking=True) if "targets" in batch else kind.targets(labels)
    return (targets != IGNORE_INDEX).sum(dtype=torch.float64).reshape(1)


def _sequence_length(batch: Mapping[str, torch.Tensor]) -> int:
    """The length of the batch's sequences, which the span head's logits have."""
    for key in ("input_ids", "inputs_embeds", "attention_mask"):
        if key in batch and batch[key].dim() >= 2:
            return batch[key].shape[1]
    raise ValueError(f"batch has no sequence (input_ids, inputs_embeds or attention_mask) to score spans over "
                     f"(has {sorted(batch)})")


def loss_scales(count: torch.Tensor, *, rows: list[int], builtin: bool,
                weights: tuple[float, ...] = (1.0,)) -> list[torch.Tensor]:
    """What each microbatch's loss terms (``[K]``) are multiplied by so that their sum is the mean over
    ``count`` (float64 ``[K]``, summed over dp, or train_step's ``num_items_in_batch`` under
    accumulation): the built-in loss is summed over a microbatch's items, so weight / count each (the
    weight over 1 without any item: the plain model's gradients are then 0); a loss_fn returns its
    microbatch's mean, so its rows / count, also when microbatches or dp ranks differ in size. The
    scales stay on the device (float64, as the Python floats they replace): reading the count back
    would make the host wait for the device at the start of every step."""
    if builtin:
        # filled on the device: torch.tensor(weights, device=...) would copy from pageable host memory and, on
        # CUDA, wait for the stream (memcpy_and_sync) every step
        scale = (torch.full((len(weights),), weights[0], dtype=torch.float64, device=count.device)
                 if len(set(weights)) == 1 else
                 torch.stack([torch.full((), w, dtype=torch.float64, device=count.device) for w in weights]))
        scale = scale.div_(count.clamp(min=1.0))
        return [scale] * len(rows)
    return [torch.full_like(count, float(n)).div_(count) for n in rows]


def scaled(value: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """``value * scale`` (a microbatch's loss and its ``loss_scales``) as a Python float scale made it: the
    product in float32 (float64 for a float64 loss), the result in ``value``'s dtype."""
    opmath = torch.float64 if value.dtype == torch.float64 else torch.float32
    return (value.to(opmath) * scale.to(opmath)).to(value.dtype)


def nan_without_targets(loss: torch.Tensor, count: torch.Tensor) -> torch.Tensor:
    """The plain model's mean over no target is NaN (0/0; its gradients are 0, as the step's are):
    ``loss`` where every term of ``count`` > 0, NaN where not (``torch.where``: no host read)."""
    return torch.where((count.reshape(-1) > 0).all(), loss, torch.full_like(loss, float("nan")))


def count_targets(labels: torch.Tensor, *, causal: bool) -> int:
    targets = (LossKind.CAUSAL_LM if causal else LossKind.TOKENS).targets(labels)
    return int((targets != IGNORE_INDEX).sum())


def _widened(logits: torch.Tensor) -> torch.Tensor:
    """A classifier's or span head's logits in float32 at least: transformers computes these losses in the logits'
    own dtype (no cast, unlike its per-position losses, which take float32 whatever the dtype), so a float64
    model's stay float64; a half-precision one's are widened, which its own forward would not do."""
    return logits.to(torch.promote_types(logits.dtype, torch.float32))


def position_targets(batch: Mapping[str, torch.Tensor], *, kind: LossKind, head: TaskHead) -> torch.Tensor:
    """What each position of a per-position loss is scored against: the step's ``targets`` (a causal LM's
    labels shifted before the forward, under cp), else ``kind``'s targets of the scored labels."""
    targets = batch.get("targets")
    return kind.targets(scored_labels(batch, head)) if targets is None else targets


def token_loss_sum(logits: torch.Tensor, targets: torch.Tensor, *, vocab: VocabShard | None,
                   group: ProcessGroup) -> torch.Tensor:
    """The float32 cross-entropy of ``logits`` (``[..., columns]``) against ``targets`` (``[...]``), summed
    over the targets not ignored: torch's fused kernel where the whole vocabulary is here (``vocab``
    None, or one tp rank), else the vocab-parallel one over ``group`` (``vocab``: this rank's columns)."""
    start, size = (vocab.start, vocab.size) if vocab is not None else (0, logits.shape[-1])
    if vocab is None or group_size(group) == 1:
        return F.cross_entropy(logits[..., :size].flatten(0, -2).float(), targets.flatten(), reduction="sum")
    return vocab_parallel_cross_entropy(logits.flatten(0, -2), targets.flatten(), vocab_start=start,
                                        vocab_size=size, group=group).sum()


def summed_loss(outputs, batch: Mapping[str, torch.Tensor], *, kind: LossKind, head: TaskHead,
                problem: ProblemType | None, vocab: VocabShard | None, group: ProcessGroup) -> torch.Tensor:
    """The built-in loss of one microbatch as ``[K]`` sums over its items, one per term (``batch``: the
    microbatch, its ``targets`` a causal LM's labels already shifted under cp). ``vocab``: this rank's
    columns when the head is vocab-parallel over ``group``, None when the logits hold the whole
    vocabulary (padding columns past its size are cut)."""
    if kind is LossKind.OWN:
        return outputs.loss.reshape(1)
    if kind is LossKind.SPANS:
        sums = []
        for key, name in zip(SPAN_KEYS, ("start_logits", "end_logits")):
            logits = getattr(outputs, name)
            positions = span_positions(batch, key, length=logits.shape[1])
            sums.append(F.cross_entropy(_widened(logits), positions, reduction="sum", ignore_index=logits.shape[1]))
        return torch.stack(sums)
    logits = outputs.logits
    if kind.per_position:
        return token_loss_sum(logits, position_targets(batch, kind=kind, head=head), vocab=vocab,
                              group=group).reshape(1)
    labels = scored_labels(batch, head)
    logits = _widened(logits)
    if problem is ProblemType.REGRESSION:
        if logits.shape[-1] == 1:  # one label: HF compares the squeezed logits and labels
            logits, labels = logits.reshape(-1), labels.reshape(-1)
        return F.mse_loss(logits, labels.to(logits.dtype), reduction="sum").reshape(1)
    if problem is ProblemType.MULTI_LABEL:
        return F.binary_cross_entropy_with_logits(logits, labels.to(logits.dtype), reduction="sum").reshape(1)
    if problem is ProblemType.SOFT_LABEL:
        return (-(F.log_softmax(logits, dim=-1) * labels.to(logits.dtype)).sum()).reshape(1)
    return F.cross_entropy(logits.reshape(labels.numel(), -1), labels.flatten(), reduction="sum",
                           ignore_index=IGNORE_INDEX).reshape(1)
