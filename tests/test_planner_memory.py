"""The planner's per-rank memory against a real run: weights, gradients, optimizer state and
activations measured from the tensors themselves (tests/planner_memory_cases.py says how), under
mixed precision, ZeRO-1, both recompute modes, sequence parallelism, context parallelism, expert
parallelism and sharded data parallelism (dp_shard: the gathered weights and whole gradients too; with ep
the experts' own FSDP groups), for GPT-2, Llama and a shrunk Qwen3-MoE (whose runs force uniform routing,
the routing the planner prices).

Weights, gradients and optimizer state exactly on dp (and cp) rank 0 (the rank the estimate
describes; ZeRO's other ranks differ by their pieces' padding: within 5%), activations per
microbatch within 15% (0.1% under ep: with the routing forced uniform only a few scalars differ;
with the model's own routing a rank's activations move with the rows it receives, the
all-to-alls' bytes too, which test_planner.py checks summed over each ep group instead); the
communication of the measured step
(ZeRO's reduce-scatter and all-gather, recomputation's repeated tp collectives and ring forwards,
sequence parallelism's all-gathers and reduce-scatters, ring attention's sends and receives, expert
parallelism's all-to-alls and token gathers, the experts' own gradient buckets, the gradients over
dp x cp, float16's overflow flag) byte for byte and call for call, as ``CommMeter`` counts it, by
group and, for tp, cp and ep, by operation.
"""

from __future__ import annotations

import functools

import pytest

from qn_hf.config.parallel_config import ParallelConfig
from qn_hf.planner.estimate import Planner
from tests import planner_memory_cases
from tests.planner_memory_cases import BUCKET_MB, MOE, MOE_WIDE, ROWS, SEQ, config_for

STATE_TOLERANCE = 0.05
CHUNK_TOKENS = 100  # of ROWS x SEQ = 256 a microbatch: chunks of 50 positions, the third a part one
ACTIVATION_TOLERANCE = 0.15

RUNS = [  # kind, dp, tp, pp, microbatches, mixed_precision, zero, recompute, sequence_parallel, cp
    ("gpt2", 2, 1, 1, 1, None, True, None, False, 1),  # ZeRO without mixed precision: the masters are the weights
    ("gpt2", 1, 2, 2, 2, "bf16", False, "full", False, 1),  # embedding tied across stages, vocab padding
    ("gpt2", 2, 2, 1, 1, "bf16", True, "selective", False, 1),
    ("llama", 2, 1, 1, 1, "bf16", True, "full", False, 1),
    ("llama", 1, 2, 2, 2, None, False, "selective", False, 1),
    ("llama", 2, 2, 1, 1, "fp16", True, None, False, 1),  # loss scaling's overflow flag over the whole job
    # Sequence parallelism: norms' gradients summed over tp, each stage's edges split and gather.
    ("llama", 1, 2, 1, 1, None, False, None, True, 1),
    ("llama", 2, 2, 1, 2, "bf16", True, "full", True, 1),
    ("llama", 1, 2, 2, 2, "bf16", False, "selective", True, 1),
    # Context parallelism: ring attention's saved tensors and sends, gradients over dp x cp.
    ("llama", 1, 1, 1, 2, None, False, None, False, 2),
    ("llama", 1, 2, 1, 1, "bf16", False, None, False, 2),  # 16-bit k/v blocks, float32 gradient blocks
    ("llama", 2, 1, 1, 1, "bf16", True, "full", False, 2),  # ZeRO's pieces 1/4; the ring forward again
    ("llama", 1, 1, 2, 2, None, False, "selective", False, 2),  # the ring's products in the cache
    ("llama", 1, 1, 1, 1, "fp16", True, None, False, 4),  # ZeRO at dp=1; the overflow flag over cp
    # cp x sp: each cp rank's part of the sequence split again over tp between the tp regions
    ("llama", 1, 2, 1, 1, None, False, None, True, 2),
    ("llama", 1, 2, 2, 2, "bf16", False, "selective", True, 2),
    # Modules every stage holds (Gemma 4's per-layer embeddings): on each stage, their gradients summed
    # over pp, in ZeRO buckets of their own
    ("gemma4", 2, 1, 2, 2, "bf16", True, None, False, 1),
]


@functools.cache
def planner(kind: str) -> Planner:
    return Planner(config_for(kind), seq_len=SEQ, micro_batch_size=ROWS)


@pytest.mark.parametrize(("kind", "dp", "tp", "pp", "microbatches", "mixed_precision", "zero", "recompute",
                          "sequence_parallel", "cp"), RUNS)
