"""Frozen parameters (``requires_grad=False``) at every mesh and schedule: equal to the plain model
with the same parameters frozen, no gradient for them, and nothing of theirs in the dp buckets."""

from __future__ import annotations

import pytest

from tests import cases
from tests.test_parity import check

EMBED_AND_FIRST_HALF = ("model.embed_tokens", "model.layers.0.", "model.layers.1.")
# (kind, dp, tp, pp, schedule, virtual_stages, microbatches, frozen)
FROZEN_CASES = [
    # stage 0 holds nothing that trains, yet stage 1's gradients are right
    ("llama", 2, 2, 2, "1f1b", 1, 2, EMBED_AND_FIRST_HALF),
    # the tied embedding/head frozen on both stages: no tie sum; a frozen block in the middle
    ("gpt2", 1, 2, 2, "1f1b", 1, 2, ("transformer.wte", "transformer.wpe", "transformer.h.2.")),
    # deferred weight passes skip frozen layers; a frozen head on the last stage
    ("llama_deep", 2, 1, 2, "zb_h1", 1, 4, ("model.layers.3.", "model.layers.6.mlp", "lm_head")),
    # chunk 0 frozen, chunk 2 on the same rank trains
    ("llama_deep", 1, 1, 2, "interleaved_1f1b", 2, 2, EMBED_AND_FIRST_HALF),
]


@pytest.mark.parametrize(("kind", "dp", "tp", "pp", "schedule", "virtual_stages", "microbatches", "frozen"),
                         FROZEN_CASES)
def test_frozen_parameters(worlds, model_dirs, tmp_path, kind, dp, tp, pp, schedule, virtual_stages, microbatches,
                           frozen):
    results = worlds.run(dp * tp * pp, cases.parity, kind=kind, model_dir=model_dirs[kind],
                         out_dir=str(tmp_path / "hf"), dp=dp, tp=tp, pp=pp, schedule=schedule,
                         virtual_stages=virtual_stages, microbatches=microbatches, padded=True, bucket_mb=0.01,
                         frozen=frozen)
    check(results, tp=tp)
    assert sum(r["frozen_here"] for r in results) > 0
    for r in results:
        assert r["frozen_with_grad"] == [], r
        if dp > 1:
            assert (r["bucketed"] or 0) == r["trainable"], r  # a stage with nothing to train has no buckets
