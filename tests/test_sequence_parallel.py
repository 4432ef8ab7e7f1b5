"""Sequence parallelism (Megatron-SP) equals the plain model; what it cannot take is refused."""

from __future__ import annotations

import pytest

from tests.test_parity import check
from tests import cases

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


@pytest.mark.parametrize(("kind", "dp", "tp", "pp", "microbatches", "padded"), SP_CASES)
def test_sequence_parallel_equals_plain_model(worlds, model_dirs, tmp_path, kind, dp, tp, pp, microbatches, padded):
    results = worlds.run(
        dp * tp * pp, cases.parity, kind=kind, model_dir=model_dirs[kind], out_dir=str(tmp_path / "hf"),
        dp=dp, tp=tp, pp=pp, microbatches=microbatches, padded=padded, sequence_parallel=True,
    )
    check(results, tp=tp)


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
    from qn_hf.config.validate import check_parallel_config

    try:
        check_parallel_config(model, dp=1, microbatches=1, schedule="1f1b", **{"tp": 2, "pp": 1, **kwargs})
    except ValueError as e:
        return str(e)
    return "no error"


def test_sequence_parallel_needs_tp():
    assert "sequence_parallel=True needs tp > 1" in _error(_meta_model("llama"), tp=1, sequence_parallel=True)
    assert "must be True or False" in _error(_meta_model("llama"), sequence_parallel="yes")


def test_sequence_parallel_refuses_what_might_mix_positions():
    # an MoE block whose only tp rules are its experts' runs on the slice, its experts gathering the
    # rows (the zoo's sp column checks it against the plain model); one whose shared expert has tp
    # rules of its own is no such block, and its experts are in no entry
    moe = _error(_meta_model("qwen3_moe", moe_intermediate_size=16, num_experts=4, num_experts_per_tok=2),
                 sequence_parallel=True)
    assert moe == "no error", moe
    shared = _error(_meta_model("deepseek_v3", moe_intermediate_size=16, n_routed_experts=4, num_experts_per_tok=2,
                                n_group=1, topk_group=1, first_k_dense_replace=0), sequence_parallel=True)
    assert "sequence_parallel=True (deepseek_v3)" in shared and "experts" in shared, shared
    # a block module that is neither a tp entry nor a norm or dropout (a convolution over positions)
    import torch

    llama = _meta_model("llama")
    with torch.device("meta"):
        llama.model.layers[1].short_conv = torch.nn.Conv1d(32, 32, 3, padding=1)
    message = _error(llama, sequence_parallel=True)
    assert "model.layers.1.short_conv (Conv1d)" in message and "might mix positions" in message, message
    assert _error(_meta_model("llama"), sequence_parallel=True) == "no error"


def test_sequence_length_must_divide_by_tp():
    import torch

    from qn_hf.step.batch import check_model_inputs

    model = _meta_model("llama")
    batch = {"input_ids": torch.zeros(2, 13, dtype=torch.long), "labels": torch.zeros(2, 13, dtype=torch.long)}
    with pytest.raises(ValueError, match=r"sequence length 13 is not a multiple of 2 \(sequence_parallel"):
        check_model_inputs(batch, model=model, loss="causal_lm", sequence_split=(2, "sequence_parallel=True splits it over tp=2"))
    check_model_inputs(batch, model=model, loss="causal_lm")


def test_sequence_parallel_with_zero_bubble_equals_plain_model(worlds, model_dirs, tmp_path):
    """The composition table's sp x zb_h1 row: tp=2 x pp=2, padded rows. A deferred weight pass of a
    column-parallel linear reads the input sequence parallelism gathered for its forward."""
    results = worlds.run(4, cases.parity, kind="llama", model_dir=model_dirs["llama"], out_dir=str(tmp_path / "hf"),
                         dp=1, tp=2, pp=2, microbatches=2, padded=True, sequence_parallel=True, schedule="zb_h1")
    check(results, tp=2)
