"""The composition table: every pair of features a refused or exclusive row (qn_hf/config/composition.py) or
covered by the tests' composes marks (qn_hf/config/composition_coverage.py, their collection), the refusals the ones
the entry points raise, the only home of those messages, and docs/composition-table.md its output."""

from __future__ import annotations

import ast
import itertools
import re
import string
import subprocess
import sys
import warnings
from pathlib import Path

import pytest
import torch
from transformers import AutoConfig, AutoModelForCausalLM

from qn_hf.config.composition import ROWS, TABLE, check_and_warn, check_composition
from qn_hf.config.composition_coverage import COVERED
from qn_hf.config.composition_markdown import markdown
from qn_hf.config.features import Feature, Status
from qn_hf.validation.checks import check_parallel_config
from tests import composition_marks
from tests.composition_marks import Covers, Marked

ROOT = Path(__file__).resolve().parents[1]
_SMALL = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2,
              head_dim=8, vocab_size=97, bos_token_id=1, eos_token_id=2, pad_token_id=0)
_MOE = dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=16, decoder_sparse_step=1, mlp_only_layers=[])


def _meta(kind: str) -> torch.nn.Module:
    extra = _MOE if kind == "qwen3_moe" else {}
    with torch.device("meta"):
        return AutoModelForCausalLM.from_config(AutoConfig.for_model(kind, **_SMALL, **extra))


def test_every_pair_is_a_row_or_covered_by_a_test():
    pairs = {frozenset(p) for p in itertools.combinations(Feature, 2)}
    assert len(ROWS) == len(TABLE)
    assert set(TABLE) | set(COVERED) == pairs and not set(TABLE) & set(COVERED)
    for row in ROWS:
        assert row.status in (Status.REFUSED, Status.EXCLUSIVE) and row.message, row
    assert set(COVERED.values()) <= {Status.PLAIN, Status.EQUIVALENT, Status.RUNS}


@pytest.mark.core  # make test runs it: the coverage the runtime warns from is what the tests' marks say
@pytest.mark.processes  # pytest's own collection of the whole suite, in a process of its own
def test_the_coverage_is_what_the_tests_marks_say(tmp_path):
    written = tmp_path / "coverage.py"
    done = subprocess.run([sys.executable, "-m", "pytest", "--collect-only", "-q", "-m", "", "-p", "no:cacheprovider",
                           "--composition-table", str(written), "tests"], cwd=ROOT, capture_output=True, text=True,
                          timeout=600)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    current = (ROOT / "qn_hf" / "config" / "composition_coverage.py").read_text()
    assert written.read_text() == current, "qn_hf/config/composition_coverage.py is stale: run `make composition-table`"


def _tested(nodeid: str, *covers: Covers, long: bool = False) -> Marked:
    return Marked(nodeid, nodeid.partition("[")[2][:-1] or None, covers, long)


def test_marks_say_pairs_cases_and_status():
    tp_sp, cp_dp = (Feature.TP, Feature.SP), (Feature.CP, Feature.DP)
    runs = Covers.of((tp_sp,), {"status": Status.RUNS})
    cased = Covers.of((tp_sp, cp_dp), {"case": "a"})
    tests = [_tested("t.py::f[a]", runs, cased), _tested("t.py::f[b]", runs, cased, long=True),
             _tested("t.py::g", Covers.of(((Feature.TP, Feature.CP),), {"case": "gone"}))]
    # the strongest status a matching mark gives; a case's mark covers nothing on its function's other cases
    assert composition_marks.coverage(tests) == {frozenset(tp_sp): Status.PLAIN, frozenset(cp_dp): Status.PLAIN}
    assert composition_marks.coverage(tests[1:2]) == {frozenset(tp_sp): Status.RUNS}
    assert [composition_marks.needed(t) for t in tests] == [True, False, False]  # f[b]: uncased, but its case is long
    assert composition_marks.unmatched(tests) == [
        "t.py::g[gone]: a composes mark names this case, which the function does not have"]
    compared = "composes: compared with the plain model"
    assert composition_marks.uncovered(tests[1:], composition_marks.coverage(tests)) == [
        f"tp x sp: no selected test's composes mark compares it ({compared})",  # f[b] only runs it
        f"cp x dp: no selected test's composes mark compares it ({compared})"]
    assert composition_marks.uncovered([], {frozenset(tp_sp): Status.RUNS}) == []  # a run warns of it anyway
    for args, kwargs in [((), {}), ((tp_sp,), {"statu": Status.PLAIN}), (((Feature.TP, Feature.TP),), {}),
                         ((("tp", "sp"),), {}), ((tp_sp,), {"status": Status.REFUSED})]:
        with pytest.raises(ValueError, match="composes"):
            Covers.of(args, kwargs)


