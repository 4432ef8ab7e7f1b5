"""Three dimensions and more at once, as large runs combine them (issue 34's triples): each equal to
the plain model (or, under bf16, to the same run without the sharding under test), with full and
selective recomputation, and checkpoints saved at one such mesh resumed at another.

dp x tp(sp) x pp(interleaved) x cp runs here at dp=1 (8 ranks; dp adds nothing the pairs do not
test: its buckets sum over dp x cp, as test_context_parallel's dp=2 run)."""

from __future__ import annotations

import pytest

from tests import cases, ep_cases
from tests.test_expert_parallel import BF16_WEIGHT_ATOL, LOSS_RTOL, WEIGHT_ATOL, assert_resumes_like, check_experts
from tests.test_parity import check

# without recomputation in make test; both recompute modes under make test-all (the long marker)
RECOMPUTE = [None, pytest.param("full", marks=pytest.mark.long), pytest.param("selective", marks=pytest.mark.long)]


@pytest.mark.parametrize("recompute", RECOMPUTE)
def test_tp_sp_pp_interleaved_cp_equals_plain_model(worlds, model_dirs, tmp_path, recompute):
    """tp=2 with sequence parallelism x pp=2 (interleaved, 2 chunks per rank) x cp=2: ring attention
    inside each chunk on the part sp gathered, vocab and heads over tp, padded rows."""
    results = worlds.run(8, cases.parity, kind="llama", model_dir=model_dirs["llama"], out_dir=str(tmp_path / "hf"),
                         dp=1, tp=2, pp=2, cp=2, microbatches=2, schedule="interleaved_1f1b", virtual_stages=2,
                         padded=True, seq=16, recompute=recompute, sequence_parallel=True)
    check(results, tp=2)


@pytest.mark.parametrize("recompute", RECOMPUTE)
def test_dp_pp_zero_bubble_ep_zero_equals_plain_model(worlds, recompute):
    """dp=2 x pp=2 (zb_h1) x ep=2 with ZeRO-1: two AdamW steps with clipping equal the plain model."""
    for r in worlds.run(4, ep_cases.ep_zero_parity, model_type="qwen3_moe", dp=2, tp=1, pp=2, ep=2,
                        schedule="zb_h1", recompute=recompute):
        _check_steps(r, weight_atol=WEIGHT_ATOL)


@pytest.mark.long
@pytest.mark.parametrize("schedule", ["zb_h1", "interleaved_1f1b"])
def test_dp_pp_ep_zero_bf16_equals_the_unsharded_optimizer(worlds, schedule):
    """dp=2 x pp=2 x ep=2 with ZeRO-1 and bf16 (float32 masters), full recomputation: equal to the
    same mesh without ZeRO: losses bit for bit, weights within one bf16 step (BF16_WEIGHT_ATOL)."""
    virtual = 2 if schedule == "interleaved_1f1b" else 1
    for r in worlds.run(4, ep_cases.ep_zero_parity, model_type="qwen3_moe", dp=2, tp=1, pp=2, ep=2, precision="bf16",
                        schedule=schedule, virtual_stages=virtual, recompute="full"):
        _check_steps(r, weight_atol=BF16_WEIGHT_ATOL)
        assert r["losses"] == r["ref_losses"], r


@pytest.mark.parametrize("recompute", RECOMPUTE)
def test_dp_tp_ep_cp_equals_plain_model(worlds, tmp_path, recompute):
    """dp=2 x tp=2 x cp=2 with experts over ep=2 (DeepSeek-V3's routing, its shared expert over tp)."""
    results = worlds.run(8, ep_cases.ep_parity, model_type="deepseek_v3", out_dir=str(tmp_path / "hf"), dp=2, tp=2,
                         pp=1, ep=2, cp=2, recompute=recompute)
    check_experts(results, ep=2)


def test_composed_checkpoint_moves_between_meshes(worlds, tmp_path):
    """Saved at dp=2 x pp=2 (interleaved) x ep=2 with ZeRO-1, resumed at dp=2 x tp=2 x ep=2 with ZeRO-1
    and at one rank with torch's AdamW: each next step equals the uninterrupted run."""
    from qn_hf.check.run import build

    model_dir = str(tmp_path / "model")
    config = ep_cases.moe_config("qwen3_moe")
    build(config, seed=0).save_pretrained(model_dir)
    ckpt, plain = str(tmp_path / "ckpt"), str(tmp_path / "uninterrupted")
    expected = worlds.run(4, ep_cases.ep_checkpoint_run, model_dir=model_dir, dp=2, tp=1, pp=2, ep=2, load=None,
                          steps=[1, 2, 3], save=ckpt, export=plain, zero=True, schedule="interleaved_1f1b",
                          virtual_stages=2)[0]
    for mesh, zero in [((2, 2, 1, 2), True), ((1, 1, 1, 1), None)]:
        assert_resumes_like(worlds, tmp_path, config, model_dir=model_dir, plain=plain, expected=expected, mesh=mesh,
                            source=ckpt, steps=[2, 3], zero=zero)


def _check_steps(r: dict, *, weight_atol: float) -> None:
    for loss, ref in zip(r["losses"], r["ref_losses"]):
        assert abs(loss - ref) <= LOSS_RTOL * abs(ref), r
    for norm, ref in zip(r["norms"], r["ref_norms"]):
        assert abs(norm - ref) <= 1e-5 * ref, r
    assert r["weight_err"] <= weight_atol, r
