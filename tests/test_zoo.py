"""The model zoo: every causal-LM architecture transformers ships a tp plan for, shrunk to a tiny
random model of its own config class, trains one step at tp=2 and pp=2 (tp=2 x pp=2 for a few)
equal to the plain model, or is refused with its reason. Never silently different. ``make test``
runs every type at tp=2 and a few at pp=2; the rest is long.

The expected outcome of every model type at every mesh is data (``tests/zoo_expected.json``); the
table in docs/zoo-table.md is rendered from it. ``make zoo-table`` reruns the zoo and rewrites both from the
results (QN_HF_ZOO_UPDATE=1), so a change in what trains equal shows up in review.

The expectations are those of the transformers release the test extra pins. On another supported
release the zoo is that release's: a recorded type it lacks or plans no tp for is skipped (saying
so), and every other type still trains equal or is refused, never different; which of the two, and
why, is compared with the record on the pinned release only (architectures change between releases).
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from qn_hf.check.zoo import meshes_for, render_table, replace_table, zoo_model_types
from tests import zoo_cases
from tests.records import Record
from tests.releases import INSTALLED, PINNED, RECORDED_WITH, tp_plan_missing

ROOT = Path(__file__).resolve().parent.parent
EXPECTED_FILE = ROOT / "tests" / "zoo_expected.json"
EXPECTED: dict[str, dict[str, str]] = json.loads(EXPECTED_FILE.read_text())
UPDATE = os.environ.get("QN_HF_ZOO_UPDATE") == "1"
INSTALLED_ZOO = set(zoo_model_types())
# a recorded type the installed transformers lacks or plans no tp for: its recorded columns, skipped
ABSENT = {model_type: tp_plan_missing(model_type) or f"transformers {INSTALLED} has no causal-LM class for it"
          for model_type in EXPECTED if model_type not in INSTALLED_ZOO}


def _case(model_type: str, name: str, in_suite: bool):
    marks = [pytest.mark.core] if in_suite else [pytest.mark.long]
    if model_type in ABSENT:
        marks.append(pytest.mark.skip(reason=ABSENT[model_type]))
    return pytest.param(model_type, name, marks=marks)


# make test: SUITE_FEW, three of the types ZOO_FEW and SWEEP_FEW name (an MoE type at every column, ep's included;
# fused q|k|v; a sliding window with softcapping), at every column they have; every other type is long (the
# suite's time, issue 65: one plan-reading and cutting code serves every type; the long tier's slices run them
# in turn)
SUITE_FEW = ("qwen3_moe", "phi3", "gemma2")
IN_SUITE = {model_type: set(meshes_for(model_type, sweep=False))
            for model_type in EXPECTED if model_type not in ABSENT and model_type in SUITE_FEW}
# the recorded types, then those of the installed zoo the record lacks (a release's new types, or types whose
# config declares a tp plan since: run and recorded by `make zoo-table`; elsewhere they hold the zoo's rule,
# equal or refused, never different)
CASES = [_case(model_type, name, name in IN_SUITE.get(model_type, ()))
         for model_type in [*EXPECTED, *sorted(INSTALLED_ZOO - set(EXPECTED))]
         for name in (EXPECTED[model_type] if model_type in ABSENT else meshes_for(model_type))]


def _config(model_type: str) -> dict:
    from transformers import CONFIG_MAPPING

    from qn_hf.check.shrink import shrink_config

    return shrink_config(CONFIG_MAPPING[model_type]()).to_dict()


def _render(record: dict) -> None:
    table = ROOT / "docs" / "zoo-table.md"
    table.write_text(replace_table(table.read_text(), render_table(record)))


@pytest.fixture(scope="module")
def observed():
    """The record; under QN_HF_ZOO_UPDATE=1 each outcome is written to it and docs/zoo-table.md at once."""
    if UPDATE and not PINNED:
        pytest.fail(f"zoo_expected.json records the transformers the test extra pins ({RECORDED_WITH}), not the "
                    f"installed {INSTALLED}: raise the pin and install it first")
    return Record(EXPECTED_FILE, UPDATE, render=_render)


@pytest.mark.parametrize(("model_type", "mesh"), CASES)
def test_zoo(worlds, observed, model_type, mesh):
    column = meshes_for(model_type)[mesh]
    verdict = worlds.run(column.size, zoo_cases.zoo_step, config=_config(model_type), mesh=column)[0]
    assert verdict["verdict"] != "different", (verdict["reason"], verdict["worst"][:5])
    assert verdict["verdict"] == "refused" or verdict["moved"] > 1e-3, "the step moved no weight: it proves nothing"
    outcome = "equal" if verdict["verdict"] == "equal" else f"refused: {verdict['reason']}"
    if UPDATE:
        observed.put(model_type, mesh, outcome)
    elif PINNED:
        assert outcome == EXPECTED.get(model_type, {}).get(mesh), "run `make zoo-table` if the change is meant"


@pytest.mark.skipif(UPDATE, reason="rewriting the expectations")
@pytest.mark.skipif(not PINNED, reason=f"zoo_expected.json records transformers {RECORDED_WITH}'s zoo, "
                                        f"not {INSTALLED}'s")
def test_zoo_is_every_model_type_with_a_tp_plan():
    assert sorted(EXPECTED) == zoo_model_types(), "transformers' zoo changed: run `make zoo-table`"


@pytest.mark.skipif(UPDATE, reason="rewriting the expectations")
def test_docs_table_is_rendered_from_the_zoo():
    table = (ROOT / "docs" / "zoo-table.md").read_text()
    assert replace_table(table, render_table(EXPECTED)) == table, "docs/zoo-table.md is stale: run `make zoo-table`"
