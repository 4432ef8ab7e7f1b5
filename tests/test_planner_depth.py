"""The planner's traces from three blocks (planner/depth.py): the shortened forward laid out as the whole
model's equals the whole forward's recording field by field and in order, for dense and MoE blocks, with
recomputation, ring attention's and ep's stand-ins; where the blocks differ, the check says so (and the
planner then records in full)."""

from __future__ import annotations

import pytest
from transformers import Gemma3TextConfig, LlamaConfig, MixtralConfig, Qwen3MoeConfig

from qn_hf.checkpoint.layout import meta_model
from qn_hf.config.parallel_config import ParallelConfig
from qn_hf.context_parallel.costs import cp_inputs
from qn_hf.planner import depth
from qn_hf.planner.auto import auto_plan
from qn_hf.planner.depth import expand, same_recording, shortened_recording
from qn_hf.planner.trace import example_inputs, record_microbatch
from qn_hf.validation.checks import check_parallel_config

_LLAMA = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=8, num_attention_heads=4, num_key_value_heads=2,
              vocab_size=256)
_MOE = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=7, num_attention_heads=4, num_key_value_heads=2,
            vocab_size=256)


def _recordings(config, *, recompute=None, cp=1, ep=1, tp=2):
    model = meta_model(config)
    checked = check_parallel_config(model, ParallelConfig.from_keywords(tp=tp, dp=max(ep // tp, 1), ep=ep))
    layers = checked.stage_plan.layers
    inputs = (cp_inputs(micro_batch_size=2, seq_len=64, cp=cp) if cp > 1
              else example_inputs(model, micro_batch_size=2, seq_len=64))

    def record(m):
        return record_microbatch(m, checked.tp_plan, layers=layers, inputs=inputs, recompute=recompute, cp=cp, ep=ep)

    return shortened_recording(model, layers, record), record(model), layers


@pytest.mark.parametrize("case", ["plain", "full", "selective", "cp2"])
def test_three_blocks_record_the_whole_dense_forward(case):
    recompute = case if case in ("full", "selective") else None
    short, whole, layers = _recordings(LlamaConfig(**_LLAMA), recompute=recompute, cp=2 if case == "cp2" else 1)
    assert short is not None and [n for n in whole.io if n.rpartition(".")[0] == layers] == [
        f"{layers}.{i}" for i in range(8)]
    assert same_recording(short, whole)


def test_three_blocks_record_the_whole_moe_forward_under_ep():
    config = MixtralConfig(**_MOE, num_local_experts=4, num_experts_per_tok=2)
    short, whole, _ = _recordings(config, ep=2, tp=1)
    assert len(whole.experts) == 7 and same_recording(short, whole)


@pytest.mark.parametrize("config", [
    Qwen3MoeConfig(**_MOE, moe_intermediate_size=32, num_experts=4, num_experts_per_tok=2, mlp_only_layers=[3],
                   head_dim=16),
    Gemma3TextConfig(**_LLAMA, head_dim=16, sliding_window=16,
                     layer_types=["sliding_attention"] * 4 + ["full_attention"] + ["sliding_attention"] * 3),
], ids=["a dense layer among MoE layers", "one global layer among sliding ones"])
def test_blocks_that_differ_are_told_apart(config):
    short, whole, _ = _recordings(config)
    assert short is None or not same_recording(short, whole)


def test_expand_lays_blocks_out_in_order():
    short, whole, layers = _recordings(LlamaConfig(**{**_LLAMA, "num_hidden_layers": 3}))
    assert short is None  # too few blocks to shorten
    laid = expand(whole, layers=layers, count=6)
    assert [n for n in laid.io if n.rpartition(".")[0] == layers] == [f"{layers}.{i}" for i in range(6)]
    assert laid.done[f"{layers}.4.mlp"][0] == f"{layers}.4"
    period = whole.last_save[f"{layers}.2"] - whole.last_save[f"{layers}.1"]
    assert laid.last_save[f"{layers}.4"] - laid.last_save[f"{layers}.3"] == period
    assert laid.last_save[f"{layers}.5"] == whole.last_save[f"{layers}.2"] + 3 * period


def _ranked(config):
    choice = auto_plan(config, global_batch=8, seq_len=128, world_size=8, device_memory=2**26)
    return [(c.estimate.parallel, c.estimate.micro_batch_size, c.time, c.peak_bytes) for c in choice.feasible]


@pytest.mark.parametrize("config", [
    LlamaConfig(**_LLAMA),
    Qwen3MoeConfig(**_MOE, moe_intermediate_size=32, num_experts=4, num_experts_per_tok=2, mlp_only_layers=[3],
                   head_dim=16),
], ids=["alike blocks", "a block unlike the others"])
def test_auto_ranks_as_from_whole_forwards(config, monkeypatch):
    """Every feasible configuration's time and peak equal the ones from whole forwards (the planner's
    first trace is recorded both ways and compared: where the blocks differ it records every one whole)."""
    shortened = _ranked(config)
    monkeypatch.setattr(depth, "shortened_recording", lambda *args, **kwargs: None)
    assert shortened == _ranked(config)
