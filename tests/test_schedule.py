"""Schedules checked as data, without any process."""

from __future__ import annotations

import itertools
from fractions import Fraction

import pytest
import torch

from qn_hf.config.schedule import check_schedule_args, microbatches_allowed, nearest_allowed_microbatches
from qn_hf.pipeline.runtime import Peers, StageExecutor
from qn_hf.pipeline.schedule import (
    Action,
    Op,
    chunk_of,
    deferred,
    final_actions,
    format_grid,
    peak_in_flight,
    rank_of_chunk,
    schedule_actions,
    stage_actions,
    warmup_forwards,
)
from qn_hf.pipeline.schedule_check import check_links, check_order, peaks, simulate, timed

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
    assert [op.short for op in Op] == ["F", "B", "rF", "sF", "rB", "sB", "W"]
    assert Op.FWD == "fwd" and "recv_bwd" in {Op.RECV_BWD} and str(Op.SEND_FWD) == "send_fwd"
    assert Action("recv_fwd", 3) == Action(Op.RECV_FWD, 3) and Action("fwd", 0).op is Op.FWD
    assert repr(Action(Op.FWD, 3)) == str(Action(Op.FWD, 3)) == "F3"
    assert [str(Action(op, 12)) for op in Op] == ["F12", "B12", "rF12", "sF12", "rB12", "sB12", "W12"]
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

    def forward(chunk: int, mb: int, received: torch.Tensor | None) -> torch.Tensor:
        if mb == 1:
            raise ValueError("microbatch 1 is broken")
        return (weight * mb).sum()

    executor = StageExecutor(stage=0, peers=Peers(prev=None, next=None), device=torch.device("cpu"))
    with pytest.raises(ValueError) as caught:
        executor.run(schedule, forward, rows=[1, 1, 1])
    assert type(caught.value) is ValueError and str(caught.value) == "microbatch 1 is broken"
    (note,) = caught.value.__notes__
    assert note == "pipeline stage 0 failed at step 2 (F1) of this schedule:\n" + format_grid(schedule, mark=(0, 2))
    assert "   2 >F1<" in note


def test_executor_records_and_arms_before_the_last_backward():
    schedule = schedule_actions(stages=1, microbatches=3, schedule="gpipe")
    weight = torch.ones(2, requires_grad=True)
    seen: list[str] = []

    def forward(chunk: int, mb: int, received: torch.Tensor | None) -> torch.Tensor:
        assert received is None and chunk == 0
        return (weight * (mb + 1)).sum()

    executor = StageExecutor(stage=0, peers=Peers(prev=None, next=None), device=torch.device("cpu"))
    executor.events = []
    executor.run(schedule, forward, rows=[1, 1, 1],
                 on_final=lambda chunk, kind: seen.append(f"{chunk}{kind.short.lower()} final after {len(executor.events)}"))
    assert [(e.op, e.chunk, e.mb) for e in executor.events] == [
        ("fwd", 0, 0), ("fwd", 0, 1), ("fwd", 0, 2), ("bwd", 0, 0), ("bwd", 0, 1), ("bwd", 0, 2)
    ]
    assert seen == ["0b final after 5"] and weight.grad.tolist() == [6.0, 6.0]


def test_executor_runs_chunks_and_deferred_weight_passes():
    """One rank, two chunks of a toy model and a W list: the executor keys work by (chunk, mb),
    opens the queue for a deferred B, runs W, and reports each chunk's final B and W."""
    schedule = [[Action("fwd", 0, 0), Action("fwd", 0, 1), Action("bwd", 0, 1), Action("bwd", 0, 0),
                 Action("wgt", 0, 0)]]
    seen: list[str] = []

    class Queue:
        open = None

        def run(self, key):
            seen.append(f"W{key}")

        def pending(self):
            return []

        def clear(self):
            seen.append("cleared")

    queue = Queue()
    weight = torch.ones(2, requires_grad=True)
    held = {}

    def forward(chunk: int, mb: int, received: torch.Tensor | None) -> torch.Tensor:
        held[chunk] = (weight * (chunk + 1)).sum()
        return held[chunk]

    def backward_hook(grad):
        seen.append(f"B open={queue.open}")

    weight.register_hook(backward_hook)
    executor = StageExecutor(stage=0, peers=Peers(prev=None, next=None), device=torch.device("cpu"), chunks=2,
                             weights=queue)
    executor.run(schedule, forward, rows=[1], on_final=lambda chunk, kind: seen.append(f"final {chunk}{kind.short.lower()}"))
    # the queue is cleared first: nothing of an interrupted step joins this one
    assert seen == ["cleared", "final 1b", "B open=None", "final 0b", "B open=(0, 0)", "final 0w", "W(0, 0)"]
    assert weight.grad.tolist() == [3.0, 3.0]