def test_planner_memory_matches_a_real_run(worlds, kind, dp, tp, pp, microbatches, mixed_precision, zero, recompute,
                                           sequence_parallel, cp):
    settings = dict(dp=dp, tp=tp, pp=pp, microbatches=microbatches, mixed_precision=mixed_precision, zero=zero,
                    recompute=recompute, sequence_parallel=sequence_parallel, cp=cp)
    _compare(worlds, kind, settings)


EP_RUNS = [  # dp, tp, pp, ep, microbatches, mixed_precision, recompute, zero
    (2, 1, 1, 2, 1, None, None, False),  # each rank holds 2 of the 4 experts; no other rank holds the same
    (2, 2, 1, 4, 1, "bf16", None, False),  # tokens split over tp, gathered again; 16-bit all-to-alls
    (2, 1, 2, 2, 2, None, "full", False),  # per stage; recomputation repeats the dispatch's forward all-to-alls
    (2, 2, 1, 2, 1, None, None, False),  # the ep group is the tp group: experts' gradients summed over dp, in own buckets
    # ZeRO-1: the experts' buckets split over the 2 ranks holding each block, the rest over dp
    (2, 2, 1, 2, 1, "bf16", None, True),
    pytest.param(2, 1, 2, 2, 2, None, None, True, marks=pytest.mark.long),  # per stage
    (2, 1, 1, 2, 1, "bf16", "full", True),  # one holder per block: the experts keep whole state
]
EP_CP_ACTIVATION_TOLERANCE = 0.01
EP_CP_RUNS = [  # dp, tp, cp, ep, zero: each cp rank's grid shares out the experts; their gradients sum over cp too
    pytest.param(2, 1, 2, 2, False, marks=pytest.mark.long),
    (1, 2, 2, 2, True),  # the two cp ranks holding each block split its state
]
EP_ACTIVATION_TOLERANCE = 0.001  # routing forced uniform: the planner's routing, so only bytes apart


@pytest.mark.parametrize(("dp", "tp", "pp", "ep", "microbatches", "mixed_precision", "recompute", "zero"), EP_RUNS)
def test_planner_memory_matches_an_expert_parallel_run(worlds, dp, tp, pp, ep, microbatches, mixed_precision,
                                                       recompute, zero):
    _compare(worlds, MOE, dict(dp=dp, tp=tp, pp=pp, ep=ep, microbatches=microbatches, mixed_precision=mixed_precision,
                               zero=zero, recompute=recompute), activation_tolerance=EP_ACTIVATION_TOLERANCE)


@pytest.mark.parametrize(("dp", "tp", "pp", "ep", "microbatches", "mixed_precision", "recompute"), [
    (2, 1, 1, 2, 1, None, None),  # ep times the tokens gathered and held by the experts' call
    (2, 2, 1, 4, 1, "bf16", None),  # tp shares gathered over ep; 16-bit gathers, float32 sums
    (2, 1, 2, 2, 2, None, "full"),  # recomputation gathers again
])
def test_planner_memory_matches_an_all_gather_dispatch_run(worlds, dp, tp, pp, ep, microbatches, mixed_precision,
                                                           recompute):
    """expert_dispatch="all_gather": the experts' call runs on every member's tokens, the other ranks' choices
    as sentinels; what it keeps, as the estimate's stand-in runs it."""
    _compare(worlds, MOE, dict(dp=dp, tp=tp, pp=pp, ep=ep, microbatches=microbatches, mixed_precision=mixed_precision,
                               zero=False, recompute=recompute, expert_dispatch="all_gather"),
             activation_tolerance=EP_ACTIVATION_TOLERANCE)


@pytest.mark.parametrize(("dp", "tp", "ep"), [(1, 2, 2), pytest.param(2, 2, 4, marks=pytest.mark.long)])
def test_planner_memory_matches_an_expert_and_sequence_parallel_run(worlds, dp, tp, ep):
    """ep x sp: each tp rank routes its slice of the sequence; no tp gathers around the dispatch."""
    _compare(worlds, MOE, dict(dp=dp, tp=tp, pp=1, ep=ep, microbatches=1, mixed_precision=None, zero=False,
                               recompute=None, sequence_parallel=True), activation_tolerance=EP_ACTIVATION_TOLERANCE)


