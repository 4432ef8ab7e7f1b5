"""The suite's time as data (tests/suite_time.py): estimates, the budget's refusal, the long tier's slices."""

from __future__ import annotations

from tests import suite_time
from tests.suite_time import NOMINAL, Tier, estimates, over_budget, slice_count, slices


def test_a_test_not_recorded_counts_at_its_tiers_median_or_nominal_time():
    tiers = {"a": Tier.WORLD, "b": Tier.WORLD, "c": Tier.WORLD, "new": Tier.WORLD, "u": Tier.UNIT,
             "p": Tier.PROCESSES}
    recorded = {"a": 1.0, "b": 5.0, "c": 2.0, "u": 0.01}
    out = estimates(list(tiers), tiers, recorded)
    assert out["a"] == 1.0 and out["new"] == 2.0  # the world tier's median
    assert out["p"] == NOMINAL[Tier.PROCESSES]  # no process test recorded yet


def test_a_selection_over_budget_names_its_slowest_tests_and_the_fix():
    seconds = {f"t{i}": float(i) for i in range(20)}
    assert over_budget(seconds, budget=sum(seconds.values()), recorded=seconds) is None
    message = over_budget(seconds, budget=60, recorded={"t19": 19.0})
    assert "over the budget of 1.0 min" in message and "t19\n" in message and "t18  (not recorded" in message
    assert "t9 " not in message  # only the ten slowest
    assert "@pytest.mark.long" in message


def test_slices_cover_the_tier_once_with_about_equal_time():
    seconds = {f"t{i:02d}": float((i * 7) % 13 + 1) for i in range(40)}
    count = slice_count(seconds, budget=70)  # 274 s in all
    cut = slices(seconds, count)
    assert count == len(cut) == 4
    assert sorted(n for part in cut for n in part) == sorted(seconds)
    loads = [sum(seconds[n] for n in part) for part in cut]
    assert max(loads) - min(loads) <= max(seconds.values())  # greedy: within one test of each other
    assert slices(seconds, count) == cut  # the same cut on every machine
    assert slice_count({}, budget=40) == 1


def test_cover_names_unrun_scripts():
    assert suite_time.unrun_scripts(set(suite_time.USER_FACING) - {"qn-hf-plan"}) == [
        "qn-hf-plan: no selected test runs it (mark one @pytest.mark.script)"]
    assert suite_time.unrun_scripts(set(suite_time.USER_FACING)) == []

