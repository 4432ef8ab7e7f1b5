"""TRL's ``RewardTrainer`` through ``ParallelTrainerMixin``: the pairwise reward loss, split exactly.

TRL's collator stacks a batch's chosen sequences above its rejected ones (``input_ids`` of 2B rows,
``margin`` of B), and ``RewardTrainer.compute_loss`` pairs row i with row i + B: the loss is
``-logsigmoid(r_chosen - r_rejected [- margin])`` averaged over the pairs, plus
``center_rewards_coefficient`` times the mean of ``(r_chosen + r_rejected)^2``. Cutting those rows
into dp ranks and microbatches would part the pairs, so the batch is laid out pair by pair (chosen,
rejected, chosen, ...; each row's pair's margin beside it) and the loss pairs neighbouring rows: a
microbatch of whole pairs returns its pairs' mean, which ``train_step`` weighs by its share of the
rows, i.e. of the pairs, as the loss of one process over the whole batch. The model is any reward
model (a sequence classifier with one label).
"""

from __future__ import annotations

from collections.abc import Mapping

import torch
import torch.nn.functional as F

MARGIN = "margin"


def is_reward_trainer(trainer: object) -> bool:
    """Whether ``trainer`` is (a subclass of) TRL's ``RewardTrainer`` (read off its classes: TRL stays optional)."""
    return any(c.__name__ == "RewardTrainer" and c.__module__.startswith("trl") for c in type(trainer).__mro__)


def paired_rows(batch: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """TRL's batch (chosen rows, then rejected rows) laid out pair by pair, ``margin`` on both rows of its pair."""
    rows = next(v for k, v in batch.items() if k != MARGIN).shape[0]
    if rows % 2:
        raise ValueError(f"a reward batch holds chosen then rejected rows, an even number; got {rows}")
    order = torch.arange(rows).view(2, rows // 2).t().reshape(-1)  # 0, B, 1, B+1, ...
    paired = {k: v[order] for k, v in batch.items() if k != MARGIN}
    if MARGIN in batch:
        paired[MARGIN] = batch[MARGIN].repeat_interleave(2)
    return paired


def pairs_whole(*, rows: int, dp: int, microbatches: int) -> None:
    """Every dp rank's every microbatch must hold whole pairs: refuse (on every rank alike) otherwise."""
    pairs = rows // 2
    if pairs % (dp * microbatches):
        raise ValueError(f"the reward loss pairs each chosen row with its rejected one: {pairs} pairs per step do not "
                         f"divide into dp={dp} x microbatches={microbatches} parts of whole pairs; make the pairs per "
                         f"step (per_device_train_batch_size x dp x gradient_accumulation_steps) a multiple of "
                         f"{dp * microbatches}")


def reward_loss(*, center_rewards_coefficient: float | None):
    """``pm.train_step``'s ``loss_fn``: ``RewardTrainer.compute_loss`` on a microbatch of whole pairs."""

    def loss_fn(outputs, batch: Mapping[str, torch.Tensor]) -> torch.Tensor:
        rewards = outputs.logits.squeeze(-1).view(-1, 2)
        chosen, rejected = rewards[:, 0], rewards[:, 1]
        if MARGIN in batch:
            loss = -F.logsigmoid(chosen - rejected - batch[MARGIN].view(-1, 2)[:, 0]).mean()
        else:
            loss = -F.logsigmoid(chosen - rejected).mean()
        if center_rewards_coefficient is not None:
            loss = loss + center_rewards_coefficient * torch.mean((chosen + rejected) ** 2)
        return loss

    return loss_fn