@pytest.mark.parametrize(("dp", "tp", "cp", "ep", "zero"), EP_CP_RUNS)
def test_planner_memory_matches_an_expert_and_context_parallel_run(worlds, dp, tp, cp, ep, zero):
    # 8 KiB apart at 2-3 MiB (0.3-0.4%): what the ep runs plan exactly plus what the cp runs do not (ACTIVATION_TOLERANCE)
    _compare(worlds, MOE, dict(dp=dp, tp=tp, pp=1, cp=cp, ep=ep, microbatches=1, mixed_precision=None, zero=zero,
                               recompute=None), activation_tolerance=EP_CP_ACTIVATION_TOLERANCE)


@pytest.mark.parametrize(("schedule", "virtual_stages"), [("interleaved_1f1b", 2), ("zb_h1", 1)])
def test_planner_memory_matches_a_run_per_schedule(worlds, schedule, virtual_stages):
    """interleaved_1f1b, 2 chunks per rank: each chunk's forward keeps what the planner gives that
    chunk, and the pp traffic is each chunk's with its neighbours around the ring of ranks. zb_h1:
    a forward through the deferring layers keeps what the plain layers keep (the W stash after B is
    not measured here)."""
    _compare(worlds, "llama", dict(dp=1, tp=2, pp=2, microbatches=2, mixed_precision="bf16", zero=False, recompute=None,
                                   schedule=schedule, virtual_stages=virtual_stages))


@pytest.mark.parametrize(("kind", "dp", "tp", "pp", "microbatches", "mixed_precision", "recompute", "sequence_parallel",
                          "tolerance"), [
    ("llama", 1, 2, 1, 1, None, None, False, 0.001),  # vocabulary-parallel chunks: the loss's all-reduces, twice each
    ("gpt2", 2, 2, 1, 1, "bf16", "selective", True, ACTIVATION_TOLERANCE),  # the head on sp's gathered sequence
    ("gemma2", 1, 1, 2, 2, "bf16", None, False, 0.01),  # a soft-capping's tanh the whole logits would keep: 1.5%
])
def test_planner_memory_matches_a_chunked_loss_run(worlds, kind, dp, tp, pp, microbatches, mixed_precision, recompute,
                                                   sequence_parallel, tolerance):
    """loss_chunk_tokens (step/loss_chunks.py): the last stage keeps its targets, not the softmax of the whole
    vocabulary nor what the head's tail keeps; at tp each chunk all-reduces the head's input gradient, and the
    vocab-parallel loss's two all-reduces run in the forward and again in the backward's recomputation."""
    _compare(worlds, kind, dict(dp=dp, tp=tp, pp=pp, microbatches=microbatches, mixed_precision=mixed_precision,
                                zero=False, recompute=recompute, sequence_parallel=sequence_parallel,
                                loss_chunk_tokens=CHUNK_TOKENS), activation_tolerance=tolerance)


@pytest.mark.parametrize(("kind", "dp", "tp", "pp", "cp", "microbatches", "recompute", "sequence_parallel"), [
    ("llama", 1, 1, 2, 1, 4, "full", False),  # 1F1B: two microbatches' block inputs on the first stage's host
    ("gpt2", 1, 2, 1, 1, 1, "full", True),  # the blocks' inputs a sequence slice
    ("llama", 1, 2, 2, 1, 4, "full", True),  # a later stage gathers and splits what it received: that moves too
    ("llama", 1, 1, 1, 2, 2, "selective", False),  # one cp rank's tokens; selective's cache stays on the device
])
def test_planner_memory_matches_an_offloaded_run(worlds, kind, dp, tp, pp, cp, microbatches, recompute,
                                                 sequence_parallel):
    """offload="activations" (memory/offload.py): what the blocks' checkpoints hold on the host, as the trace saw
    them saved (planner/trace.py), per microbatch and at the schedule's peak (the offload's own count of the
    host bytes it held at once). On a CPU the host is the device, so the measured activations are the planner's
    device figure and its host figure together."""
    _compare(worlds, kind, dict(dp=dp, tp=tp, pp=pp, cp=cp, microbatches=microbatches, mixed_precision=None,
                                zero=False, recompute=recompute, sequence_parallel=sequence_parallel,
                                offload="activations"))


