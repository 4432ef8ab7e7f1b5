"""The pipeline's real communication calls, replayed through a model of NCCL's semantics.

gloo runs what NCCL would hang on (its sends progress on their own, it matches by tag, a first use
costs nothing), so a pipeline proven on CPU could deadlock at its first GPU step. The model
(qn_hf/pipeline/nccl_replay.py) is checked on small hand-written cases, then on the calls that the
pipeline of commit c73aed4 made (recorded in tests/data; every training step deadlocks there, as
the issue found by reading the code), then on the calls of today's code recorded live from
``parallelize`` on (the links' warm-up included), for every schedule at pp = 2 and 4, with dp, tp,
sp, cp, ep and dp_shard, evaluation and generation included, while NCCL's first-use rule is
emulated on gloo (tests/nccl_first_use.py). With the warm-up removed, the replay and the emulation
both find the hang that a GPU would.
"""

from __future__ import annotations

import json
from collections import Counter
from pathlib import Path

import pytest

from qn_hf.pipeline.nccl_replay import (
    COLLECTIVE,
    CREATE,
    CUDA_STREAM_POOL,
    DEVICE_SYNC,
    POST,
    RECV,
    SEND,
    SYNC,
    WAIT,
    Call,
    NcclDeadlock,
    device_waits,
    replay,
)
from qn_hf.pipeline.p2p import WARM_UP_TAG
from tests import nccl_trace_cases
from tests.nccl_trace_cases import FEATURES, world_size

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
        replay([stage0, stage1], first_use=False)
    # the same calls with a communicator per direction complete, once each communicator exists
    stage0 = [recv(0, 1, "1->0"), send(1, 1, "0->1"), wait(1), wait(0)]
    stage1 = [recv(0, 0, "0->1"), wait(0), send(1, 0, "1->0"), wait(1)]
    assert replay([stage0, stage1], first_use=False) == 4


def test_a_host_read_blocks_what_the_host_would_post_after_it():
    # rank 1 reads a received header on the host before it can send what rank 0 waits for
    rank0 = [recv(0, 1, "1->0"), wait(0), Call(SYNC), send(1, 1, "0->1"), wait(1)]
    rank1 = [recv(0, 0, "0->1"), wait(0), Call(SYNC), send(1, 0, "1->0"), wait(1)]
    with pytest.raises(NcclDeadlock, match="host blocked"):
        replay([rank0, rank1], first_use=False)
    # without the reads, the device waits alone cannot block the host from posting: still a cycle,
    # because each send is gated on a compute stream that waits for the other's receive
    with pytest.raises(NcclDeadlock):
        replay([[c for c in rank0 if c.what != SYNC], [c for c in rank1 if c.what != SYNC]], first_use=False)


def test_collectives_must_be_issued_in_the_same_order():
    def coll(op: int, group: str) -> Call:
        return Call(POST, op=op, group=group, kind=COLLECTIVE, members=(0, 1), label=f"collective on {group}")

    same = [coll(0, "a"), wait(0), coll(1, "b"), wait(1)]
    assert replay([same, list(same)]) == 4
    swapped = [coll(0, "b"), wait(0), coll(1, "a"), wait(1)]
    with pytest.raises(NcclDeadlock):
        replay([same, swapped], first_use=False)


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


def test_a_first_use_blocks_the_host_until_the_peer_uses_the_communicator_too():
    """The hang of issue 45: with a communicator per direction, stage 0's first call is the receive
    from stage 1 (posted ahead), stage 1's the receive from stage 0; each host waits for the other's
    first use of a communicator it has not reached. A warm-up over the links in one global order
    (0->1, then 1->0) creates both first."""
    stage0 = [recv(0, 1, "1->0"), send(1, 1, "0->1"), wait(1), wait(0)]
    stage1 = [recv(0, 0, "0->1"), wait(0), send(1, 0, "1->0"), wait(1)]
    with pytest.raises(NcclDeadlock, match=r"first use of communicator 1->0:0-1 waits for rank\(s\) \[1\]"):
        replay([stage0, stage1])
    warm0 = [send(10, 1, "0->1"), wait(10), recv(11, 1, "1->0"), wait(11)]
    warm1 = [recv(10, 0, "0->1"), wait(10), send(11, 0, "1->0"), wait(11)]
    assert replay([warm0 + stage0, warm1 + stage1]) == 8
    # a warm-up in an order the two ranks do not share hangs itself
    with pytest.raises(NcclDeadlock, match="first use"):
        replay([warm0 + stage0, warm1[2:] + warm1[:2] + stage1])


