"""The planner's per-rank memory against a real run: weights, gradients, optimizer state and
activations measured from the tensors themselves (tests/planner_memory_cases.py says how), under
mixed precision, ZeRO-1 and both recompute modes, for GPT-2 and Llama at three meshes each.

Within 5% for weights, gradients and optimizer state, 15% for activations per microbatch; the
communication of the measured step (ZeRO's reduce-scatter and all-gather, recomputation's repeated
tp all-reduces, float16's overflow flag) byte for byte and call for call, as ``CommMeter`` counts it.
"""

from __future__ import annotations

import functools

import pytest

from qn_hf.planner.estimate import Planner
from tests.planner_memory_cases import BUCKET_MB, ROWS, SEQ, config_for

STATE_TOLERANCE = 0.05
ACTIVATION_TOLERANCE = 0.15

RUNS = [  # kind, dp, tp, pp, microbatches, mixed_precision, zero, recompute
    ("gpt2", 2, 1, 1, 1, None, True, None),  # ZeRO without mixed precision: the masters are the weights
    ("gpt2", 1, 2, 2, 2, "bf16", False, "full"),  # embedding tied across stages, vocab padding
    ("gpt2", 2, 2, 1, 1, "bf16", True, "selective"),
    ("llama", 2, 1, 1, 1, "bf16", True, "full"),
    ("llama", 1, 2, 2, 2, None, False, "selective"),
    ("llama", 2, 2, 1, 1, "fp16", True, None),  # loss scaling's overflow flag over the whole job
]


@functools.cache
def planner(kind: str) -> Planner:
    return Planner(config_for(kind), seq_len=SEQ, micro_batch_size=ROWS)


@pytest.mark.parametrize(("kind", "dp", "tp", "pp", "microbatches", "mixed_precision", "zero", "recompute"), RUNS)
def test_planner_memory_matches_a_real_run(worlds, kind, dp, tp, pp, microbatches, mixed_precision, zero, recompute):
    est = planner(kind).estimate(dp=dp, tp=tp, pp=pp, microbatches=microbatches, bucket_mb=BUCKET_MB,
                                 mixed_precision=mixed_precision, zero=zero, recompute=recompute, backend="gloo")
    measured = worlds.run(dp * tp * pp, "tests.planner_memory_cases:measure", kind=kind, dp=dp, tp=tp, pp=pp,
                          microbatches=microbatches, mixed_precision=mixed_precision, zero=zero, recompute=recompute)
    rows = []
    for r in measured:
        stage = est.stages[r["coords"]["pp"]]
        planned = {"weight_bytes": stage.weight_bytes, "grad_bytes": stage.grad_bytes,
                   "optimizer_bytes": stage.optimizer_bytes, "activation_bytes": stage.activation_bytes_per_microbatch}
        rows.append((r["coords"], {k: (r[k], v) for k, v in planned.items()}))
    table = "\n".join(f"{c}: " + ", ".join(f"{k} measured {m:,} planned {p:,}" for k, (m, p) in v.items())
                      for c, v in rows)
    for coords, values in rows:
        for what, (real, planned) in values.items():
            tolerance = ACTIVATION_TOLERANCE if what == "activation_bytes" else STATE_TOLERANCE
            assert abs(planned - real) <= tolerance * real, f"{coords} {what}\n{table}"
    for r in measured:
        stage = est.stages[r["coords"]["pp"]]
        assert stage.params == r["params"], (r["coords"], stage.params, r["params"])
        predicted = {g: [t.calls, t.nbytes] for g, t in stage.comm.items()}
        assert predicted == r["comm"], (r["coords"], predicted, r["comm_ops"])
