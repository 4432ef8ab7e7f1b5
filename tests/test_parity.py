"""The parallel model equals the plain Hugging Face model built from the same weights."""

from __future__ import annotations

import pytest

from tests.shapes import PARITY_CASES

LOSS_RTOL = 1e-5
GRAD_ATOL = 2e-6
WEIGHT_ATOL = 2e-5


@pytest.mark.parametrize(("kind", "dp", "tp", "microbatches", "padded"), PARITY_CASES)
def test_matches_plain_model(worlds, model_dirs, tmp_path, kind, dp, tp, microbatches, padded):
    results = worlds.run(
        dp * tp, "tests.cases:parity", kind=kind, model_dir=model_dirs[kind], out_dir=str(tmp_path / "hf"),
        dp=dp, tp=tp, microbatches=microbatches, padded=padded,
    )
    losses = {r["loss"] for r in results}
    assert len(losses) == 1, f"ranks disagree on the loss: {losses}"
    for r in results:
        assert abs(r["loss"] - r["ref_loss"]) <= LOSS_RTOL * abs(r["ref_loss"]), r
        assert r["logit_err"] < 1e-5, r
        assert r["grad_err"] < GRAD_ATOL, r
        assert abs(r["norm"] - r["ref_norm"]) <= 1e-5 * r["ref_norm"], r
        assert r["weight_err"] < WEIGHT_ATOL < r["weight_moved"], r
        # a rank holds 1/tp of every sharded tensor (up to vocabulary padding and replicated KV heads)
        assert r["local_sharded"] * tp >= r["full_sharded"], r
        assert r["local_sharded"] * tp <= r["full_sharded"] * 1.6, r
