"""What composes with what: the pairs of features that are refused or cannot both be set, and the one
function that refuses.

A pair of features (``features.Feature``) is refused (the reason and what to use instead, formatted with the
run's values), cannot both be set (why), or composes. Which pairs a test compares with the plain model is said by
the tests themselves: a ``@pytest.mark.composes((Feature.TP, Feature.SP), case=...)`` mark on the test, which
``make composition-table`` collects into ``composition_coverage.py`` (and docs/composition-table.md).
``check_composition`` raises every refusal of a combination, with its message, before any collective; a pair
neither refused nor compared by a test gets one warning. ``parallelize``, ``qn_hf.optimizer``, ``pm.generate``,
``qn_hf.Trainer``, ``qn-hf-plan`` and ``qn-hf-check`` all call it (tests/test_composition.py checks the rows, the
marks and the generated files).

Refusals that depend on the model rather than on a pair of features (cp on a model with sliding
windows, compile on any MoE model, LoRA variants at tp > 1, ...) stay with the feature's own checks.
"""

from __future__ import annotations

import itertools
import warnings
from collections.abc import Iterable, Mapping
from dataclasses import dataclass

from .composition_coverage import COVERED
from .features import Feature, Status, pair_name


@dataclass(frozen=True)
class Row:
    first: Feature
    second: Feature
    status: Status  # REFUSED or EXCLUSIVE: a pair that composes is a test's mark, not a row
    message: str  # REFUSED: the refusal, formatted with the run's values; EXCLUSIVE: why

    @property
    def pair(self) -> frozenset[Feature]:
        return frozenset((self.first, self.second))


F, S = Feature, Status

# Refused pairs first, in the order their messages win when a configuration hits several.
ROWS: tuple[Row, ...] = (
    # dp_shard (sharded data parallelism, data_parallel/sharded.py): what is not built on FSDP2 yet
    Row(F.DP_SHARD, F.ZERO, S.REFUSED, message=(
        "zero=True with dp_shard={dp_shard}: dp_shard already shards the optimizer state, the master weights, the "
        "gradients and the weights over its dp_shard ranks; leave zero=False (dp_shard=dp shards over every dp rank)")),
    # One schedule and one mixed_precision per run; the Trainer evaluates and predicts, it never generates.
    *(Row(a, b, S.EXCLUSIVE, message="one schedule per run")
      for a, b in itertools.combinations((F.PP_1F1B, F.PP_GPIPE, F.PP_INTERLEAVED, F.PP_ZB_H1), 2)),
    Row(F.BF16, F.FP16, S.EXCLUSIVE, message="one mixed_precision per run"),
    Row(F.GENERATE, F.TRAINER, S.EXCLUSIVE, message="the Trainer never generates (predict() is refused)"),
)
TABLE: dict[frozenset[Feature], Row] = {row.pair: row for row in ROWS}


def status(pair: frozenset[Feature]) -> Status:
    """What the table says of a pair: refused or exclusive (its row), else what the tests' marks say (the best of
    them: compared with the plain model, with an equivalent configuration, run only), else untested."""
    row = TABLE.get(pair)
    return row.status if row is not None else COVERED.get(pair, Status.UNTESTED)


def check_composition(features: Iterable[Feature], values: Mapping[str, object] | None = None
                      ) -> list[frozenset[Feature]]:
    """Raise the ``ValueError`` of the first refused pair among ``features`` (table order), its
    message formatted with ``values`` (cp, ep, pp, schedule, virtual_stages, model_type as the run has
    them); otherwise return the pairs no test compares yet (in Feature's order), for the caller to warn about
    once."""
    used = frozenset(features)
    for row in ROWS:
        if row.status is Status.REFUSED and row.pair <= used:
            raise ValueError(row.message.format(**(values or {})))
    ordered = [feature for feature in Feature if feature in used]
    return [frozenset(pair) for pair in itertools.combinations(ordered, 2)
            if status(frozenset(pair)) in (Status.RUNS, Status.UNTESTED)]


def check_and_warn(features: Iterable[Feature], values: Mapping[str, object], *, warned: set[frozenset[Feature]],
                   rank: int) -> None:
    """``check_composition``, then one warning on rank 0 naming the untested pairs not in ``warned``
    (which it extends), so a run hears about each once."""
    fresh = [pair for pair in check_composition(features, values) if pair not in warned]
    if fresh and rank == 0:
        names = ", ".join(pair_name(pair) for pair in fresh)
        warnings.warn(f"no test compares {names} with the plain model yet: it runs, but check its loss against a "
                      f"smaller run (docs/composition-table.md lists what is tested)", stacklevel=4)
    warned.update(fresh)
