"""Golden losses: the exact losses of a few steps for each case of tests/golden_cases.py (dp, dp_shard,
tp with sequence parallelism, each pipeline schedule, cp, ep), kept as hex floats in
tests/golden_losses.json. Every tolerance elsewhere in the suite would let a change that moves every loss by
one ulp pass; this test does not: on the environment the losses were recorded in (torch, transformers, the
CPU's vector unit) they must be bit-identical. Elsewhere float kernels may round differently, so the test
holds them to 1e-6 relative and says so.

``make golden`` rewrites the file on purpose; the commit that does says why the numbers moved."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from tests import golden_cases
from tests.records import Record

# make test runs them all (issue 65): they hold every dimension's numbers bit for bit
pytestmark = pytest.mark.core

GOLDEN = Path(__file__).with_name("golden_losses.json")
UPDATE = os.environ.get("QN_HF_GOLDEN_UPDATE") == "1"


def _empty() -> dict:
    return {"environment": {}, "steps": 0, "cases": {}}


@pytest.fixture(scope="module")
def record():
    record = Record(GOLDEN, UPDATE, empty=_empty)
    if UPDATE:  # the environment and step count the rewritten losses were taken in
        record.data["environment"], record.data["steps"] = golden_cases.environment(), golden_cases.STEPS
    return record


@pytest.mark.parametrize("name", list(golden_cases.CASES))
def test_losses_equal_the_golden_ones(worlds, model_dirs, record, name):
    kind, _ = golden_cases.CASES[name]
    runs = worlds.run(golden_cases.WORLD, golden_cases.golden_run, name=name, model_dir=model_dirs[kind])
    assert all(r == runs[0] for r in runs), runs  # every rank reports the global loss
    losses = runs[0]
    if UPDATE:
        record.put("cases", name, losses)
        return
    record = record.data
    assert record["steps"] == golden_cases.STEPS, "tests/golden_losses.json is stale: make golden"
    assert name in record["cases"], f"no golden losses for {name}: make golden records them"
    golden = record["cases"][name]
    if record["environment"] == golden_cases.environment():
        assert losses == golden, (f"{name}: losses {[float.fromhex(x) for x in losses]} differ from the golden "
                                  f"{[float.fromhex(x) for x in golden]} bit for bit (make golden, saying why)")
    else:  # other kernels may round differently: close, not bit-equal
        worst = max(abs(float.fromhex(a) - float.fromhex(b)) / abs(float.fromhex(b)) for a, b in zip(losses, golden))
        assert worst < 1e-6, (name, worst, record["environment"], golden_cases.environment())


def test_golden_file_names_every_case_and_only_those():
    if UPDATE:
        pytest.skip("being rewritten")
    data = Record(GOLDEN, update=False, empty=_empty).data
    assert set(data["cases"]) == set(golden_cases.CASES)
    assert all(len(v) == data["steps"] for v in data["cases"].values())