def test_collective_communicators_exist_with_their_group_or_at_first_use():
    def coll(op: int, group: str) -> Call:
        return Call(POST, op=op, group=group, kind=COLLECTIVE, members=(0, 1), label=f"collective on {group}")

    create = Call(CREATE, group="a", members=(0, 1))
    warm0, warm1 = [send(9, 1, "x"), wait(9)], [recv(9, 0, "x"), wait(9)]
    # rank 0 reads a value from rank 1 on the host before its first collective on group a; rank 1
    # makes its first collective on a before it sends that value
    rank0 = [create, *warm0, recv(0, 1, "x"), wait(0), Call(SYNC), coll(1, "a"), wait(1)]
    rank1 = [create, *warm1, coll(1, "a"), send(0, 0, "x"), wait(0), wait(1)]
    assert replay([rank0, rank1]) == 6  # eager: created with the group, its first collective blocks nothing
    with pytest.raises(NcclDeadlock, match="first use of communicator a waits for rank"):
        replay([rank0, rank1], eager=False)  # lazy: rank 1's first collective waits for rank 0's host


def test_device_synchronize_waits_for_posted_receives():
    """``torch.cuda.synchronize`` waits for every stream: a receive posted ahead holds the host until
    its peer sends, which a host read of the compute stream would not."""
    rank0 = [recv(0, 1, "1->0"), Call(DEVICE_SYNC), send(1, 1, "0->1"), wait(1), wait(0)]
    rank1 = [recv(0, 0, "0->1"), wait(0), Call(SYNC), send(1, 0, "1->0"), wait(1)]
    with pytest.raises(NcclDeadlock, match="device_sync"):
        replay([rank0, rank1], first_use=False)
    compute_only = [recv(0, 1, "1->0"), Call(SYNC), send(1, 1, "0->1"), wait(1), wait(0)]
    assert replay([compute_only, rank1], first_use=False) == 4


def test_a_device_wide_wait_anywhere_finds_a_gradient_receive_posted_ahead():
    """Issue 67: stage 0 posts the gradient's receive right after sending the activation (as the runtime did); a
    device-wide wait after that (an allocator retry) waits for the gradient, which stage 1 sends only after a
    second activation stage 0 would send after the wait. Posted when the schedule reaches it, no place
    deadlocks."""
    ahead = [send(1, 1, "0->1"), recv(0, 1, "1->0"), send(2, 1, "0->1"), wait(0), wait(1), wait(2)]
    stage1 = [recv(1, 0, "0->1"), wait(1), recv(2, 0, "0->1"), wait(2), send(0, 0, "1->0"), wait(0)]
    assert replay([ahead, stage1], first_use=False) == 6  # without a device-wide wait it completes
    found = device_waits([ahead, stage1], first_use=False)
    assert [(rank, position) for rank, position, _ in found] == [(0, 2)], found
    assert device_waits([ahead, stage1], first_use=False, every_gap=True) == found  # the one place in every gap
    assert "a device-wide wait (allocator retry, autotuning)" in found[0][2], found[0][2]
    in_order = [send(1, 1, "0->1"), send(2, 1, "0->1"), recv(0, 1, "1->0"), wait(0), wait(1), wait(2)]
    assert device_waits([in_order, stage1], first_use=False, every_gap=True) == []


def test_communicators_beyond_the_stream_pool_share_streams():
    """Past CUDA's 32 pooled streams a new communicator queues on an earlier one's stream: a receive
    waiting there holds up an unrelated send."""
    def traces(between: int) -> list[list[Call]]:
        # both ranks use communicator "early", then ``between`` others, then "late" (the default
        # group took the pool's first stream); rank 0 posts a receive on early before its send on late
        rank0, rank1 = [send(90, 1, "early"), wait(90)], [recv(90, 0, "early"), wait(90)]
        for i in range(between):
            rank0 += [send(100 + i, 1, f"g{i}"), wait(100 + i)]
            rank1 += [recv(100 + i, 0, f"g{i}"), wait(100 + i)]
        rank0 += [recv(0, 1, "early"), send(1, 1, "late"), wait(1), wait(0)]
        rank1 += [recv(1, 0, "late"), wait(1), send(0, 0, "early"), wait(0)]
        return [rank0, rank1]

    assert replay(traces(CUDA_STREAM_POOL - 2), first_use=False) > 0
    with pytest.raises(NcclDeadlock):
        replay(traces(CUDA_STREAM_POOL - 1), first_use=False)  # late takes early's stream
    assert replay(traces(CUDA_STREAM_POOL - 1), first_use=False, pool=None) > 0


