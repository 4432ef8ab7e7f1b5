"""The pipeline's real point-to-point calls, replayed through a model of NCCL's semantics.

gloo runs what NCCL would hang on (its sends progress on their own, it matches by tag), so a
pipeline proven on CPU could deadlock at its first GPU step. The model (qn_hf/pipeline/nccl_replay.py)
is checked on small hand-written cases, then on the calls that the pipeline of commit c73aed4 made
(recorded in tests/data; every training step deadlocks there, as the issue found by reading the
code), then on the calls of today's pipeline recorded live, for every schedule at pp = 2 and 4,
with and without virtual stages, evaluation and generation included.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from qn_hf.pipeline.nccl_replay import COLLECTIVE, POST, RECV, SEND, SYNC, WAIT, Call, NcclDeadlock, replay
from tests import nccl_trace_cases

LEGACY = Path(__file__).parent / "data" / "nccl_traces_c73aed4.json"


def send(op: int, peer: int, group: str = "g") -> Call:
    return Call(POST, op=op, group=group, kind=SEND, peer=peer, label=f"send {op}")


def recv(op: int, peer: int, group: str = "g") -> Call:
    return Call(POST, op=op, group=group, kind=RECV, peer=peer, label=f"recv {op}")


def wait(op: int) -> Call:
    return Call(WAIT, op=op)


def test_a_receive_posted_ahead_blocks_a_send_behind_it_on_one_communicator():
    # stage 0 posts the gradient's receive before sending the activation stage 1 needs first
    stage0 = [recv(0, 1), send(1, 1), wait(1), wait(0)]
    stage1 = [recv(0, 0), wait(0), send(1, 0), wait(1)]
    with pytest.raises(NcclDeadlock, match="rank 0.*recv 0"):
        replay([stage0, stage1])
    # the same calls with a communicator per direction complete
    stage0 = [recv(0, 1, "1->0"), send(1, 1, "0->1"), wait(1), wait(0)]
    stage1 = [recv(0, 0, "0->1"), wait(0), send(1, 0, "1->0"), wait(1)]
    assert replay([stage0, stage1]) == 4


def test_a_host_read_blocks_what_the_host_would_post_after_it():
    # rank 1 reads a received header on the host before it can send what rank 0 waits for
    rank0 = [recv(0, 1, "1->0"), wait(0), Call(SYNC), send(1, 1, "0->1"), wait(1)]
    rank1 = [recv(0, 0, "0->1"), wait(0), Call(SYNC), send(1, 0, "1->0"), wait(1)]
    with pytest.raises(NcclDeadlock, match="host blocked"):
        replay([rank0, rank1])
    # without the reads, the device waits alone cannot block the host from posting: still a cycle,
    # because each send is gated on a compute stream that waits for the other's receive
    with pytest.raises(NcclDeadlock):
        replay([[c for c in rank0 if c.what != SYNC], [c for c in rank1 if c.what != SYNC]])


def test_collectives_must_be_issued_in_the_same_order():
    def coll(op: int, group: str) -> Call:
        return Call(POST, op=op, group=group, kind=COLLECTIVE, members=(0, 1), label=f"collective on {group}")

    same = [coll(0, "a"), wait(0), coll(1, "b"), wait(1)]
    assert replay([same, list(same)]) == 4
    swapped = [coll(0, "b"), wait(0), coll(1, "a"), wait(1)]
    with pytest.raises(NcclDeadlock):
        replay([same, swapped])


def test_sends_match_receives_by_order_not_by_tag():
    # two sends and two receives on one directed communicator: any tags, order decides
    rank0 = [send(0, 1), send(1, 1), wait(0), wait(1)]
    rank1 = [recv(0, 0), recv(1, 0), wait(1), wait(0)]
    assert replay([rank0, rank1]) == 4
    with pytest.raises(NcclDeadlock, match="rank 1"):
        replay([rank0, [recv(0, 0)]])  # a send nobody receives never completes


def _calls(traces: list[list[dict]]) -> list[list[Call]]:
    return [[Call.from_json(c) for c in rank] for rank in traces]


def test_the_old_pipeline_deadlocks_under_nccl():
    """Commit c73aed4's executor: one communicator per pair of stages for both directions, the next
    receive posted right after each action, the activation header read on the host."""
    recorded = json.loads(LEGACY.read_text())["traces"]
    outcome = {}
    for name, traces in recorded.items():
        try:
            replay(_calls(traces))
            outcome[name] = "ok"
        except NcclDeadlock:
            outcome[name] = "deadlock"
    training = {n: o for n, o in outcome.items() if " train_" in n}
    assert len(training) == 16 and set(training.values()) == {"deadlock"}, training
    assert outcome["interleaved_1f1b pp=2 V=2 eval"] == "deadlock"


PIPELINES = [  # (kind, pp, schedule, microbatches, virtual_stages)
    ("llama", 2, "gpipe", 2, 1),
    ("llama", 2, "1f1b", 3, 1),
    ("llama", 2, "zb_h1", 2, 1),
    ("llama_deep", 2, "interleaved_1f1b", 2, 2),
    ("llama_deep", 2, "interleaved_1f1b", 4, 4),
    ("llama", 4, "gpipe", 4, 1),
    ("llama", 4, "1f1b", 4, 1),
    ("llama", 4, "zb_h1", 5, 1),
    ("llama_deep", 4, "interleaved_1f1b", 4, 2),
]


@pytest.mark.parametrize(("kind", "pp", "schedule", "microbatches", "virtual_stages"), PIPELINES)
def test_the_pipeline_completes_under_nccl(worlds, model_dirs, kind, pp, schedule, microbatches, virtual_stages):
    """Every rank's calls of real steps (recorded under gloo) complete under the NCCL model: the first
    training step (with the shape header), a steady one, evaluation and generation."""
    results = worlds.run(pp, nccl_trace_cases.record_pipeline, kind=kind, model_dir=model_dirs[kind], pp=pp,
                         schedule=schedule, microbatches=microbatches, virtual_stages=virtual_stages,
                         generate=True)
    for name in results[0]:
        calls = _calls([r[name] for r in results])
        assert any(c.kind in (SEND, RECV) for rank in calls for c in rank), f"{name}: no transfer was recorded"
        replay(calls)
    # the shape header travels with the first step of a batch shape only: a steady step reads nothing
    # on the host (the first one does, on every stage that receives)
    steady = _calls([r["train_steady"] for r in results])
    assert not [c for rank in steady for c in rank if c.what == SYNC], "a steady training step reads device data"
    first = _calls([r["train_first"] for r in results])
    assert all(any(c.what == SYNC for c in rank) for rank in first[1:])


@pytest.mark.parametrize(("schedule", "microbatches", "virtual_stages"),
                         [("1f1b", 2, 1), ("interleaved_1f1b", 2, 2), ("zb_h1", 2, 1)])
def test_expert_parallel_pipeline_completes_under_nccl(worlds, schedule, microbatches, virtual_stages):
    """dp=2 x pp=2 with experts over ep=2: the dispatch's all-to-alls (and the host read of their
    splits, one per MoE call) between the schedule's transfers complete under the NCCL model."""
    results = worlds.run(4, nccl_trace_cases.record_expert_pipeline, pp=2, dp=2, ep=2, schedule=schedule,
                         microbatches=microbatches, virtual_stages=virtual_stages)
    for name in results[0]:
        calls = _calls([r[name] for r in results])
        assert any(c.kind == COLLECTIVE and c.label.startswith("all_to_all") for rank in calls for c in rank), name
        replay(calls)
