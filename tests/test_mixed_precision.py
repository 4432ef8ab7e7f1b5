"""Mixed precision: low-precision compute, float32 gradients, float32 master weights and moments."""

from __future__ import annotations

import pytest

from qn_hf.config.features import Feature
from tests import optim_cases

MIXED_CASES = [  # kind, dp, tp, pp, microbatches, zero, precision, schedule
    ("llama", 1, 1, 1, 1, False, "bf16", "1f1b"),
    ("gpt2", 2, 2, 2, 2, True, "bf16", "1f1b"),  # tied embedding across stages
    ("llama", 2, 2, 1, 2, True, "fp16", "1f1b"),
    ("gpt2", 1, 2, 2, 2, False, "bf16", "gpipe"),
    ("llama", 2, 1, 2, 2, True, "bf16", "zb_h1"),  # float32 gradients delivered by the weight passes
    ("gpt2", 1, 2, 2, 2, False, "bf16", "interleaved_1f1b"),
    # float16 (loss scaling, the skip of a step with an overflow) through each schedule: the composition
    # table's fp16 x pp rows; `long`, as more of what the rows above cover (make test-all)
    pytest.param("llama", 1, 1, 2, 2, False, "fp16", "1f1b", marks=pytest.mark.long),
    pytest.param("gpt2", 1, 2, 2, 2, False, "fp16", "gpipe", marks=pytest.mark.long),
    pytest.param("llama", 2, 1, 2, 2, True, "fp16", "zb_h1", marks=pytest.mark.long),
    pytest.param("gpt2", 1, 2, 2, 2, False, "fp16", "interleaved_1f1b", marks=pytest.mark.long),
]


@pytest.mark.composes(
    (Feature.TP, Feature.BF16), (Feature.PP_GPIPE, Feature.BF16), case="gpt2-1-2-2-2-False-bf16-gpipe")
@pytest.mark.composes((Feature.PP_INTERLEAVED, Feature.BF16), case="gpt2-1-2-2-2-False-bf16-interleaved_1f1b")
@pytest.mark.composes((Feature.PP_GPIPE, Feature.FP16), case="gpt2-1-2-2-2-False-fp16-gpipe")
@pytest.mark.composes((Feature.PP_INTERLEAVED, Feature.FP16), case="gpt2-1-2-2-2-False-fp16-interleaved_1f1b")
@pytest.mark.composes(
    (Feature.PP_1F1B, Feature.ZERO), (Feature.PP_1F1B, Feature.BF16), (Feature.DP, Feature.BF16),
    (Feature.ZERO, Feature.BF16), case="gpt2-2-2-2-2-True-bf16-1f1b")
@pytest.mark.composes((Feature.PP_1F1B, Feature.FP16), case="llama-1-1-2-2-False-fp16-1f1b")
@pytest.mark.composes((Feature.PP_ZB_H1, Feature.BF16), case="llama-2-1-2-2-True-bf16-zb_h1")
@pytest.mark.composes((Feature.PP_ZB_H1, Feature.FP16), case="llama-2-1-2-2-True-fp16-zb_h1")
@pytest.mark.composes(
    (Feature.TP, Feature.FP16), (Feature.DP, Feature.FP16), (Feature.ZERO, Feature.FP16),
    case="llama-2-2-1-2-True-fp16-1f1b")
@pytest.mark.parametrize(("kind", "dp", "tp", "pp", "microbatches", "zero", "precision", "schedule"), MIXED_CASES)
def test_mixed_precision_trains_like_the_plain_model_by_hand(worlds, model_dirs, kind, dp, tp, pp, microbatches, zero,
                                                             precision, schedule):
    """Against the plain model run the way mixed precision promises (weights cast for compute,
    float32 gradients, float32 masters): the same losses and masters up to low-precision rounding,
    which differs with the mesh (sums split over tp and microbatches round differently)."""
    results = worlds.run(dp * tp * pp, optim_cases.mixed_parity, kind=kind, model_dir=model_dirs[kind], dp=dp,
                         tp=tp, pp=pp, microbatches=microbatches, zero=zero, precision=precision, schedule=schedule)
    check_mixed(results, precision)


