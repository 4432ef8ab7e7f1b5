"""Schedules checked as data, without any process."""

from __future__ import annotations

import itertools

import pytest
import torch

from qn_hf.pipeline.runtime import Peers, StageExecutor
from qn_hf.pipeline.schedule import (
    Action,
    Op,
    format_grid,
    peak_in_flight,
    schedule_actions,
    simulate,
    stage_actions,
    warmup_forwards,
)

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
    with pytest.raises(RuntimeError, match="deadlocks") as caught:
        simulate(bad)
    message = str(caught.value)
    assert message.startswith("pipeline schedule deadlocks; stages wait at {0: rB1, 1: rF0}:\n")
    assert message.endswith(format_grid(bad, marks=[(0, 1), (1, 0)]))
    assert ">rB1<" in message and ">rF0<" in message


def test_bad_arguments():
    with pytest.raises(ValueError, match="schedule='interleaved' is unknown"):
        stage_actions(stage=0, stages=2, microbatches=2, schedule="interleaved")
    with pytest.raises(ValueError, match="microbatches=0 must be a positive integer"):
        stage_actions(stage=0, stages=2, microbatches=0, schedule="1f1b")


def test_op_and_action_text():
    assert [op.short for op in Op] == ["F", "B", "rF", "sF", "rB", "sB"]
    assert Op.FWD == "fwd" and "recv_bwd" in {Op.RECV_BWD} and str(Op.SEND_FWD) == "send_fwd"
    assert Action("recv_fwd", 3) == Action(Op.RECV_FWD, 3) and Action("fwd", 0).op is Op.FWD
    assert repr(Action(Op.FWD, 3)) == str(Action(Op.FWD, 3)) == "F3"
    assert [str(Action(op, 12)) for op in Op] == ["F12", "B12", "rF12", "sF12", "rB12", "sB12"]
    with pytest.raises(ValueError):
        Action("forward", 0)


def test_format_grid_of_1f1b_on_two_stages():
    actions = schedule_actions(stages=2, microbatches=2, schedule="1f1b")
    assert format_grid(actions) == (
        "step  stage 0  stage 1\n"
        "   0  F0       rF0\n"
        "   1  sF0      F0\n"
        "   2  F1       B0\n"
        "   3  sF1      sB0\n"
        "   4  rB0      rF1\n"
        "   5  B0       F1\n"
        "   6  rB1      B1\n"
        "   7  B1       sB1"
    )
    marked = format_grid(actions, mark=(1, 4)).splitlines()
    assert marked[5] == "   4  rB0     >rF1<" and ">" not in "".join(marked[:5] + marked[6:])


def test_format_grid_leaves_ended_lists_blank():
    lines = format_grid([[Action(Op.FWD, 10)], [Action(Op.FWD, 0), Action(Op.BWD, 0)]]).splitlines()
    assert lines == ["step  stage 0  stage 1", "   0  F10      F0", "   1           B0"]


def test_executor_marks_the_failing_action_in_the_grid():
    schedule = schedule_actions(stages=1, microbatches=3, schedule="1f1b")
    weight = torch.ones(2, requires_grad=True)

    def forward(mb: int, received: torch.Tensor | None) -> torch.Tensor:
        if mb == 1:
            raise ValueError("microbatch 1 is broken")
        return (weight * mb).sum()

    executor = StageExecutor(stage=0, peers=Peers(prev=None, next=None), device=torch.device("cpu"))
    with pytest.raises(ValueError) as caught:
        executor.run(schedule, forward)
    assert type(caught.value) is ValueError and str(caught.value) == "microbatch 1 is broken"
    (note,) = caught.value.__notes__
    assert note == "pipeline stage 0 failed at step 2 (F1) of this schedule:\n" + format_grid(schedule, mark=(0, 2))
    assert "   2 >F1<" in note


def test_executor_records_and_arms_before_the_last_backward():
    schedule = schedule_actions(stages=1, microbatches=3, schedule="gpipe")
    weight = torch.ones(2, requires_grad=True)
    seen: list[str] = []

    def forward(mb: int, received: torch.Tensor | None) -> torch.Tensor:
        assert received is None
        return (weight * (mb + 1)).sum()

    executor = StageExecutor(stage=0, peers=Peers(prev=None, next=None), device=torch.device("cpu"))
    executor.events = []
    executor.run(schedule, forward, before_last_backward=lambda: seen.append(f"armed after {len(executor.events)}"))
    assert [(op, mb) for op, mb, _, _ in executor.events] == [
        ("fwd", 0), ("fwd", 1), ("fwd", 2), ("bwd", 0), ("bwd", 1), ("bwd", 2)
    ]
    assert seen == ["armed after 5"] and weight.grad.tolist() == [6.0, 6.0]
