"""Schedules checked as data, without any process."""

from __future__ import annotations

import itertools

import pytest

from qn_hf.pipeline.schedule import Action, peak_in_flight, schedule_actions, simulate, stage_actions, warmup_forwards

SHAPES = list(itertools.product([1, 2, 3, 4, 8], [1, 2, 3, 4, 5, 8, 16]))


@pytest.mark.parametrize("schedule", ["1f1b", "gpipe"])
@pytest.mark.parametrize(("stages", "microbatches"), SHAPES)
def test_schedule_properties(schedule, stages, microbatches):
    all_actions = schedule_actions(stages=stages, microbatches=microbatches, schedule=schedule)
    simulate(all_actions)  # raises on deadlock
    for stage, actions in enumerate(all_actions):
        fwd = [a.mb for a in actions if a.op == "fwd"]
        bwd = [a.mb for a in actions if a.op == "bwd"]
        assert sorted(fwd) == sorted(bwd) == list(range(microbatches))
        for mb in range(microbatches):
            assert actions.index(Action("fwd", mb)) < actions.index(Action("bwd", mb))
            if stage > 0:
                assert actions.index(Action("recv_fwd", mb)) < actions.index(Action("fwd", mb))
                assert actions.index(Action("bwd", mb)) < actions.index(Action("send_bwd", mb))
            if stage < stages - 1:
                assert actions.index(Action("fwd", mb)) < actions.index(Action("send_fwd", mb))
                assert actions.index(Action("recv_bwd", mb)) < actions.index(Action("bwd", mb))
        bound = min(stages - stage, microbatches) if schedule == "1f1b" else microbatches
        assert peak_in_flight(actions) <= bound
        if schedule == "1f1b":
            first_bwd = next(i for i, a in enumerate(actions) if a.op == "bwd")
            forwards_before = sum(a.op == "fwd" for a in actions[:first_bwd])
            warm = warmup_forwards(stage=stage, stages=stages, microbatches=microbatches)
            assert forwards_before == min(warm + 1, microbatches)  # warm-up, then the first 1F1B pair
            assert warmup_forwards(stage=stage, stages=stages, microbatches=microbatches) == min(stages - stage - 1, microbatches)


def test_1f1b_holds_at_most_p_minus_stage_microbatches():
    actions = schedule_actions(stages=4, microbatches=16, schedule="1f1b")
    assert [peak_in_flight(a) for a in actions] == [4, 3, 2, 1]
    assert [peak_in_flight(a) for a in schedule_actions(stages=4, microbatches=16, schedule="gpipe")] == [16] * 4


def test_forward_only_lists_have_no_backward():
    for actions in schedule_actions(stages=3, microbatches=4, schedule="1f1b", backward=False):
        assert {a.op for a in actions} <= {"recv_fwd", "fwd", "send_fwd"}


def test_a_deadlocking_order_is_detected():
    good = schedule_actions(stages=2, microbatches=2, schedule="1f1b")
    bad = [list(reversed(good[0])), good[1]]
    with pytest.raises(RuntimeError, match="deadlocks"):
        simulate(bad)


def test_bad_arguments():
    with pytest.raises(ValueError, match="schedule='interleaved' is unknown"):
        stage_actions(stage=0, stages=2, microbatches=2, schedule="interleaved")
    with pytest.raises(ValueError, match="microbatches=0 must be a positive integer"):
        stage_actions(stage=0, stages=2, microbatches=0, schedule="1f1b")
