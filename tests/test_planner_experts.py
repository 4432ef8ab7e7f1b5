"""The planner on mixture-of-experts models: ep searched by default, and sharded data parallelism
with ep planned (the experts in FSDP groups of their own, planner/sharded.py) at Mixtral-8x7B's
shape on 64 GPUs. The per-rank memory and traffic of dp_shard x ep are checked against real runs in
tests/test_planner_memory.py (test_planner_memory_matches_a_sharded_expert_parallel_run)."""

from __future__ import annotations

import json

import torch
from transformers import LlamaConfig, MixtralConfig

from qn_hf.planner.cli import main
from qn_hf.planner.cost import Hardware
from qn_hf.planner.estimate import Planner
from qn_hf.planner.search import expert_degrees, search
from tests.ep_cases import moe_config

# Mixtral 8x7B's shape, written by hand (no hub access)
MIXTRAL = MixtralConfig(hidden_size=4096, intermediate_size=14336, num_hidden_layers=32, num_attention_heads=32,
                        num_key_value_heads=8, vocab_size=32000, max_position_embeddings=32768, num_local_experts=8,
                        num_experts_per_tok=2, tie_word_embeddings=False, architectures=["MixtralForCausalLM"])


def test_cli_plans_mixtral_with_sharded_data_parallelism_and_expert_parallelism(tmp_path, capsys):
    """The issue's command: every mesh that dp_shard=8 and ep=8 fit is planned (none refused for the
    experts' FSDP groups), and a rank holds what FSDP gives it: the rest of the model over the 8
    dp_shard ranks, its expert block over the X = dp x tp / 8 ranks holding the same experts. At
    ep=8 that block is one expert, one row of dim 0, which FSDP's padded shards give whole to each
    of the X ranks (ceil(1 / X) rows): no memory saved, and a gathered group X experts."""
    MIXTRAL.save_pretrained(tmp_path)
    main([str(tmp_path), "--gpus", "64", "--ep", "8", "--dp-shard", "8", "--json"])
    out = json.loads(capsys.readouterr().out)
    meshes = {(m["dp"], m["tp"], m["pp"]): m for m in out["meshes"]}
    assert len(meshes) == 10 and any(m["fits"] for m in meshes.values())
    assert all((m["ep"], m["dp_shard"], m["dp"] % 8) == (8, 8, 0) for m in meshes.values())
    assert all("dp_shard=8 must divide" in r["reason"] for r in out["rejected"])  # only dp < 8
    layer_experts = 8 * 3 * 4096 * 14336  # gate_up [8, 2I, H] and down [8, H, I] of one layer
    for (dp, tp, pp), mesh in meshes.items():
        holders = dp * tp // 8  # X
        stage = mesh["stages"][1 if pp > 1 else 0]  # a stage of blocks only
        blocks = stage["blocks"][1] - stage["blocks"][0] if pp > 1 else 32
        experts = blocks * layer_experts // 8  # this rank's expert of each layer, whole (float32)
        rest = stage["params"] - experts
        assert abs(stage["weight_bytes"] - 4 * (experts + rest / 8)) < 1e-3 * stage["weight_bytes"], (dp, tp, pp)
        assert stage["grad_bytes"] == stage["weight_bytes"]
        assert ("experts" in stage["comm"]) == (holders > 1)  # the experts' own FSDP group
        assert ("dp_replicate" in stage["comm"]) == (dp > 8)  # the rest hybrid across dp / dp_shard groups
        if pp == 1:  # two experts groups gathered at once in forward, X padded experts each, in bf16
            assert stage["unsharded_bytes"] > 2 * 2 * holders * layer_experts // 8, (dp, tp)


def test_search_tries_expert_parallelism_for_a_moe_model_only():
    """Without ep given, a MoE model's meshes are planned at ep=1 and at every ep that divides its
    experts and dp x tp (cp=1 then); a dense model's at ep=1 only."""
    assert expert_degrees(8, dict(dp=4, tp=2, cp=1), cp_given=False) == [1, 2, 4, 8]
    assert expert_degrees(8, dict(dp=3, tp=2, cp=1), cp_given=False) == [1, 2]
    assert expert_degrees(8, dict(dp=4, tp=2, cp=2), cp_given=False) == [1]
    assert expert_degrees(8, dict(dp=4, tp=2, cp=2), cp_given=True) == [1, 2, 4, 8]
    assert expert_degrees(0, dict(dp=4, tp=2, cp=1), cp_given=False) == [1]
    moe = Planner(moe_config("qwen3_moe", architectures=["Qwen3MoeForCausalLM"]), seq_len=128, micro_batch_size=1)
    assert moe.experts == 4
    accepted, rejected = search(moe, dict(schedule="1f1b", mixed_precision="bf16"), gpus=8,
                                hw=Hardware(), microbatches=None, ep=None)
    planned = {(c.estimate.dp, c.estimate.tp, c.estimate.pp, c.estimate.cp, c.estimate.ep) for c in accepted}
    assert {ep for *_, ep in planned} == {1, 2, 4}
    assert all(4 % ep == 0 and dp * tp % ep == 0 and (ep == 1 or cp == 1) for dp, tp, _, cp, ep in planned)
    assert {(dp, tp, pp, cp) for dp, tp, pp, cp, ep in planned if ep > 1} == {
        (dp, tp, pp, cp) for dp, tp, pp, cp, ep in planned if ep == 1 and cp == 1 and dp * tp > 1}
    assert not any("ep=" in r.reason for r in rejected)
    dense = LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=4, num_attention_heads=4,
                        num_key_value_heads=2, vocab_size=128, architectures=["LlamaForCausalLM"])
    planner = Planner(dense, seq_len=128, micro_batch_size=1, dtype=torch.float32)
    assert planner.experts == 0
    accepted, _ = search(planner, dict(schedule="1f1b"), gpus=4, hw=Hardware(),
                         microbatches=None, ep=None)
    assert accepted and {c.estimate.ep for c in accepted} == {1}


def test_cli_searches_expert_parallelism_by_default(tmp_path, capsys):
    """qn-hf-plan on a MoE model without --ep: an ep column, meshes at several ep; with --ep, that one."""
    moe_config("qwen3_moe", architectures=["Qwen3MoeForCausalLM"]).save_pretrained(tmp_path)
    main([str(tmp_path), "--gpus", "4", "--seq-len", "128", "--cp", "1", "--json"])
    assert {m["ep"] for m in json.loads(capsys.readouterr().out)["meshes"]} == {1, 2, 4}
    main([str(tmp_path), "--gpus", "4", "--seq-len", "128", "--cp", "1"])
    table = capsys.readouterr().out
    assert ", ep searched" in table and "| cp | ep | microbatches |" in table
    main([str(tmp_path), "--gpus", "4", "--seq-len", "128", "--ep", "2", "--json"])
    assert {m["ep"] for m in json.loads(capsys.readouterr().out)["meshes"]} == {2}