# --- interleaved_1f1b and zb_h1 ------------------------------------------------------------------

INTERLEAVED = [
    (pp, v, m)
    for pp in (2, 3, 4, 8)
    for v in (2, 3, 4)
    for m in range(1, 3 * pp + 1)
    if microbatches_allowed(schedule="interleaved_1f1b", stages=pp, microbatches=m)
]


def _bubbles(all_actions, costs) -> list[Fraction]:
    """Per-rank bubble of ``timed`` as exact fractions (integer costs give integer times)."""
    timing = timed(all_actions, costs=costs)
    return [1 - Fraction(int(b)) / Fraction(int(timing.makespan)) for b in timing.busy]


def _check_lists(all_actions, *, chunks: int, microbatches: int, wgt: bool) -> None:
    """Each (chunk, mb) on its rank has one F, one B (and one W), in order, with its comms around."""
    stages = len(all_actions)
    simulate(all_actions)  # no deadlock, FIFO on every link
    check_order(all_actions)
    for stage, actions in enumerate(all_actions):
        where = {a: i for i, a in enumerate(actions)}
        assert len(where) == len(actions)  # no action twice
        for chunk in range(stage, chunks, stages):
            label = None if chunks == stages else chunk
            for mb in range(microbatches):
                f, b = where[Action(Op.FWD, mb, label)], where[Action(Op.BWD, mb, label)]
                assert f < b
                if wgt:
                    assert b < where[Action(Op.WGT, mb, label)]
                if chunk > 0:
                    assert where[Action(Op.RECV_FWD, mb, label)] < f and b < where[Action(Op.SEND_BWD, mb, label)]
                if chunk < chunks - 1:
                    assert where[Action(Op.RECV_BWD, mb, label)] < b and f < where[Action(Op.SEND_FWD, mb, label)]
        computes = [a for a in actions if a.op in (Op.FWD, Op.BWD, Op.WGT)]
        per_chunk = chunks // stages
        assert len(computes) == per_chunk * microbatches * (3 if wgt else 2)
        assert {chunk_of(a, stage=stage) for a in actions} == set(range(stage, chunks, stages))