COMPOSED_CASES = [  # kind, dp, tp, pp, zero, precision, recompute, sequence_parallel: the composition table's rows
    ("llama", 2, 2, 1, True, "bf16", None, True),  # sp x bf16, sp x ZeRO
    ("llama", 1, 2, 1, False, "fp16", None, True),  # sp x fp16
    ("llama", 2, 1, 1, True, "fp16", "full", False),  # fp16 x recompute, ZeRO x recompute
    ("gpt2", 1, 2, 2, False, "bf16", "selective", False),  # bf16 x recompute
]
CP_CASES = [("llama", 1, 1, 1, True, "bf16", None, False), ("llama", 1, 1, 1, True, "fp16", None, False)]  # cp=2


@pytest.mark.composes((Feature.BF16, Feature.RECOMPUTE), case="gpt2-1-2-2-False-bf16-selective-False-1")
@pytest.mark.composes((Feature.CP, Feature.ZERO), (Feature.CP, Feature.BF16), case="llama-1-1-1-True-bf16-None-False-2")
@pytest.mark.composes((Feature.CP, Feature.FP16), case="llama-1-1-1-True-fp16-None-False-2")
@pytest.mark.composes((Feature.SP, Feature.FP16), case="llama-1-2-1-False-fp16-None-True-1")
@pytest.mark.composes(
    (Feature.ZERO, Feature.RECOMPUTE), (Feature.FP16, Feature.RECOMPUTE), case="llama-2-1-1-True-fp16-full-False-1")
@pytest.mark.composes((Feature.SP, Feature.ZERO), (Feature.SP, Feature.BF16), case="llama-2-2-1-True-bf16-None-True-1")
@pytest.mark.long
@pytest.mark.parametrize(("kind", "dp", "tp", "pp", "zero", "precision", "recompute", "sp", "cp"),
                         [(*c, 1) for c in COMPOSED_CASES] + [(*c, 2) for c in CP_CASES])
def test_mixed_precision_composes_with_sequence_parallelism_and_recomputation(worlds, model_dirs, kind, dp, tp, pp,
                                                                               zero, precision, recompute, sp, cp):
    """The same comparison with sequence parallelism, recomputation or context parallelism on (two
    microbatches; ZeRO at cp=2 shards over the dp x cp ranks that hold the same weights)."""
    results = worlds.run(dp * tp * pp * cp, optim_cases.mixed_parity, kind=kind, model_dir=model_dirs[kind], dp=dp,
                         tp=tp, pp=pp, microbatches=2, zero=zero, precision=precision, recompute=recompute,
                         sequence_parallel=sp, cp=cp)
    check_mixed(results, precision)


def check_mixed(results: list[dict], precision: str) -> None:
    low = {"bf16": "torch.bfloat16", "fp16": "torch.float16"}[precision]
    for r in results:
        assert r["param_dtypes"] == [low], r
        assert r["grad_dtypes"] == r["master_dtypes"] == r["state_dtypes"] == ["torch.float32"], r
        assert r["params_are_masters"], r  # every weight is its master rounded
        for loss, ref in zip(r["losses"], r["ref_losses"]):
            assert abs(loss - ref) <= 1e-4 * ref, r
        assert r["master_err"] <= 0.02 * r["moved"], r
        assert r["skipped"] == 0, r


@pytest.mark.parametrize("dp", [1, 2])
def test_fp16_overflow_skips_the_step_everywhere(worlds, model_dirs, dp):
    for r in worlds.run(dp, optim_cases.fp16_overflow, kind="llama", model_dir=model_dirs["llama"], dp=dp):
        assert r["unchanged"] and r["skipped"] == 1 and r["scale"] == 2.0**39, r
        assert r["moved"] and r["skipped_after"] == 1, r
