"""Activation recomputation changes nothing: with dropout on, bit for bit the run without it."""

from __future__ import annotations

import pytest

RECOMPUTE_CASES = [  # kind, dp, tp, pp, mode, sequence_parallel, cp
    ("gpt2", 1, 2, 1, "full", False, 1),  # tp-local attention dropout and shared residual dropout
    ("gpt2", 1, 2, 1, "selective", False, 1),
    ("llama", 1, 2, 2, "selective", False, 1),
    ("gpt2", 2, 1, 2, "full", False, 1),
    ("vit", 1, 2, 1, "selective", False, 1),
    ("gpt2", 1, 2, 1, "full", True, 1),  # dropout on the sequence slices: tp-local stream, replayed
    ("gpt2", 1, 2, 2, "selective", True, 1),
    ("llama", 1, 1, 1, "selective", False, 2),  # ring attention recomputed (its ring transfers too)
    ("llama", 1, 1, 1, "full", False, 2),
]


@pytest.mark.parametrize(("kind", "dp", "tp", "pp", "mode", "sp", "cp"), RECOMPUTE_CASES)
def test_recompute_is_bit_for_bit(worlds, model_dirs, kind, dp, tp, pp, mode, sp, cp):
    results = worlds.run(dp * tp * pp * cp, "tests.optim_cases:recompute_parity", kind=kind, model_dir=model_dirs[kind],
                         dp=dp, tp=tp, pp=pp, microbatches=2, mode=mode, sequence_parallel=sp, cp=cp)
    for r in results:
        assert r["losses"] == r["ref_losses"], r
        assert r["grads_equal"] and r["weights_equal"], r


@pytest.mark.parametrize(("kind", "tp", "schedule", "virtual_stages", "mode"), [
    ("gpt2_deep", 1, "interleaved_1f1b", 2, "full"),
    ("llama_deep", 2, "interleaved_1f1b", 2, "selective"),
    ("gpt2_deep", 1, "zb_h1", 1, "full"),  # the weight passes read the inputs the recomputation saved
    ("llama_deep", 2, "zb_h1", 1, "selective"),
])
def test_recompute_with_new_schedules(worlds, model_dirs, kind, tp, schedule, virtual_stages, mode):
    results = worlds.run(2 * tp, "tests.optim_cases:recompute_parity", kind=kind, model_dir=model_dirs[kind],
                         dp=1, tp=tp, pp=2, microbatches=2, mode=mode, schedule=schedule,
                         virtual_stages=virtual_stages)
    for r in results:
        assert r["losses"] == r["ref_losses"], r
        assert r["grads_equal"] and r["weights_equal"], r
