"""Which loss qn_hf.Trainer trains in place of a Trainer class's compute_loss (no process started): transformers'
own, TRL's SFT (nll) and reward losses; any other override is refused, never silently left out."""

from __future__ import annotations

import pytest
import torch
import transformers

from qn_hf.integrations.hf_trainer.args import check_compute_loss
from qn_hf.integrations.hf_trainer.preference import paired_rows, reward_loss


def test_an_override_of_compute_loss_is_refused():
    class Custom(transformers.Trainer):
        def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
            return model(**inputs).loss * 2

    check_compute_loss(transformers.Trainer, object())
    with pytest.raises(ValueError, match=r"Custom.compute_loss is not called by qn_hf.Trainer.*compute_loss_func"):
        check_compute_loss(Custom, object())


def test_trl_trainers_their_losses_are_known():
    trl = pytest.importorskip("trl")
    check_compute_loss(trl.SFTTrainer, trl.SFTConfig(output_dir="/tmp/unused", loss_type="nll", bf16=False, use_cpu=True))
    check_compute_loss(trl.RewardTrainer, trl.RewardConfig(output_dir="/tmp/unused", bf16=False, use_cpu=True))
    with pytest.raises(ValueError, match=r"SFTTrainer with loss_type='dft'"):
        check_compute_loss(trl.SFTTrainer, trl.SFTConfig(output_dir="/tmp/unused", loss_type="dft", bf16=False, use_cpu=True))


def test_reward_pairs_split_over_microbatches_give_the_batch_loss():
    """TRL's layout (chosen rows, then rejected) laid out pair by pair: three microbatches of whole pairs, each
    weighed by its share of the rows, give RewardTrainer.compute_loss over the whole batch."""
    gen = torch.Generator().manual_seed(0)
    rewards = torch.randn(12, 1, generator=gen)  # 6 chosen rows, then 6 rejected
    margin = torch.rand(6, generator=gen)
    chosen, rejected = torch.chunk(rewards.squeeze(-1), 2)
    plain = -torch.nn.functional.logsigmoid(chosen - rejected - margin).mean() + 0.1 * ((chosen + rejected) ** 2).mean()
    batch = paired_rows({"rewards": rewards, "margin": margin})
    loss_fn = reward_loss(center_rewards_coefficient=0.1)
    total = sum(loss_fn(transformers.modeling_outputs.SequenceClassifierOutput(logits=batch["rewards"][i:i + 4]),
                        {"margin": batch["margin"][i:i + 4]}) * 4 / 12 for i in range(0, 12, 4))
    assert torch.allclose(total, plain, rtol=1e-6)
