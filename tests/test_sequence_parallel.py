"""Sequence parallelism (Megatron-SP) equals the plain model; what it cannot take is refused."""

from __future__ import annotations

import pytest

from qn_hf.config.features import Feature
from tests import cases
from tests.releases import needs_expert_tp_rules, needs_tp_plan, with_tp_plan
from tests.test_parity import check

SP_CASES = [  # kind, dp, tp, pp, microbatches, padded
    ("llama", 1, 2, 1, 1, False),
    ("qwen3", 1, 2, 1, 1, False),
    ("gpt2", 1, 2, 1, 1, False),
    ("llama", 2, 2, 1, 2, True),
    ("qwen3", 2, 2, 1, 1, True),
    ("gpt2", 2, 2, 1, 1, True),
    ("llama", 1, 2, 2, 2, True),
    ("gpt2", 1, 2, 2, 2, False),
]


@pytest.mark.composes((Feature.SP, Feature.PP_INTERLEAVED), case="llama_deep")
@pytest.mark.parametrize("kind", ["llama_deep", "gpt2_deep"])
def test_sequence_parallel_with_interleaved_chunks(worlds, model_dirs, tmp_path, kind):
    """tp=2 x pp=2 x 2 chunks: each chunk takes its slice at its first block and gathers after its
    last (or after the final norm, on the last chunk)."""
    results = worlds.run(
        4, cases.parity, kind=kind, model_dir=model_dirs[kind], out_dir=str(tmp_path / "hf"),
        dp=1, tp=2, pp=2, microbatches=2, padded=True, sequence_parallel=True, schedule="interleaved_1f1b",
        virtual_stages=2,
    )
    check(results, tp=2)


@pytest.mark.composes((Feature.TP, Feature.SP), case="llama-1-2-1-1-False")
@pytest.mark.composes((Feature.SP, Feature.PP_1F1B), case="llama-1-2-2-2-True")
@pytest.mark.composes((Feature.SP, Feature.DP), case="llama-2-2-1-2-True")
@pytest.mark.parametrize(("kind", "dp", "tp", "pp", "microbatches", "padded"), SP_CASES)
def test_sequence_parallel_equals_plain_model(worlds, model_dirs, tmp_path, kind, dp, tp, pp, microbatches, padded):
    results = worlds.run(
        dp * tp * pp, cases.parity, kind=kind, model_dir=model_dirs[kind], out_dir=str(tmp_path / "hf"),
        dp=dp, tp=tp, pp=pp, microbatches=microbatches, padded=padded, sequence_parallel=True,
    )
    check(results, tp=tp)


@pytest.mark.composes((Feature.SP, Feature.PP_GPIPE))
@pytest.mark.long
def test_sequence_parallel_with_gpipe_equals_plain_model(worlds, model_dirs, tmp_path):
    """The composition table's sp x gpipe row: tp=2 x pp=2 with GPipe, padded rows."""
    results = worlds.run(4, cases.parity, kind="gpt2", model_dir=model_dirs["gpt2"], out_dir=str(tmp_path / "hf"),
                         dp=1, tp=2, pp=2, microbatches=2, padded=True, sequence_parallel=True, schedule="gpipe")
    check(results, tp=2)


def _meta_model(model_type: str, **overrides):
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.for_model(model_type, **{**SMALL, **overrides})
    with torch.device("meta"):
        return AutoModelForCausalLM.from_config(config)


SMALL = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
             head_dim=8, vocab_size=97, bos_token_id=1, eos_token_id=2, pad_token_id=0)


def _error(model, **kwargs) -> str:
    from qn_hf.validation.checks import check_parallel_config

    try:
        check_parallel_config(model, dp=1, microbatches=1, schedule="1f1b", **{"tp": 2, "pp": 1, **kwargs})
    except ValueError as e:
        return str(e)
    return "no error"


def test_sequence_parallel_needs_tp():
    assert "sequence_parallel=True needs tp > 1" in _error(_meta_model("llama"), tp=1, sequence_parallel=True)
    assert "must be True or False" in _error(_meta_model("llama"), sequence_parallel="yes")


def _sp_plan(model):
    from qn_hf.validation.checks import check_parallel_config

    return check_parallel_config(model, dp=1, tp=2, pp=1, microbatches=1, schedule="1f1b",
                                 sequence_parallel=True).tp_plan


