"""The planner per pipeline schedule: activation peaks, the W stash and the bubble come from the
schedule's own action lists (``qn_hf.pipeline.schedule_check``), for every schedule and V."""

from __future__ import annotations

import json

import pytest
import torch
from transformers import LlamaConfig

from qn_hf.checkpoint.layout import meta_model
from qn_hf.config.parallel_config import ParallelConfig
from qn_hf.planner.cli import main
from qn_hf.planner.estimate import Planner, estimate_mesh
from tests.cases import parallelize_as_launched

# Pipeline schedules: 8 blocks, so pp x V up to 8 chunks.
SMALL = LlamaConfig(hidden_size=256, intermediate_size=512, num_hidden_layers=8, num_attention_heads=8,
                    num_key_value_heads=4, vocab_size=1000, tie_word_embeddings=False, architectures=["LlamaForCausalLM"])
SCHEDULE_CASES = [("1f1b", 1), ("gpipe", 1), ("interleaved_1f1b", 2), ("zb_h1", 1)]


def _small_plans(**mesh) -> dict[tuple[str, int], object]:
    planner = Planner(SMALL, seq_len=64, micro_batch_size=1, dtype=torch.bfloat16)
    return {(name, v): planner.estimate(ParallelConfig.from_keywords(**{"dp": 1, "tp": 2, **mesh}, schedule=name,
                                                                     virtual_stages=v))
            for name, v in SCHEDULE_CASES}


@pytest.mark.parametrize("pp", [2, 4])
def test_schedule_memory_and_bubble_are_schedule_checks(pp):
    """Per rank: in-flight counts are schedule_check's peaks of the same lists, the activation peak a
    walk over them (per chunk: bytes x alive F->B, plus zb_h1's stash x alive B->W), the bubble timed
    on them; interleaving and zb_h1 shrink 1F1B's bubble at the same M."""
    from qn_hf.pipeline.costs import op_costs
    from qn_hf.pipeline.schedule import Op, chunk_of, schedule_actions
    from qn_hf.pipeline.schedule_check import peaks, timed

    plans = _small_plans(pp=pp, microbatches=8)
    chunked = Planner(SMALL, seq_len=64, micro_batch_size=1, dtype=torch.bfloat16).estimate(
        ParallelConfig.from_keywords(dp=1, tp=2, pp=2 * pp, microbatches=8))  # chunk c of the V=2 plan is stage c here
    for (name, v), est in plans.items():
        lists = schedule_actions(stages=pp, microbatches=8, schedule=name, virtual_stages=v)
        slowest = max(est.stages, key=lambda s: s.flops_per_microbatch)
        costs = op_costs(compute=slowest.flops_per_microbatch, weight=slowest.weight_grad_flops_per_microbatch,
                         comm=0.0, recompute=None, schedule=name, virtual_stages=v)
        assert est.bubble == max(timed(lists, costs=costs).bubble)
        assert (costs[Op.WGT] > 0) == (name == "zb_h1")
        for s, acts in zip(est.stages, lists):
            assert (s.in_flight, s.in_flight_w) == (peaks(acts).f_to_b, peaks(acts).f_to_w)
            kept = {c: chunked.stages[c].activation_bytes_per_microbatch if v > 1 else s.activation_bytes_per_microbatch
                    for c in range(pp * v)}
            stash = s.weight_stash_bytes_per_microbatch
            alive, waiting, peak = dict.fromkeys(kept, 0), 0, 0
            for a in acts:
                c = chunk_of(a, stage=s.stage)
                alive[c] += {Op.FWD: 1, Op.BWD: -1}.get(a.op, 0)
                waiting += {Op.BWD: 1, Op.WGT: -1}.get(a.op, 0) if name == "zb_h1" else 0
                peak = max(peak, sum(kept[k] * n for k, n in alive.items()) + stash * waiting)
            assert s.activation_bytes == peak
            if v > 1:
                assert s.chunks == tuple(chunked.stages[c].blocks for c in range(s.stage, pp * v, pp))
                assert s.params == sum(chunked.stages[c].params for c in range(s.stage, pp * v, pp))
                assert s.activation_bytes_per_microbatch == sum(kept[c] for c in range(s.stage, pp * v, pp))
    base = plans["1f1b", 1]
    assert plans["interleaved_1f1b", 2].bubble < base.bubble and plans["zb_h1", 1].bubble < base.bubble
    assert plans["gpipe", 1].bubble == pytest.approx(base.bubble) == pytest.approx((pp - 1) / (8 + pp - 1))
    zb = [s.activation_bytes - b.activation_bytes for s, b in zip(plans["zb_h1", 1].stages, base.stages)]
    assert min(zb) >= 0 and max(zb) > 0  # the W stash on top of 1F1B's activations