SCHEDULES = [  # (schedule, microbatches, virtual_stages)
    ("gpipe", 2, 1),
    ("1f1b", 3, 1),
    ("zb_h1", 2, 1),
    ("interleaved_1f1b", 2, 2),
]
# without the warm-up, with receives posted ahead of sends as before issue 67 (interleaved's first uses happen to
# agree); posted after the sends before them, no schedule's first use waits on a peer's that comes later
HANG_AT_FIRST_USE = {"gpipe", "1f1b", "zb_h1"}


def _mesh(feature: str, pp: int, schedule: str, microbatches: int, virtual_stages: int) -> dict:
    mb = max(microbatches, pp) if schedule == "interleaved_1f1b" else microbatches
    return {**FEATURES[feature], "pp": pp, "schedule": schedule, "microbatches": mb, "virtual_stages": virtual_stages}


def _kind(feature: str, schedule: str) -> str:
    if feature == "ep":  # (interleaved at pp=4 x V=2 needs 8 blocks: the 4-block model was refused)
        return "qwen3_moe_deep" if schedule == "interleaved_1f1b" else "qwen3_moe"
    return "llama_deep" if schedule == "interleaved_1f1b" else "llama"


# make test: every schedule at pp=2 and pp=4 alone (one more with V=4), and at dp=2 x pp=2 and tp=2 x pp=2;
# sp, cp, ep and dp_shard at pp=2 with 1F1B and interleaved 1F1B. make test-all: every schedule with
# every feature at pp=2 and pp=4 (8 ranks).
IN_SUITE = {"plain": {2, 4}, "dp": {2}, "tp": {2}}


def _in_suite(feature: str, pp: int, schedule: str) -> bool:
    if feature in IN_SUITE:
        return pp in IN_SUITE[feature]
    return pp == 2 and schedule in ("1f1b", "interleaved_1f1b")


CASES = [pytest.param(feature, pp, *schedule, marks=() if _in_suite(feature, pp, schedule[0]) else pytest.mark.long)
         for pp in (2, 4) for feature in FEATURES for schedule in SCHEDULES]
CASES.append(pytest.param("plain", 2, "interleaved_1f1b", 4, 4))


def _without_warm_up(calls: list[Call]) -> list[Call]:
    """The calls with the links' warm-up taken out (its operations and their waits)."""
    warm = {c.op for c in calls if c.what == POST and c.label.endswith(f"tag {WARM_UP_TAG}")}
    return [c for c in calls if c.op not in warm or c.what not in (POST, WAIT)]


def _part(result: dict, name: str) -> list[Call]:
    start, stop = result["marks"][name]
    return [Call.from_json(c) for c in result["calls"][start:stop]]


@pytest.mark.parametrize(("feature", "pp", "schedule", "microbatches", "virtual_stages"), CASES)
def test_every_step_completes_under_nccl(worlds, model_dirs, feature, pp, schedule, microbatches, virtual_stages):
    """Every rank's calls from ``parallelize`` through two training steps, an evaluation (and for a
    plain pipeline a ``generate``), recorded under gloo with NCCL's first-use rule emulated, complete
    under the NCCL model, whether the groups' communicators are created with them or at first use;
    with the links' warm-up taken out they complete too (no receive is posted ahead of a send: no first use
    waits on a peer's that comes later; the warm-up stays, test_without_the_warm_up_... shows what it covered)."""
    mesh = _mesh(feature, pp, schedule, microbatches, virtual_stages)
    kind = _kind(feature, schedule)
    results = worlds.run(world_size(mesh), nccl_trace_cases.record_steps, kind=kind, model_dir=model_dirs.get(kind),
                         mesh=mesh, generate=feature == "plain")
    calls = [[Call.from_json(c) for c in r["calls"]] for r in results]
    assert all(any(c.kind in (SEND, RECV) for c in rank) for rank in calls), "a rank recorded no transfer"
    replay(calls)
    replay(calls, eager=False)
    # a device-wide wait (allocator retry, autotuning) may fall between any two host calls of the training steps
    steps = [range(r["marks"]["train_first"][0], r["marks"]["train_steady"][1] + 1) for r in results]
    assert device_waits(calls, within=steps) == [], "a device-wide wait deadlocks the steps"
    replay([_without_warm_up(rank) for rank in calls])
    # fewer communicators per rank than CUDA's stream pool has streams: none shares a stream today
    # (the replay models sharing, test_communicators_beyond_the_stream_pool_share_streams)
    for rank, trace in enumerate(calls):
        communicators = {c.group for c in trace if c.what == CREATE or c.kind == COLLECTIVE}
        communicators |= {(c.group, *sorted((rank, c.peer))) for c in trace if c.kind in (SEND, RECV)}
        assert len(communicators) + 1 <= CUDA_STREAM_POOL, (rank, len(communicators))
    # the activations' shape header is read on the host in the first step only, by every stage that
    # receives; nothing of qn_hf's reads the device on the host in a steady step (transformers' mask
    # code does, per microbatch, as it does in the plain model)
    for r, result in enumerate(results):
        first, steady = _part(result, "train_first"), _part(result, "train_steady")
        reads_header = any(c.what == SYNC and "qn_hf/pipeline/wire.py" in c.label for c in first)
        assert reads_header == (r in _receivers(results, pp)), (r, [c.label for c in first if c.what == SYNC])
        ours = Counter(c.label.rsplit(" at ", 1)[1].split(":")[0] for c in steady
                       if c.what in (SYNC, DEVICE_SYNC) and " at qn_hf/" in c.label)
        assert all(n <= STEADY_READS.get(site, 0) for site, n in ours.items()), f"rank {r}: steady host reads {ours}"