@pytest.mark.parametrize(("recompute", "loss_chunk_tokens", "offload"), [
    (None, None, None),  # the whole logits' softmax kept, their two gradients in the loss's backward
    (None, 128, None),  # a chunk's log-softmax remade and its two gradients
    ("full", 128, "activations"),  # and the blocks' inputs on the host (the same memory on a CPU)
])
def test_planner_peak_matches_a_long_sequence_step(worlds, recompute, loss_chunk_tokens, offload):
    """At a long sequence through a large vocabulary the loss's backward is most of a step's peak: the planner's
    activations (device and host) and that moment (``loss_transient``), against the most bytes the storages the
    step made held at once (the gradients held from the last step), within 5%."""
    (measured,) = worlds.run(1, planner_memory_cases.measure_step_peak, recompute=recompute,
                             loss_chunk_tokens=loss_chunk_tokens, offload=offload)
    from transformers import AutoConfig

    config = AutoConfig.for_model("llama", **planner_memory_cases.LONG_LOSS)
    est = Planner(config, seq_len=planner_memory_cases.LONG_SEQ, micro_batch_size=1).estimate(
        ParallelConfig.from_keywords(recompute=recompute, loss_chunk_tokens=loss_chunk_tokens, offload=offload))
    (stage,) = est.stages
    planned = stage.activation_bytes + stage.host_bytes + stage.transient_bytes
    assert abs(planned - measured) <= 0.05 * measured, (planned, measured, stage)


SHARDED_RUNS = [  # kind, dp, dp_shard, tp, pp, cp, microbatches, mixed_precision, recompute, sequence_parallel, gather
    ("llama", 2, 2, 1, 1, 1, 2, "bf16", None, False, "step"),  # per microbatch: root once, blocks twice, all reduced
    ("llama", 2, 2, 1, 2, 1, 2, "bf16", None, False, "step"),  # a stage gathered once, whole gradients until the end
    ("gpt2", 2, 2, 1, 2, 1, 2, None, "full", False, "microbatch"),  # the tied copy's rows summed over the pair
    pytest.param("llama", 4, 2, 1, 1, 1, 1, None, None, False, "step", marks=pytest.mark.long),  # hybrid
    pytest.param("llama", 2, 2, 2, 1, 1, 1, "bf16", None, True, "step", marks=pytest.mark.long),  # tp shard's rows
    pytest.param("llama", 2, 2, 1, 1, 2, 1, "bf16", None, False, "step", marks=pytest.mark.long),  # over dp_shard x cp
]


@pytest.mark.parametrize(("kind", "dp", "dp_shard", "tp", "pp", "cp", "microbatches", "mixed_precision", "recompute",
                          "sequence_parallel", "gather"), SHARDED_RUNS)
def test_planner_memory_matches_a_sharded_data_parallel_run(worlds, kind, dp, dp_shard, tp, pp, cp, microbatches,
                                                            mixed_precision, recompute, sequence_parallel, gather):
    """dp_shard (planner/sharded.py): the shards, their gradients and AdamW's moments exactly (every
    rank stores the same padded rows); exactly on every rank, the whole weights FSDP holds gathered at
    once (after any op: the parameters swapped in whole, views of their padded all-gather outputs, and
    the all-gather outputs still alive); under a pipeline, the whole gradients the step's reduction
    frees; FSDP's all-gathers, reduce-scatters and hybrid
    all-reduces call for call and byte for byte."""
    _compare(worlds, kind, dict(dp=dp, dp_shard=dp_shard, tp=tp, pp=pp, cp=cp, microbatches=microbatches,
                                mixed_precision=mixed_precision, zero=False, recompute=recompute,
                                sequence_parallel=sequence_parallel, dp_shard_gather=gather))


SHARDED_EP_RUNS = [  # kind, dp, dp_shard, tp, pp, cp, ep, microbatches, mixed_precision
    # one expert replica (dp x tp / ep = 1): FSDP leaves the experts whole (float32, their gradients in .grad)
    (MOE, 2, 2, 1, 1, 1, 2, 2, "bf16"),
    # the experts' own groups over the 2 ranks holding the same experts, the rest hybrid (dp_replicate);
    # experts wider than the rest of a block: gathered, 2 blocks and 2 experts groups at once
    (MOE_WIDE, 4, 2, 1, 1, 1, 2, 2, None),
    # tp: the experts' groups across dp; a block outweighs its experts: 3 blocks and 1 experts group at once
    pytest.param(MOE, 2, 2, 2, 1, 1, 2, 1, "bf16", marks=pytest.mark.long),
    pytest.param(MOE, 2, 2, 1, 2, 1, 2, 2, None, marks=pytest.mark.long),  # per stage, the experts whole
    # per stage, the experts' groups over the 2 cp ranks: the stage gathered once, the last experts' output too
    pytest.param(MOE_WIDE, 2, 2, 1, 2, 2, 2, 2, None, marks=pytest.mark.long),
]


@pytest.mark.parametrize(("kind", "dp", "dp_shard", "tp", "pp", "cp", "ep", "microbatches", "mixed_precision"),
                         SHARDED_EP_RUNS)
