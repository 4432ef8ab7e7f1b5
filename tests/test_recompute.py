"""Activation recomputation changes nothing: with dropout on, bit for bit the run without it."""

from __future__ import annotations

import pytest

RECOMPUTE_CASES = [  # kind, dp, tp, pp, mode
    ("gpt2", 1, 2, 1, "full"),  # tp-local attention dropout and shared residual dropout
    ("gpt2", 1, 2, 1, "selective"),
    ("llama", 1, 2, 2, "selective"),
    ("gpt2", 2, 1, 2, "full"),
    ("vit", 1, 2, 1, "selective"),
]


@pytest.mark.parametrize(("kind", "dp", "tp", "pp", "mode"), RECOMPUTE_CASES)
def test_recompute_is_bit_for_bit(worlds, model_dirs, kind, dp, tp, pp, mode):
    results = worlds.run(dp * tp * pp, "tests.optim_cases:recompute_parity", kind=kind, model_dir=model_dirs[kind],
                         dp=dp, tp=tp, pp=pp, microbatches=2, mode=mode)
    for r in results:
        assert r["losses"] == r["ref_losses"], r
        assert r["grads_equal"] and r["weights_equal"], r