@pytest.mark.parametrize(("stages", "virtual", "microbatches"), INTERLEAVED)
def test_interleaved_properties(stages, virtual, microbatches):
    all_actions = schedule_actions(stages=stages, microbatches=microbatches, schedule="interleaved_1f1b",
                                   virtual_stages=virtual)
    _check_lists(all_actions, chunks=stages * virtual, microbatches=microbatches, wgt=False)
    per_round = microbatches // max(1, microbatches // stages)
    for rank, actions in enumerate(all_actions):
        warm = warmup_forwards(stage=rank, stages=stages, microbatches=microbatches, virtual_stages=virtual)
        assert warm == min(virtual * microbatches, (virtual - 1) * per_round + 2 * (stages - 1 - rank))
        first_bwd = next(i for i, a in enumerate(actions) if a.op is Op.BWD)
        assert sum(a.op is Op.FWD for a in actions[:first_bwd]) == min(warm + 1, virtual * microbatches)
        assert peak_in_flight(actions) == peaks(actions).f_to_b == peaks(actions).f_to_w <= warm + 1
        # Depth first: forwards run round by round, chunk by chunk, microbatches in order.
        fwd = [(a.chunk, a.mb) for a in actions if a.op is Op.FWD]
        assert fwd[:per_round] == [(rank, mb) for mb in range(per_round)]
    # Every chunk costs the same. Makespan in units of (F+B): V*M + pp - 1, plus (V-1)*(pp-M) when one
    # round holds fewer than pp microbatches (each of the V-1 passes around the ring then waits
    # pp-M slots): bubble = (pp-1)/(V*M+pp-1) exactly for M >= pp, for F=B and F=B/2 alike.
    idle = stages - 1 + (virtual - 1) * max(0, stages - microbatches)
    expected = Fraction(idle, virtual * microbatches + idle)
    if microbatches >= stages:
        assert expected == Fraction(stages - 1, virtual * microbatches + stages - 1)
    for costs in ({Op.FWD: 1, Op.BWD: 2}, {Op.FWD: 1, Op.BWD: 1}):
        assert _bubbles(all_actions, costs) == [expected] * stages
    # Eval: the forward side of the train lists, same order, also deadlock-free and FIFO.
    forward_only = schedule_actions(stages=stages, microbatches=microbatches, schedule="interleaved_1f1b",
                                    virtual_stages=virtual, backward=False)
    simulate(forward_only)
    sides = {Op.RECV_FWD, Op.FWD, Op.SEND_FWD}
    assert forward_only == [[a for a in actions if a.op in sides] for actions in all_actions]


def test_interleaved_microbatch_rule_and_message():
    assert [m for m in range(1, 25) if microbatches_allowed(schedule="interleaved_1f1b", stages=4, microbatches=m)] == [
        1, 2, 3, 4, 5, 6, 7, 8, 10, 12, 15, 16, 20, 24
    ]
    assert nearest_allowed_microbatches(schedule="interleaved_1f1b", stages=4, microbatches=9) == (8, 10)
    assert nearest_allowed_microbatches(schedule="interleaved_1f1b", stages=4, microbatches=13) == (12, 15)
    with pytest.raises(ValueError) as caught:
        stage_actions(stage=0, stages=4, microbatches=9, schedule="interleaved_1f1b", virtual_stages=2)
    assert str(caught.value) == (
        "microbatches=9 is not allowed for interleaved_1f1b at pp=4 (microbatches run in max(1, M // pp) = 2 "
        "rounds of equal size): use 8 or 10"
    )
    for schedule in ("1f1b", "gpipe", "zb_h1"):
        assert microbatches_allowed(schedule=schedule, stages=4, microbatches=9)


def test_schedule_argument_messages():
    with pytest.raises(ValueError, match=r"use one of \('1f1b', 'gpipe', 'interleaved_1f1b', 'zb_h1'\)"):
        check_schedule_args(stages=2, microbatches=2, schedule="zb")
    with pytest.raises(ValueError, match=r"virtual_stages=2 needs schedule='interleaved_1f1b' \(schedule='1f1b'"):
        check_schedule_args(stages=2, microbatches=2, schedule="1f1b", virtual_stages=2)
    with pytest.raises(ValueError, match=r"needs pp >= 2, got pp=1; use '1f1b' at pp=1"):
        check_schedule_args(stages=1, microbatches=2, schedule="interleaved_1f1b", virtual_stages=2)
    with pytest.raises(ValueError, match=r"needs virtual_stages >= 2, got 1; virtual_stages=1 is schedule='1f1b'"):
        check_schedule_args(stages=2, microbatches=2, schedule="interleaved_1f1b")
    with pytest.raises(ValueError, match=r"virtual_stages=0 must be a positive integer"):
        check_schedule_args(stages=2, microbatches=2, schedule="interleaved_1f1b", virtual_stages=0)
    check_schedule_args(stages=1, microbatches=7, schedule="zb_h1")


@pytest.mark.parametrize(("stages", "microbatches"),
                         [(pp, m) for pp in (1, 2, 3, 4, 8) for m in range(1, 4 * pp + 1)])
