"""The routers' loads in the time model (expert_parallel/routing_costs.py): ep is priced at its busiest rank's
load, from the router's measured loads or at uniform routing (named as assumed); the loads are
counted from a real forward, and malformed ones refused naming the fix."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

from qn_hf.config.parallel_config import ParallelConfig
from qn_hf.expert_parallel.routing_costs import ROUTING_UNIFORM, busiest_share, check_loads, uniform_busiest
from qn_hf.planner import measure_expert_loads
from qn_hf.planner.auto import auto_choice
from qn_hf.planner.calibration import Fit, assumed
from qn_hf.planner.cost import Hardware, step_time
from qn_hf.planner.estimate import Planner

MOE = Qwen3MoeConfig(hidden_size=64, intermediate_size=128, moe_intermediate_size=64, num_experts=4,
                     num_experts_per_tok=2, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                     head_dim=16, vocab_size=256, max_position_embeddings=64, architectures=["Qwen3MoeForCausalLM"])
HW = Hardware(gpu_memory=1 << 30, gpus_per_node=2)


def _machine():
    base = assumed(tflops=0.05, nvlink_gbps=1, ib_gbps=1, gpus_per_node=2, gpu_memory=1 << 30, world_size=2)
    return dataclasses.replace(base, device="cpu", op=Fit(20e-6, 5e9), overlap=0.0)


def test_busiest_share_takes_each_layers_busiest_block_of_experts():
    loads = [(3, 1, 2, 2), (1, 1, 1, 1)]  # layer 0: ranks hold (3+1, 2+2) at ep=2, (3, 1, 2, 2) at ep=4
    assert busiest_share(loads, 1) == 1.0
    assert busiest_share(loads, 2) == pytest.approx((4 * 2 / 8 + 1.0) / 2)
    assert busiest_share(loads, 4) == pytest.approx((3 * 4 / 8 + 1.0) / 2)


def test_uniform_busiest_matches_sampled_uniform_routing():
    g = torch.Generator().manual_seed(0)
    for ep, pairs in ((2, 2048), (4, 512), (8, 4096)):
        counts = torch.randint(0, ep, (4000, pairs), generator=g)
        per_rank = torch.stack([(counts == r).sum(1) for r in range(ep)], 1).double()
        sampled = (per_rank.max(1).values * ep / pairs).mean().item()
        assert uniform_busiest(pairs, ep) == pytest.approx(sampled, abs=0.2 * (sampled - 1))
    assert uniform_busiest(1000, 1) == 1.0 and uniform_busiest(100, 2) > uniform_busiest(10000, 2)


def test_malformed_loads_are_refused_naming_the_fix():
    with pytest.raises(ValueError, match=r"expert_loads\[1\].*4 non-negative counts"):
        check_loads([(1, 2, 3, 4), (1, 2, 3)], 4)
    with pytest.raises(ValueError, match="non-negative"):
        check_loads([(1, -2, 3, 4)], 4)
    with pytest.raises(ValueError, match="measure_expert_loads"):
        check_loads([], 4)
    with pytest.raises(ValueError, match=r"expert_loads\[0\]"):
        Planner(MOE, seq_len=32, micro_batch_size=2, expert_loads=[(1, 2)])


def test_measured_loads_price_ep_at_the_busiest_rank_and_uniform_is_named_assumed():
    cal = _machine()
    uniform = Planner(MOE, seq_len=32, micro_batch_size=2).estimate(ParallelConfig(dp=2, ep=2))
    skewed = Planner(MOE, seq_len=32, micro_batch_size=2, expert_loads=[(6, 2, 1, 1)] * 2).estimate(
        ParallelConfig(dp=2, ep=2))
    assert skewed.expert_imbalance == pytest.approx(1.6) and skewed.routing_measured
    assert 1.0 < uniform.expert_imbalance < 1.2 and not uniform.routing_measured
    t_uniform, t_skewed = step_time(uniform, HW, cal), step_time(skewed, HW, cal)
    assert t_skewed.compute > t_uniform.compute and t_skewed.tp == t_uniform.tp
    assert ROUTING_UNIFORM in t_uniform.assumed and ROUTING_UNIFORM not in t_skewed.assumed
    dp = Planner(MOE, seq_len=32, micro_batch_size=2, expert_loads=[(6, 2, 1, 1)] * 2).estimate(ParallelConfig(dp=2))
    assert dp.expert_imbalance == 1.0 and ROUTING_UNIFORM not in step_time(dp, HW, cal).assumed  # no ep: no wait


def test_measure_expert_loads_counts_every_tokens_choices_per_layer():
    torch.manual_seed(0)
    model = Qwen3MoeForCausalLM(MOE).float()
    ids = torch.randint(0, 256, (2, 16))
    loads = measure_expert_loads(model, [{"input_ids": ids}, {"input_ids": ids[:1]}])
    # one row per batch and layer: each token's two choices, batch by batch
    assert [sum(row) for row in loads] == [2 * 16 * 2] * 2 + [16 * 2] * 2 and all(len(row) == 4 for row in loads)
    cal = _machine()
    choice = auto_choice(model, global_batch=4, seq_len=16, world_size=2, calibration=cal, expert_loads=loads,
                         fixed={"ep": 2})
    assert choice.config.dims.ep == 2 and ROUTING_UNIFORM not in choice.time.assumed


def test_cli_reads_expert_loads_and_refuses_malformed_ones(tmp_path, capsys):
    import json

    from qn_hf.planner.cli import main

    MOE.to_json_file(str(tmp_path / "config.json"))
    (tmp_path / "loads.json").write_text(json.dumps([[6, 2, 1, 1]] * 2))
    (tmp_path / "bad.json").write_text(json.dumps([[6, 2]]))
    mesh = [str(tmp_path / "config.json"), "--dp", "2", "--tp", "1", "--pp", "1", "--ep", "2", "--seq-len", "32",
            "--dtype", "fp32", "--json"]
    main(mesh)
    assert ROUTING_UNIFORM in json.loads(capsys.readouterr().out)["step_time"]["assumed"]
    main([*mesh, "--expert-loads", str(tmp_path / "loads.json")])
    assert ROUTING_UNIFORM not in json.loads(capsys.readouterr().out)["step_time"]["assumed"]
    with pytest.raises(SystemExit):
        main([*mesh, "--expert-loads", str(tmp_path / "bad.json")])
    assert "expert_loads[0]" in capsys.readouterr().err