# One configuration per refused pair of parallelize's own features, on a dense or an MoE model.
REFUSED_CONFIGS = {
    (Feature.DP_SHARD, Feature.ZERO): ("llama", dict(dp=2, dp_shard=2, extra=frozenset({Feature.ZERO}))),
}


def _refused(first: Feature, second: Feature) -> str:
    """The error the entry point that meets this pair raises, in one process, before any collective
    (every refused pair left is two of parallelize's own features)."""
    kind, keywords = REFUSED_CONFIGS[(first, second)]
    with pytest.raises(ValueError) as caught:
        check_parallel_config(_meta(kind), **keywords)
    return str(caught.value)


@pytest.mark.parametrize("row", [r for r in ROWS if r.status is Status.REFUSED], ids=lambda r: f"{r.first}-{r.second}")
def test_each_refused_row_is_what_its_entry_point_raises(row):
    message = _refused(row.first, row.second)
    pattern = re.escape(row.message)
    for field in {f for _, f, _, _ in string.Formatter().parse(row.message) if f}:
        pattern = pattern.replace(re.escape("{" + field + "!r}"), ".+").replace(re.escape("{" + field + "}"), ".+")
    assert re.fullmatch(pattern, message), (row.message, message)


def test_composing_pairs_pass_and_untested_pairs_are_reported():
    assert check_composition({Feature.TP, Feature.DP, Feature.PP_1F1B}) == []
    # every pair is tested or refused now; one only run in a test comes back, warned about once on rank 0
    assert [status for status in COVERED.values() if status is Status.UNTESTED] == []
    runs = [pair for pair, status in COVERED.items() if status is Status.RUNS]
    assert runs and check_composition(set().union(*runs) | {Feature.TP}) == runs
    warned: set = set()
    with pytest.warns(UserWarning, match="no test compares .* x .* with the plain model yet"):
        check_and_warn(runs[0], {}, warned=warned, rank=0)
    assert warned == {runs[0]}
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        check_and_warn(runs[0], {}, warned=warned, rank=0)  # once per run
        check_and_warn(runs[0], {}, warned=set(), rank=1)  # rank 0 only


def _literal_parts(message: str) -> list[str]:
    return [text for text, _, _, _ in string.Formatter().parse(message) if len(text) > 30]


def _string_constants(path: Path) -> list[str]:
    """Every string literal of a file (adjacent literals joined, an f-string's literal parts apart)."""
    return [node.value for node in ast.walk(ast.parse(path.read_text()))
            if isinstance(node, ast.Constant) and isinstance(node.value, str)]


def test_refusal_messages_live_only_in_the_table():
    # A refusal of a combination raised anywhere else would repeat its reason there.
    parts = {part for row in ROWS if row.status is Status.REFUSED for part in _literal_parts(row.message)}
    repeated = [(str(path.relative_to(ROOT)), part) for path in (ROOT / "qn_hf").rglob("*.py")
                if path.name != "composition.py" for text in _string_constants(path) for part in parts if part in text]
    assert repeated == []
    # ... and the check finds one: the dp_shard x zero refusal raised elsewhere, split over two literals
    message = TABLE[frozenset((Feature.DP_SHARD, Feature.ZERO))].message
    old = f"raise ValueError({message[:60]!r}\n    {message[60:]!r})"
    assert any(part in node.value for part in parts for node in ast.walk(ast.parse(old))
               if isinstance(node, ast.Constant) and isinstance(node.value, str))


def test_the_docs_table_is_the_tables_output():
    table = (ROOT / "docs" / "composition-table.md").read_text()
    assert markdown() in table, "docs/composition-table.md is stale: run `make composition-table`"