def test_zb_h1_properties(stages, microbatches):
    all_actions = schedule_actions(stages=stages, microbatches=microbatches, schedule="zb_h1")
    _check_lists(all_actions, chunks=stages, microbatches=microbatches, wgt=True)
    one_f_one_b = schedule_actions(stages=stages, microbatches=microbatches, schedule="1f1b")
    for rank, (actions, plain) in enumerate(zip(all_actions, one_f_one_b)):
        # Same forwards and backwards in the same order as 1F1B, W's added (in microbatch order).
        assert [a for a in actions if a.op is not Op.WGT] == plain
        assert [a.mb for a in actions if a.op is Op.WGT] == list(range(microbatches))
        assert deferred(actions) == {(None, mb) for mb in range(microbatches)}
        # F->B as 1F1B's; F->W (activations plus W stash) is min(pp, M) on every rank: rank r holds
        # 1F1B's min(pp-r, M) plus up to r postponed W's, i.e. at most r more than 1F1B's rank r.
        held = peaks(actions)
        assert held.f_to_b == peak_in_flight(plain) == min(stages - rank, microbatches)
        assert held.f_to_w == min(stages, microbatches)
    # Unit costs: makespan max(3M + pp - 1, 2M + 2pp - 1): the steady state binds for M >= pp, giving
    # (pp-1)/(3M+pp-1); below that the last microbatch's F and B chain around the pipe plus one W.
    unit = {Op.FWD: 1, Op.BWD: 1, Op.WGT: 1}
    span = max(3 * microbatches + stages - 1, 2 * microbatches + 2 * stages - 1)
    assert _bubbles(all_actions, unit) == [1 - Fraction(3 * microbatches, span)] * stages
    one_f_one_b_bubble = _bubbles(one_f_one_b, {Op.FWD: 1, Op.BWD: 2})  # B + W in one pass
    assert one_f_one_b_bubble == [Fraction(stages - 1, microbatches + stages - 1)] * stages
    if microbatches >= stages:
        assert _bubbles(all_actions, unit)[0] == Fraction(stages - 1, 3 * microbatches + stages - 1)
        if stages >= 2:
            assert _bubbles(all_actions, unit)[0] < one_f_one_b_bubble[0]
    assert schedule_actions(stages=stages, microbatches=microbatches, schedule="zb_h1", backward=False) == (
        schedule_actions(stages=stages, microbatches=microbatches, schedule="1f1b", backward=False)
    )


def test_fifo_check_catches_two_swapped_sends():
    good = schedule_actions(stages=2, microbatches=2, schedule="interleaved_1f1b", virtual_stages=2)
    simulate(good)
    first, second = (i for i, a in enumerate(good[0]) if a.op is Op.SEND_FWD and a.chunk == 0)
    bad = [list(good[0]), good[1]]
    bad[0][first], bad[0][second] = bad[0][second], bad[0][first]  # 0:sF1 now leaves before 0:sF0
    with pytest.raises(RuntimeError) as caught:
        simulate(bad)  # no deadlock (matched by tags, as gloo would), so the FIFO check is what fails
    message = str(caught.value)
    assert message.startswith(
        "pipeline schedule breaks FIFO order on link rank 0 -> rank 1: message 0 sent is 0:sF1 but message 0 "
        "received is 1:rF0; NCCL matches by order, not tags, so rank 1 would get the wrong tensor:\n"
    )
    receive = good[1].index(Action(Op.RECV_FWD, 0, 1))
    assert message.endswith(format_grid(bad, marks=[(0, first), (1, receive)]))
    with pytest.raises(RuntimeError, match="FIFO"):
        check_links(bad)


def test_chunks_and_ranks():
    assert [rank_of_chunk(c, stages=2) for c in range(4)] == [0, 1, 0, 1]
    assert chunk_of(Action("fwd", 3), stage=1) == 1 and chunk_of(Action("fwd", 3, 2), stage=0) == 2
    assert repr(Action(Op.WGT, 3)) == "W3" and repr(Action(Op.FWD, 3, 2)) == "2:F3"
    assert Action("fwd", 3) == Action(Op.FWD, 3, None) != Action(Op.FWD, 3, 1)


