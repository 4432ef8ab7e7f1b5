"""The suite's time as data (used by tests/conftest.py).

``tests/durations.json`` holds every test's wall time (setup, call and teardown) from a quiet run on the
reference machine (2 cores), refreshed with ``make durations`` (``--record-durations``: the tests a run
executes are updated, the others kept). Two things read it:

- the budget: ``make test`` passes ``--budget SECONDS``; before any test runs, the recorded times of the
  selected tests are summed (a test not recorded yet counts at its tier's median, or NOMINAL before any
  test of its tier is recorded) and a selection over
  budget stops the run, naming the slowest tests. A slow test added to ``make test`` fails the suite at
  once, where it is cheap to decide what it is (long, or faster), instead of CI's limit failing later.
- the long tier's slices: as many slices of about equal recorded time as ``--slice-budget`` seconds
  each need (K), the longest test first, each to the lightest slice; ``--long-slice N`` keeps the
  ``long`` tests of slice N mod K (``make test-long-slice SLICE=N``).

Tiers are what a test is, not how long it took: ``unit`` starts no process, ``world`` runs in the
session's persistent gloo worlds, ``processes`` starts its own (a script under torchrun, a crash on
purpose). ``long`` is the one tier declared by hand: more of what the others already cover.
"""

from __future__ import annotations

import json
import math
import statistics
from enum import Enum
from pathlib import Path

DURATIONS_FILE = Path(__file__).with_name("durations.json")


class Tier(str, Enum):
    UNIT = "unit"
    WORLD = "world"
    PROCESSES = "processes"


def load() -> dict[str, float]:
    if not DURATIONS_FILE.exists():
        return {}
    return json.loads(DURATIONS_FILE.read_text())["seconds"]


def save(seconds: dict[str, float], *, note: str) -> None:
    """Merge ``seconds`` into the file (the tests this run executed replace their records)."""
    merged = {**load(), **seconds}
    data = {"note": note, "seconds": {k: round(v, 2) for k, v in sorted(merged.items())}}
    tmp = DURATIONS_FILE.with_suffix(".tmp")
    tmp.write_text(json.dumps(data, indent=0) + "\n")
    tmp.replace(DURATIONS_FILE)


# A tier's nominal seconds per test before any of its tests is recorded, from the suite's last full run on 2
# cores (about 1 min for 650 unit tests; most of the rest in world jobs of a few seconds; the tests that
# start processes range from a second to a minute).
NOMINAL = {Tier.UNIT: 0.1, Tier.WORLD: 2.5, Tier.PROCESSES: 15.0}


def estimates(nodeids: list[str], tiers: dict[str, Tier], recorded: dict[str, float]) -> dict[str, float]:
    """Each test's expected seconds: its record, else its tier's median record (NOMINAL where none is)."""
    medians = {}
    for tier in Tier:
        known = [recorded[n] for n in recorded if tiers.get(n) is tier]
        medians[tier] = statistics.median(known) if known else NOMINAL[tier]
    return {n: recorded.get(n, medians[tiers[n]]) for n in nodeids}


def over_budget(seconds: dict[str, float], budget: float, recorded: dict[str, float]) -> str | None:
    """The message that stops a selection over ``budget`` seconds, or None."""
    total = sum(seconds.values())
    if total <= budget:
        return None
    slowest = sorted(seconds.items(), key=lambda kv: -kv[1])[:10]
    lines = "\n".join(f"  {s:7.1f} s  {n}{'' if n in recorded else '  (not recorded: its tier median)'}"
                      for n, s in slowest)
    return (f"the selected tests are expected to take {total / 60:.1f} min, over the budget of {budget / 60:.1f} min "
            f"(tests/durations.json). The slowest:\n{lines}\nMark what only repeats covered ground "
            f"@pytest.mark.long (`make test-long-slice` runs the long tier in slices), or make it faster; "
            f"`make durations` records new times.")


def slices(seconds: dict[str, float], count: int) -> list[list[str]]:
    """``count`` slices of about equal time: the longest test first, each to the lightest slice."""
    loads = [0.0] * count
    out: list[list[str]] = [[] for _ in range(count)]
    for nodeid, s in sorted(seconds.items(), key=lambda kv: (-kv[1], kv[0])):
        lightest = min(range(count), key=lambda i: (loads[i], i))
        out[lightest].append(nodeid)
        loads[lightest] += s
    return out


def slice_count(seconds: dict[str, float], budget: float) -> int:
    """How many slices the long tier needs for each to take about ``budget`` seconds."""
    return max(1, math.ceil(sum(seconds.values()) / budget))


# What the README tells users to run. ``make test`` runs each at least once (``--cover`` checks it before any
# test runs), as it runs a test for every pair of features the composes marks cover: the long tier only
# repeats covered ground.
USER_FACING = ("scripts/demo.py", "scripts/train_lm.py", "scripts/train_vit.py", "scripts/train_trainer.py",
               "qn-hf-check", "qn-hf-convert", "qn-hf-plan")


def unrun_scripts(runs: set[str]) -> list[str]:
    """The user-facing scripts and commands no selected test runs (``runs``: the names their ``script`` marks
    give)."""
    return [f"{script}: no selected test runs it (mark one @pytest.mark.script)" for script in USER_FACING
            if script not in runs]

