"""The composition table (qn_hf/config/composition.py): complete, its tests real, its refusals the
ones the entry points raise, the only home of those messages, and docs/composition-table.md its output."""

from __future__ import annotations

import ast
import itertools
import re
import string
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from transformers import AutoConfig, AutoModelForCausalLM

from qn_hf.config.composition import ROWS, TABLE, Feature, Status, check_composition
from qn_hf.config.composition_markdown import markdown
from qn_hf.validation.checks import check_parallel_config

ROOT = Path(__file__).resolve().parents[1]
_SMALL = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2,
              head_dim=8, vocab_size=97, bos_token_id=1, eos_token_id=2, pad_token_id=0)
_MOE = dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=16, decoder_sparse_step=1, mlp_only_layers=[])


def _meta(kind: str) -> torch.nn.Module:
    extra = _MOE if kind == "qwen3_moe" else {}
    with torch.device("meta"):
        return AutoModelForCausalLM.from_config(AutoConfig.for_model(kind, **_SMALL, **extra))


def test_every_pair_has_one_row():
    pairs = {frozenset(p) for p in itertools.combinations(Feature, 2)}
    assert len(ROWS) == len(TABLE) == len(pairs)
    assert set(TABLE) == pairs
    for row in ROWS:
        assert bool(row.test) == (row.status in (Status.PLAIN, Status.EQUIVALENT, Status.RUNS)), row
        assert bool(row.message) == (row.status in (Status.REFUSED, Status.EXCLUSIVE)), row


@pytest.mark.processes  # pytest's own collection, in a process of its own
def test_every_named_test_exists():
    named = sorted({row.test for row in ROWS if row.test})
    files = sorted({name.partition("::")[0] for name in named})
    collected = subprocess.run([sys.executable, "-m", "pytest", "--collect-only", "-q", "-m", "", *files], cwd=ROOT,
                               capture_output=True, text=True, timeout=600).stdout.splitlines()
    ids = set(collected)
    functions = {node.partition("[")[0] for node in ids}
    missing = [name for name in named if name not in (ids if "[" in name else functions)]
    assert missing == [], missing


# One configuration per refused pair of parallelize's own features, on a dense or an MoE model.
REFUSED_CONFIGS = {
    (Feature.COMPILE, Feature.PP_ZB_H1): ("llama", dict(pp=2, microbatches=2, schedule="zb_h1", compile=True)),
    (Feature.COMPILE, Feature.CP): ("llama", dict(cp=2, compile=True)),
    (Feature.COMPILE, Feature.EP): ("qwen3_moe", dict(dp=2, ep=2, compile=True)),
    (Feature.DP_SHARD, Feature.PP_1F1B): ("llama", dict(dp=2, dp_shard=2, pp=2, microbatches=2)),
    (Feature.DP_SHARD, Feature.PP_GPIPE): ("llama", dict(dp=2, dp_shard=2, pp=2, microbatches=2, schedule="gpipe")),
    (Feature.DP_SHARD, Feature.PP_INTERLEAVED): ("llama", dict(dp=2, dp_shard=2, pp=2, microbatches=2,
                                                               schedule="interleaved_1f1b", virtual_stages=2)),
    (Feature.DP_SHARD, Feature.PP_ZB_H1): ("llama", dict(dp=2, dp_shard=2, pp=2, microbatches=2, schedule="zb_h1")),
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
    # every pair is tested or refused now: an untested one would come back here, warned about
    assert [row for row in TABLE.values() if row.status is Status.UNTESTED] == []


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