def test_final_actions_name_each_chunks_last_backward_and_weight_pass():
    interleaved = stage_actions(stage=1, stages=2, microbatches=2, schedule="interleaved_1f1b", virtual_stages=2)
    finals = final_actions(interleaved, stage=1)
    assert finals == {(3, Op.BWD): interleaved.index(Action(Op.BWD, 1, 3)),
                      (1, Op.BWD): interleaved.index(Action(Op.BWD, 1, 1))}
    assert finals[3, Op.BWD] < finals[1, Op.BWD] == len(interleaved) - 2  # the last chunk finishes first
    zb = stage_actions(stage=0, stages=2, microbatches=3, schedule="zb_h1")
    assert final_actions(zb, stage=0) == {(0, Op.BWD): zb.index(Action(Op.BWD, 2)), (0, Op.WGT): len(zb) - 1}
    assert final_actions(stage_actions(stage=0, stages=1, microbatches=2, schedule="1f1b"), stage=0) == {(0, Op.BWD): 3}


def test_check_order_and_timed_refuse_bad_input():
    with pytest.raises(ValueError, match=r"rank 0 step 0 \(B0\): runs before its fwd"):
        check_order([[Action(Op.BWD, 0), Action(Op.FWD, 0)]])
    with pytest.raises(ValueError, match=r"costs has no entry for \['wgt'\]"):
        timed(schedule_actions(stages=2, microbatches=2, schedule="zb_h1"), costs={Op.FWD: 1, Op.BWD: 1})


def test_format_grid_of_interleaved_on_two_ranks():
    actions = schedule_actions(stages=2, microbatches=4, schedule="interleaved_1f1b", virtual_stages=2)
    assert format_grid(actions).splitlines() == [
        "step  stage 0  stage 1",
        "   0  0:F0     1:rF0",
        "   1  0:sF0    1:F0",
        "   2  0:F1     1:sF0",
        "   3  0:sF1    1:rF1",
        "   4  2:rF0    1:F1",
        "   5  2:F0     1:sF1",
        "   6  2:sF0    3:rF0",
        "   7  2:rF1    3:F0",
        "   8  2:F1     3:B0",
        "   9  2:sF1    3:sB0",
        "  10  0:F2     3:rF1",
        "  11  0:sF2    3:F1",
        "  12  2:rB0    3:B1",
        "  13  2:B0     3:sB1",
        "  14  2:sB0    1:rF2",
        "  15  0:F3     1:F2",
        "  16  0:sF3    1:sF2",
        "  17  2:rB1    1:rB0",
        "  18  2:B1     1:B0",
        "  19  2:sB1    1:sB0",
        "  20  2:rF2    1:rF3",
        "  21  2:F2     1:F3",
        "  22  2:sF2    1:sF3",
        "  23  0:rB0    1:rB1",
        "  24  0:B0     1:B1",
        "  25  2:rF3    1:sB1",
        "  26  2:F3     3:rF2",
        "  27  2:sF3    3:F2",
        "  28  0:rB1    3:B2",
        "  29  0:B1     3:sB2",
        "  30  2:rB2    3:rF3",
        "  31  2:B2     3:F3",
        "  32  2:sB2    3:B3",
        "  33  2:rB3    3:sB3",
        "  34  2:B3     1:rB2",
        "  35  2:sB3    1:B2",
        "  36  0:rB2    1:sB2",
        "  37  0:B2     1:rB3",
        "  38  0:rB3    1:B3",
        "  39  0:B3     1:sB3",
    ]


def test_format_grid_of_zb_h1_on_two_ranks():
    actions = schedule_actions(stages=2, microbatches=3, schedule="zb_h1")
    assert format_grid(actions).splitlines()[5:] == [
        "   4  rB0      rF1",
        "   5  B0       F1",
        "   6  W0       B1",
        "   7  F2       sB1",
        "   8  sF2      W0",
        "   9  rB1      rF2",
        "  10  B1       F2",
        "  11  W1       B2",
        "  12  rB2      sB2",
        "  13  B2       W1",
        "  14  W2       W2",
    ]