def test_zb_h1_stash_is_the_deferred_linears_inputs_and_output_gradients():
    """Per block at tp=2 (bf16, 64 tokens): the attention's shared input once, q/k/v and gate/up
    outputs split (column layers), o_proj's and down_proj's inputs split and outputs whole (row
    layers); lm_head (a head) is not deferred, nor are the embedding and norms."""
    est = _small_plans(pp=2, microbatches=4)["zb_h1", 1]
    h, kv, inter = 256, 4 * 32, 512
    block = h + (h + 2 * kv) // 2 + h // 2 + h + h + 2 * inter // 2 + inter // 2 + h
    assert [s.weight_stash_bytes_per_microbatch for s in est.stages] == [4 * block * 64 * 2] * 2
    linears = 4 * (h * h + 2 * h * kv + h * h + 3 * h * inter) // 2  # per stage, this tp rank's weights
    assert [s.weight_grad_flops_per_microbatch for s in est.stages] == [2 * linears * 64] * 2


def test_schedule_refusals_and_cli(tmp_path, capsys):
    """Refused schedules say what parallelize says; the CLI takes every schedule and V, lists a rank's
    chunks, names the schedule with its bubble, and picks an M the schedule allows."""
    from qn_hf.config.schedule import SCHEDULES, microbatches_allowed
    from qn_hf.planner.search import microbatches_for

    for mesh in (dict(pp=2, schedule="interleaved_1f1b", virtual_stages=2,
                 microbatches=5), dict(pp=2, schedule="1f1b", virtual_stages=2, microbatches=2)):
        mesh = {"dp": 1, "tp": 1, "pp": 1, "microbatches": 1, **mesh}
        with pytest.raises(ValueError) as planned:
            estimate_mesh(SMALL, ParallelConfig.from_keywords(**mesh), seq_len=64, micro_batch_size=1)
        with pytest.raises(ValueError) as real:
            parallelize_as_launched(meta_model(SMALL), **mesh)
        assert str(planned.value) == str(real.value), mesh
    assert all(microbatches_allowed(schedule=s, stages=pp, microbatches=microbatches_for(pp, None, schedule=s))
               for s in SCHEDULES for pp in (2, 3, 5))
    SMALL.save_pretrained(tmp_path)
    main([str(tmp_path), "--dp", "1", "--tp", "2", "--pp", "2", "--schedule", "interleaved_1f1b", "--virtual-stages",
          "2", "--seq-len", "64"])
    table = capsys.readouterr().out
    assert "interleaved_1f1b x2 virtual stages, 8 microbatches" in table and "bubble of interleaved_1f1b" in table
    assert "| 0 | 0-1, 4-5 | model.embed_tokens |" in table and "| 1 | 2-3, 6-7 | lm_head |" in table
    main([str(tmp_path), "--dp", "1", "--tp", "2", "--pp", "2", "--schedule", "zb_h1", "--seq-len", "64", "--json"])
    out = json.loads(capsys.readouterr().out)
    assert out["schedule"] == "zb_h1" and all(s["weight_stash_bytes_per_microbatch"] > 0 for s in out["stages"])
    main([str(tmp_path), "--gpus", "4", "--schedule", "zb_h1", "--seq-len", "64", "--cp", "1"])
    assert "bubble of zb_h1" in capsys.readouterr().out
