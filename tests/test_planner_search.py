"""The search's shortcuts change nothing: one planner serving every mesh (a recorded forward read
under each tp's plan, the checks' pass reused across dp_shard, placements and pipeline timings
cached) gives what a fresh planner gives for each mesh alone, and a refusal is still raised with
its own message."""

from __future__ import annotations

import pytest
import torch
from transformers import LlamaConfig

from qn_hf.checkpoint.layout import meta_model
from qn_hf.config.features import Feature
from qn_hf.config.parallel_config import ParallelConfig
from qn_hf.planner.cost import Hardware
from qn_hf.planner.estimate import Planner
from qn_hf.planner.search import search
from qn_hf.validation.checks import check_parallel_config
from tests.ep_cases import moe_config

LLAMA = LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=4, num_attention_heads=8,
                    num_key_value_heads=2, vocab_size=128, max_position_embeddings=256,
                    architectures=["LlamaForCausalLM"])


@pytest.mark.parametrize(("config", "settings"), [
    (LLAMA, {"mixed_precision": "bf16"}),
    (LLAMA, {"mixed_precision": "bf16", "recompute": "full", "schedule": "gpipe"}),
    (moe_config("qwen3_moe", architectures=["Qwen3MoeForCausalLM"]), {"mixed_precision": "bf16", "ep": None}),
])
def test_search_gives_what_each_mesh_gives_alone(config, settings):
    schedule = settings.pop("schedule", "1f1b")
    planner = Planner(config, seq_len=128, micro_batch_size=1)
    options = dict(schedule=schedule, **{k: v for k, v in settings.items() if k != "ep"})
    accepted, _ = search(planner, options, gpus=8, hw=Hardware(), microbatches=None, dp_shard=None,
                         **{k: v for k, v in settings.items() if k == "ep"})
    assert len({(c.estimate.tp, c.estimate.cp, c.estimate.dp_shard) for c in accepted}) > 4
    settings.pop("ep", None)
    for candidate in accepted[::3]:
        e = candidate.estimate
        alone = Planner(config, seq_len=128, micro_batch_size=1).estimate(ParallelConfig.from_keywords(
            dp=e.dp, tp=e.tp, pp=e.pp, cp=e.cp, ep=e.ep, dp_shard=e.dp_shard, microbatches=e.microbatches,
            schedule=schedule, **settings))
        assert alone == e, (e.dp, e.tp, e.pp, e.cp, e.ep, e.dp_shard)


def test_a_check_passed_at_one_dp_shard_still_refuses_at_another():
    """ZeRO-1 composes with plain dp but not with dp_shard: the pass at dp_shard=1 is not reused for
    dp_shard=2, which is refused with check_parallel_config's (parallelize's) message."""
    planner = Planner(LLAMA, seq_len=128, micro_batch_size=1, dtype=torch.float32)
    planner.estimate(ParallelConfig.from_keywords(dp=2, tp=1, pp=1, microbatches=1), zero=True)
    with pytest.raises(ValueError) as planned:
        planner.estimate(ParallelConfig.from_keywords(dp=2, tp=1, pp=1, microbatches=1, dp_shard=2), zero=True)
    with pytest.raises(ValueError) as real:
        check_parallel_config(meta_model(LLAMA), dp=2, dp_shard=2, microbatches=1, extra=frozenset({Feature.ZERO}))
    assert str(planned.value) == str(real.value) and "dp_shard" in str(planned.value)