def test_sequence_parallel_runs_what_may_mix_positions_whole():
    """Block children that are no tp entry, norm or dropout become whole regions (gathered in, cut
    out); an MoE block whose only tp rules are its experts' stays token-wise on the slice."""
    needs_expert_tp_rules("qwen3_moe")
    moe = _sp_plan(_meta_model("qwen3_moe", moe_intermediate_size=16, num_experts=4, num_experts_per_tok=2))
    assert moe.sequence_experts and not any(r.endswith(".mlp") for r in moe.whole_regions), moe.whole_regions
    # DeepSeek-V3: MLA attention (q_a_proj reads the input beside the columns) and an MoE block with a
    # tp-split shared expert are whole regions; the first dense layer's MLP is an entry of its own
    deepseek = _sp_plan(_meta_model("deepseek_v3", moe_intermediate_size=16, n_routed_experts=4, num_experts_per_tok=2,
                                    n_group=1, topk_group=1, first_k_dense_replace=1))
    assert deepseek.whole_regions == ("model.layers.0.self_attn", "model.layers.1.self_attn", "model.layers.1.mlp")
    assert "model.layers.0.mlp" in deepseek.tp_entries
    assert "model.layers.1.mlp.shared_experts" not in deepseek.tp_entries  # a plain tp entry inside its region
    # nothing in a whole region is summed over tp: its activations and gradients are whole there
    assert not [n for n in deepseek.grad_sum if n.startswith(deepseek.whole_regions)], deepseek.grad_sum
    import torch

    llama = _meta_model("llama")
    with torch.device("meta"):
        llama.model.layers[1].short_conv = torch.nn.Conv1d(32, 32, 3, padding=1)
    assert "model.layers.1.short_conv" in _sp_plan(llama).whole_regions
    assert not _sp_plan(_meta_model("llama")).whole_regions


def test_sequence_parallel_refuses_block_inputs_it_cannot_place():
    """A block input beside the hidden states that is neither known to be whole for every block nor
    a per-position input it can split (DeepSeek-V4's token ids, which its MoE routes by) is refused
    before anything runs."""
    needs_tp_plan("deepseek_v4")
    message = _error(_meta_model("deepseek_v4", moe_intermediate_size=16, n_routed_experts=4, num_experts_per_tok=2,
                                 q_lora_rank=16, o_lora_rank=16, o_groups=2), sequence_parallel=True)
    assert "DeepseekV4DecoderLayer.forward takes input_ids beside the hidden states" in message, message


# model type, mesh: whole regions composed with pp, dp, cp and recompute; Gemma 4's per-layer
# inputs split at every block; Llama 4's MoE block returning flat token rows; HY-V4's tuples of
# per-position outputs and the hyper-connection head after the blocks
WHOLE_REGION_CASES = [
    ("deepseek_v3", dict(tp=2, pp=2, sequence_parallel=True)),
    ("deepseek_v3", dict(tp=2, sequence_parallel=True, recompute="full")),
    ("minicpm3", dict(dp=2, tp=2, sequence_parallel=True)),
    # transformers before 5.21 plans neither: its sliding-window Granite MoE and Qwen3-Next's
    # convolution-and-recurrence layers stand in
    (with_tp_plan("granitemoe", "granitemoe_swa"), dict(tp=2, cp=2, sequence_parallel=True)),
    (with_tp_plan("jamba", "qwen3_next"), dict(tp=2, sequence_parallel=True)),
    ("gemma4_text", dict(dp=2, tp=2, sequence_parallel=True)),
    ("llama4_text", dict(tp=2, sequence_parallel=True)),
    ("hy_v4", dict(tp=2, sequence_parallel=True)),
]


@pytest.mark.parametrize(("model_type", "mesh"), WHOLE_REGION_CASES, ids=lambda v: v if isinstance(v, str) else
                         "-".join(f"{k}{v}" for k, v in v.items() if k != "sequence_parallel"))
def test_whole_regions_equal_plain_model(worlds, model_type, mesh):
    from qn_hf.check.zoo import ZooMesh
    from tests import zoo_cases
    from tests.test_zoo import _config

    column = ZooMesh(**mesh)
    verdict = worlds.run(column.size, zoo_cases.zoo_step, config=_config(model_type), mesh=column)[0]
    assert verdict["verdict"] == "equal", (verdict["reason"], verdict["worst"][:5])
    assert verdict["moved"] > 1e-3


def test_sequence_length_must_divide_by_tp():
    import torch

    from qn_hf.step.batch import check_model_inputs

    model = _meta_model("llama")
    batch = {"input_ids": torch.zeros(2, 13, dtype=torch.long), "labels": torch.zeros(2, 13, dtype=torch.long)}
    with pytest.raises(ValueError, match=r"sequence length 13 is not a multiple of 2 \(sequence_parallel"):
        check_model_inputs(batch, model=model, loss="causal_lm", sequence_split=(2, "sequence_parallel=True splits it over tp=2"))
    check_model_inputs(batch, model=model, loss="causal_lm")


# a deferred W of a column layer reads the input sp gathered for its forward (held from B to W)
@pytest.mark.composes((Feature.PP_ZB_H1, Feature.SP))
def test_sequence_parallel_with_zero_bubble_equals_plain_model(worlds, model_dirs, tmp_path):
    """The composition table's sp x zb_h1 row: tp=2 x pp=2, padded rows. A deferred weight pass of a
    column-parallel linear reads the input sequence parallelism gathered for its forward."""
    results = worlds.run(4, cases.parity, kind="llama", model_dir=model_dirs["llama"], out_dir=str(tmp_path / "hf"),
                         dp=1, tp=2, pp=2, microbatches=2, padded=True, sequence_parallel=True, schedule="zb_h1")
    check(results, tp=2)