# qn_hf's host reads of a steady step, per file: the MoE split sizes, one per MoE call (dispatch.py says
# why), and whether ring attention masks: once per step, from the batch before it moves to the device
# (context_parallel/apply.py), so on a GPU no read of the device when the batch comes from the host,
# as it does here (on CPU the recorder cannot tell host from device).
STEADY_READS = {"qn_hf/expert_parallel/dispatch.py": 10**6, "qn_hf/context_parallel/ring_attention.py": 1}


def _receivers(results: list[dict], pp: int) -> set[int]:
    """The ranks whose stage receives activations: every stage but the first (with virtual stages,
    the first too: its later chunks receive from the last stage)."""
    return {r for r, result in enumerate(results) if result["stage"] > 0 or result["virtual_stages"] > 1}


@pytest.mark.parametrize("schedule", [s if s == "1f1b" else pytest.param(s, marks=pytest.mark.long)
                                      for s in sorted(HANG_AT_FIRST_USE)])
def test_without_the_warm_up_a_first_use_hangs_on_gloo_too(worlds, model_dirs, schedule):
    """The emulated first-use rule alone, on a real run, with receives posted ahead of sends (the runtime before
    issue 67): without the links' warm-up the first step waits forever (each rank's first use of a link waits for
    the peer's), in the replay too; the warm-up prevents it."""
    mesh = _mesh("plain", 2, schedule, *{s: (m, v) for s, m, v in SCHEDULES}[schedule])
    results = worlds.run(2, nccl_trace_cases.record_steps, kind="llama", model_dir=model_dirs["llama"], mesh=mesh,
                         warm_up=False, ahead_of_sends=True)
    assert all("under NCCL this hangs" in r.get("hang", "") for r in results), results
    warmed = worlds.run(2, nccl_trace_cases.record_steps, kind="llama", model_dir=model_dirs["llama"], mesh=mesh,
                        ahead_of_sends=True)
    calls = [[Call.from_json(c) for c in r["calls"]] for r in warmed]
    replay(calls)
    with pytest.raises(NcclDeadlock, match="first use of communicator"):
        replay([_without_warm_up(rank) for rank in calls])


@pytest.mark.parametrize(("pp", "schedule", "microbatches", "virtual_stages"),
                         [(2, "1f1b", 3, 1), (2, "gpipe", 2, 1), (2, "zb_h1", 2, 1)])
def test_gradient_receives_posted_ahead_deadlock_under_a_device_wide_wait(worlds, model_dirs, pp, schedule,
                                                                         microbatches, virtual_stages):
    """Issue 67: with receives posted ahead of sends (the runtime before it), a device-wide wait deadlocks these
    schedules at some place of the training steps; the runtime now posts a receive only after the sends before it
    (test_every_step_completes_under_nccl finds no such place)."""
    mesh = _mesh("plain", pp, schedule, microbatches, virtual_stages)
    results = worlds.run(world_size(mesh), nccl_trace_cases.record_steps, kind="llama", model_dir=model_dirs["llama"],
                         mesh=mesh, ahead_of_sends=True)
    calls = [[Call.from_json(c) for c in r["calls"]] for r in results]
    steps = [range(r["marks"]["train_first"][0], r["marks"]["train_steady"][1] + 1) for r in results]
    assert device_waits(calls, within=steps), "the old posting should deadlock somewhere"