def test_a_failed_step_drops_its_queued_weight_passes():
    schedule = [[Action("fwd", 0), Action("bwd", 0), Action("wgt", 0)]]
    seen: list[str] = []

    class Queue:
        open = None

        def run(self, key):
            seen.append("run")

        def pending(self):
            return []

        def clear(self):
            seen.append("cleared")

    def forward(chunk: int, mb: int, received: torch.Tensor | None) -> torch.Tensor:
        raise ValueError("broken forward")

    executor = StageExecutor(stage=0, peers=Peers(prev=None, next=None), device=torch.device("cpu"), weights=Queue())
    with pytest.raises(ValueError, match="broken forward"):
        executor.run(schedule, forward, rows=[1])
    assert seen == ["cleared", "cleared"]  # at the start, and after the failure


def test_an_interrupted_zb_step_leaves_nothing_for_the_next():
    """Ctrl-C inside a backward of a zb_h1 step, zero_grad, a clean step: the gradients are the
    plain model's (the interrupted step's queued weight passes are dropped)."""
    from torch import nn

    from qn_hf.pipeline.weight_grad import WeightGradQueue, make_deferrable

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 4), nn.Tanh(), nn.Linear(4, 1))
    ref = nn.Sequential(nn.Linear(4, 4), nn.Tanh(), nn.Linear(4, 1))
    ref.load_state_dict(model.state_dict())
    queue = WeightGradQueue()
    assert make_deferrable(model, queue=queue)
    executor = StageExecutor(stage=0, peers=Peers(prev=None, next=None), device=torch.device("cpu"), weights=queue)
    xs = torch.randn(2, 3, 4)
    interrupt = {"on": True}

    def interrupted(_grad):
        raise KeyboardInterrupt

    def forward(chunk: int, mb: int, received: torch.Tensor | None) -> torch.Tensor:
        hidden = model[0](xs[mb])
        if interrupt["on"] and mb == 1:
            hidden.register_hook(interrupted)
        return model[2](model[1](hidden)).sum()

    schedule = schedule_actions(stages=1, microbatches=2, schedule="zb_h1")
    with pytest.raises(KeyboardInterrupt):
        executor.run(schedule, forward, rows=[3, 3])
    assert queue.pending() == []
    model.zero_grad(set_to_none=True)
    interrupt["on"] = False
    executor.run(schedule, forward, rows=[3, 3])
    for mb in range(2):
        ref(xs[mb]).sum().backward()
    for mine, theirs in zip(model.parameters(), ref.parameters()):
        torch.testing.assert_close(mine.grad, theirs.grad)


def test_schedules_are_an_enum_that_knows_what_each_can_do():
    """``qn_hf.Schedule``: each member equals parallelize's string for it (either is accepted), quotes
    that string in messages, and carries its capabilities as data instead of name comparisons."""
    import qn_hf
    from qn_hf.config.schedule import SCHEDULES, Schedule, as_schedule

    assert SCHEDULES == ("1f1b", "gpipe", "interleaved_1f1b", "zb_h1") and qn_hf.Schedule is Schedule
    assert [as_schedule(name) for name in SCHEDULES] == list(Schedule) and as_schedule(Schedule.GPIPE) is Schedule.GPIPE
    assert Schedule.ZB_H1 == "zb_h1" and f"{Schedule.ZB_H1!r} {Schedule.ZB_H1}" == "'zb_h1' zb_h1"
    assert [s.value for s in Schedule if s.chunks] == ["interleaved_1f1b"]
    assert [s.value for s in Schedule if s.split_backward] == ["zb_h1"]
    assert [s.value for s in Schedule if s.idle_below_pp] == ["1f1b", "gpipe"]
    with pytest.raises(ValueError, match="schedule='zb-h1'.*one of"):
        as_schedule("zb-h1")
    for schedule in Schedule:  # the member and its string give the same lists
        args = dict(stages=2, microbatches=4, virtual_stages=2 if schedule.chunks else 1)
        assert stage_actions(stage=1, schedule=schedule, **args) == stage_actions(stage=1, schedule=schedule.value,
                                                                                  **args)