def test_planner_memory_matches_a_sharded_expert_parallel_run(worlds, kind, dp, dp_shard, tp, pp, cp, ep,
                                                              microbatches, mixed_precision):
    """dp_shard x ep (planner/sharded.py): the experts in FSDP groups of their own over their expert
    replicas (or whole, with one), the rest as without ep; shards, gradients, AdamW state and gathered
    weights exactly, FSDP's traffic on dp_shard, dp_replicate and experts call for call and byte for
    byte, activations as the other ep runs (uniform routing; with cp as the ep x cp runs)."""
    _compare(worlds, kind, dict(dp=dp, dp_shard=dp_shard, tp=tp, pp=pp, cp=cp, ep=ep, microbatches=microbatches,
                                mixed_precision=mixed_precision, zero=False, recompute=None),
             activation_tolerance=EP_CP_ACTIVATION_TOLERANCE if cp > 1 else EP_ACTIVATION_TOLERANCE)


def _compare(worlds, kind: str, settings: dict, *, activation_tolerance: float = ACTIVATION_TOLERANCE) -> None:
    parallel = ParallelConfig.from_keywords(bucket_mb=BUCKET_MB, **{k: v for k, v in settings.items() if k != "zero"})
    est = planner(kind).estimate(parallel, zero=settings["zero"], backend="gloo")
    world = settings["dp"] * settings["tp"] * settings["pp"] * settings.get("cp", 1)
    measured = worlds.run(world, planner_memory_cases.measure, kind=kind, **settings)
    rows = []
    for r in measured:
        stage = est.stages[r["coords"]["pp"]]
        planned = {"weight_bytes": stage.weight_bytes, "grad_bytes": stage.grad_bytes,
                   "optimizer_bytes": stage.optimizer_bytes, "activation_bytes": max(stage.chunk_activation_bytes)}
        if settings.get("offload"):  # one chunk a stage; on a CPU the host copies are in the measured activations
            planned |= {"activation_bytes": stage.activation_bytes_per_microbatch + stage.offloaded_bytes_per_microbatch,
                        "host_bytes": stage.host_bytes}
        if settings.get("dp_shard", 1) > 1:
            planned |= {"gathered_bytes": stage.gathered_bytes, "accumulated_grad_bytes": stage.accumulated_grad_bytes}
        rows.append((r["coords"], {k: (r[k], v) for k, v in planned.items()}))
    table = "\n".join(f"{c}: " + ", ".join(f"{k} measured {m:,} planned {p:,}" for k, (m, p) in v.items())
                      for c, v in rows)
    for coords, values in rows:
        for what, (real, planned) in values.items():
            tolerance = activation_tolerance if what == "activation_bytes" else STATE_TOLERANCE
            # replica 0 (of the experts too): the rank the estimate describes
            first = coords["dp"] == 0 and coords.get("cp", 0) == 0 and not coords.get("expert_replica")
            if what not in ("activation_bytes", "gathered_bytes") and first or what in ("gathered_bytes", "host_bytes"):
                tolerance = 0  # dp_shard: every rank gathers the same padded weights
            assert abs(planned - real) <= tolerance * real, f"{coords} {what}\n{table}"
    for r in measured:
        stage = est.stages[r["coords"]["pp"]]
        assert stage.params == r["params"], (r["coords"], stage.params, r["params"])
        predicted = {g: [t.calls, t.nbytes] for g, t in stage.comm.items()}
        for group in ("tp", "cp", "ep"):
            predicted.update({f"{group}:{op}": list(v) for op, v in stage.comm[group].ops.items()}
                             if group in stage.comm else {})
        real = {**r["comm"], **{k: v for k, v in r["comm_ops"].items() if k.startswith(("tp:", "cp:", "ep:"))}}
        if (settings["zero"] or settings.get("dp_shard", 1) > 1) and (r["coords"]["dp"] > 0 or r["coords"].get("cp", 0) > 0):
            # Under ZeRO (dp_shard) the gradients summed over tp (a tie, pp) are this rank's pieces (rows)
            # of them: the estimate gives dp rank 0's; another rank's cover other elements of those parameters.
            for key in [k for k in ("tp", "tp:all_reduce", "tie", "pp") if k in predicted]:
                assert abs(predicted[key][1] - real[key][1]) <= STATE_TOLERANCE * real[key][1], (r["coords"], key)
                predicted[key][1] = real[key][1]
        assert predicted == real, (r["coords"], predicted, r["comm_ops"])
