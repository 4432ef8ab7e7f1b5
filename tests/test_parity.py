"""The parallel model equals the plain Hugging Face model built from the same weights."""

from __future__ import annotations

import pytest

from qn_hf.config.features import Feature
from tests import cases
from tests.shapes import DATA_PARALLEL_CASES, PARITY_CASES, PIPELINE_CASES, SCHEDULE_CASES, SCHEDULE_CASES_LONG

LOSS_RTOL = 1e-5
GRAD_ATOL = 2e-6
WEIGHT_ATOL = 2e-5


def check(results: list[dict], *, tp: int, grad_atol: float = GRAD_ATOL) -> None:
    losses = {r["loss"] for r in results}
    assert len(losses) == 1, f"ranks disagree on the loss: {losses}"
    for r in results:
        assert abs(r["loss"] - r["ref_loss"]) <= LOSS_RTOL * abs(r["ref_loss"]), r
        assert abs(r["eval_loss"] - r["ref_eval_loss"]) <= LOSS_RTOL * abs(r["ref_eval_loss"]), r
        assert r["logit_err"] < 1e-5, r
        assert r["grad_err"] < grad_atol, r
        assert abs(r["norm"] - r["ref_norm"]) <= 1e-5 * r["ref_norm"], r
        assert r["weight_err"] < WEIGHT_ATOL < r["weight_moved"], r
        # a rank holds 1/tp of every sharded tensor (up to vocabulary padding and replicated KV heads)
        assert r["local_sharded"] * tp >= r["full_sharded"], r
        assert r["local_sharded"] * tp <= r["full_sharded"] * 1.6, r


@pytest.mark.composes((Feature.TP, Feature.DP), case="llama-2-2-1-False")
@pytest.mark.parametrize(("kind", "dp", "tp", "microbatches", "padded"), PARITY_CASES)
def test_tensor_and_data_parallel(worlds, model_dirs, tmp_path, kind, dp, tp, microbatches, padded):
    results = worlds.run(
        dp * tp, cases.parity, kind=kind, model_dir=model_dirs[kind], out_dir=str(tmp_path / "hf"),
        dp=dp, tp=tp, microbatches=microbatches, padded=padded,
    )
    check(results, tp=tp)


@pytest.mark.composes((Feature.TP, Feature.PP_GPIPE), case="gpt2-1-2-2-gpipe-3-None")
@pytest.mark.composes((Feature.TP, Feature.PP_1F1B), case="llama-1-2-2-1f1b-2-None")
@pytest.mark.parametrize(("kind", "dp", "tp", "pp", "schedule", "microbatches", "layers_per_stage"), PIPELINE_CASES)
def test_pipeline(worlds, model_dirs, tmp_path, kind, dp, tp, pp, schedule, microbatches, layers_per_stage):
    results = worlds.run(
        dp * tp * pp, cases.parity, kind=kind, model_dir=model_dirs[kind], out_dir=str(tmp_path / "hf"),
        dp=dp, tp=tp, pp=pp, schedule=schedule, microbatches=microbatches, layers_per_stage=layers_per_stage,
        padded=kind != "vit",
    )
    check(results, tp=tp)


@pytest.mark.composes((Feature.PP_GPIPE, Feature.DP), case="gpt2-2-1-2-gpipe-2")
@pytest.mark.composes((Feature.PP_1F1B, Feature.DP), case="gpt2-4-1-2-1f1b-3")
@pytest.mark.parametrize(("kind", "dp", "tp", "pp", "schedule", "microbatches"), DATA_PARALLEL_CASES)
def test_data_parallel_3d(worlds, model_dirs, tmp_path, kind, dp, tp, pp, schedule, microbatches):
    results = worlds.run(
        dp * tp * pp, cases.parity, kind=kind, model_dir=model_dirs[kind], out_dir=str(tmp_path / "hf"),
        dp=dp, tp=tp, pp=pp, schedule=schedule, microbatches=microbatches, padded=kind != "vit",
        bucket_mb=0.01,  # several buckets even for tiny models
    )
    check(results, tp=tp)


@pytest.mark.composes((Feature.TP, Feature.PP_INTERLEAVED), case="gpt2_deep-1-2-2-interleaved_1f1b-2-4-None-None")
@pytest.mark.composes((Feature.TP, Feature.PP_ZB_H1), case="gpt2_deep-1-2-2-zb_h1-1-4-None-None")
@pytest.mark.composes((Feature.PP_INTERLEAVED, Feature.DP), case="gpt2_deep-2-1-2-interleaved_1f1b-2-4-None-None")
@pytest.mark.composes((Feature.PP_ZB_H1, Feature.DP), case="llama_deep-2-1-2-zb_h1-1-4-None-None")
@pytest.mark.parametrize(("kind", "dp", "tp", "pp", "schedule", "virtual_stages", "microbatches", "layers_per_stage",
                          "rows"), SCHEDULE_CASES + [pytest.param(*c, marks=pytest.mark.long) for c in SCHEDULE_CASES_LONG])
def test_schedules(worlds, model_dirs, tmp_path, kind, dp, tp, pp, schedule, virtual_stages, microbatches,
                   layers_per_stage, rows):
    """Interleaved 1F1B, ZB-H1 and microbatches of different sizes (``tensor_split``)."""
    results = worlds.run(
        dp * tp * pp, cases.parity, kind=kind, model_dir=model_dirs[kind], out_dir=str(tmp_path / "hf"),
        dp=dp, tp=tp, pp=pp, schedule=schedule, virtual_stages=virtual_stages, microbatches=microbatches,
        layers_per_stage=layers_per_stage, rows=rows, padded=True, bucket_mb=0.01,
    )
    check(results, tp=tp)


def test_loss_fn_with_microbatches_and_dp_batches_of_different_sizes(worlds, model_dirs):
    """dp rank 0 holds 3 examples (microbatches of 2 and 1), rank 1 holds 2 (1 and 1): each
    microbatch's mean is weighted by its rows over the 5, as the plain model's mean is."""
    for r in worlds.run(4, cases.uneven_loss_fn, model_dir=model_dirs["llama"], dp=2, pp=2,
                        microbatches=2, rows=[3, 2]):
        assert abs(r["loss"] - r["ref_loss"]) <= LOSS_RTOL * abs(r["ref_loss"]), r
        assert r["grad_err"] < GRAD_ATOL, r
