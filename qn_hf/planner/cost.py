"""A deliberately simple step-time model for ranking meshes (not a performance prediction).

For each pipeline stage, one microbatch costs

    compute = (6 * matmul parameters on the rank + attention FLOPs / tp) * tokens / cp / FLOP rate
              (``StageEstimate.flops_per_microbatch`` / cp / FLOP rate; times 4/3 with full
              recomputation: the stage's forward runs twice; selective recomputation only redoes
              elementwise work, counted as free); routed experts' parameters count at
              ``MeshEstimate.expert_flop_share`` (K of E experts per token)
    tp      = per microbatch, over the tp link bandwidth, a ring's bytes on the wire per byte of
              payload (as CommMeter counts it): all-reduce 2 (tp-1)/tp, reduce-scatter (tp-1)/tp of
              its whole input, all-gather (tp-1) times its slice
    cp      = ring attention's bytes sent per microbatch (traffic.py: key/value blocks forward and
              backward, float32 gradient blocks backward, the forward again under recomputation) /
              cp link bandwidth; each rank sends and receives at once, so the sends set the time.
              qn_hf posts each transfer before the attention of the block in hand and waits after
              it, so a link faster than that attention hides the ring; counted as not hidden (slow)
    pp      = 2 * hidden-state bytes / pp link bandwidth          (activation forward, gradient back)
    ep      = expert parallelism's all-to-all payload per microbatch (traffic.py, at uniform routing)
              * (ep-1)/ep (the share that leaves the rank) / ep link bandwidth; it sits between the
              router and the experts, on the critical path

(with V chunks per rank, interleaved_1f1b, the pp term V times: each chunk sends and receives), and
the pipeline takes the schedule's own time: every rank's action list timed
(``schedule_check.timed``) with the slowest stage's microbatch cut into per-op costs F, B and
zb_h1's W, an even share per chunk (``schedules.op_costs``: the forward a third of the compute, the
backward the rest plus the forward again under full recomputation, W the deferred linears' weight
gradients taken out of B, communication half with F and half with B); for 1F1B and GPipe that is
(microbatches + pp - 1) times the slowest stage's microbatch, as it always was. Data parallelism
adds, for the largest stage, a ring all-reduce of the gradients over the R = dp x cp replicas, 2
(R-1)/R * gradient bytes / link bandwidth, or with ZeRO a reduce-scatter of the gradients and an
all-gather of the weights, (R-1)/R * (gradient + weight bytes) / bandwidth; under ep the experts'
gradients are all-reduced over their own X = dp x tp / ep ranks instead, 2 (X-1)/X * their bytes /
that group's link; assumed not overlapped with backward (qn_hf overlaps the last microbatch's
backward, so this errs slow). Under dp_shard (FSDP over W = dp_shard x cp ranks) it adds instead
FSDP's traffic (sharded.py): its all-gathers, (W-1) times each shard, and reduce-scatters, (W-1)/W
of each input, over the dp_shard link, and with dp_shard < dp the hybrid all-reduce of the reduced
shards, 2 (R-1)/R of them over R = dp / dp_shard groups, and under ep the experts' own groups, as
the blocks' over their X ranks on the experts link (instead of the experts' all-reduce above);
counted as not overlapped either, though
FSDP prefetches the next block's all-gather during compute (errs slow). A group's link is NVLink
when all its ranks share a node (ranks are laid out dp, pp, cp, tp with tp fastest; an ep group is ep consecutive ranks of a stage's dp x tp
grid) and InfiniBand otherwise. Ring attention's own matrix products (float32, unfused) are counted
at the stated rate like the rest: an optimistic figure.
"""

from __future__ import annotations

from dataclasses import dataclass

from ..comm_meter import Collective
from ..config.dims import Axis
from ..config.options import Recompute
from .results import MeshEstimate
from .schedules import op_costs, pipeline_timing

GIB = 1024**3


@dataclass(frozen=True)
class Hardware:
    gpu_memory: int = 80 * GIB
    gpus_per_node: int = 8
    tflops: float = 400.0  # sustained dense FLOP/s per GPU, in TFLOP/s (bf16 on an H100 at ~40% of peak)
    nvlink_gbps: float = 450.0  # GB/s per GPU inside a node
    ib_gbps: float = 50.0  # GB/s per GPU across nodes (one 400 Gb/s NIC per GPU)


@dataclass(frozen=True)
class StepTime:
    seconds: float
    compute: float  # pipeline compute including the bubble
    tp: float
    pp: float
    dp: float  # the gradients' reduction over dp x cp
    cp: float  # ring attention
    tokens_per_s: float
    utilization: float  # model FLOPs per second / (GPUs * stated FLOP rate)
    ep: float = 0.0  # expert parallelism's all-to-alls


def _tp_wire_bytes(ops: dict[Collective, tuple[int, int]], *, tp: int) -> float:
    """Bytes a ring moves for these payloads (sequence parallelism's reduce-scatter and all-gather
    together move what the all-reduce they replace moves)."""
    per_byte = {Collective.ALL_REDUCE: 2 * (tp - 1) / tp, Collective.REDUCE_SCATTER_TENSOR: (tp - 1) / tp,
                Collective.ALL_GATHER_INTO_TENSOR: tp - 1}
    return sum(per_byte.get(op, 2 * (tp - 1) / tp) * nbytes for op, (_, nbytes) in ops.items())


def _fsdp_seconds(comm: dict, *, width: int, groups: int, expert_width: int, link: dict[str, float]) -> float:
    """FSDP's all-gathers, reduce-scatters and hybrid all-reduces of one step on the wire (cost.py's
    docstring), over their links; the experts' own groups over theirs."""
    def wire(ops: dict, ranks: int) -> float:
        return ((ranks - 1) * ops[Collective.ALL_GATHER_INTO_TENSOR][1]
                + (ranks - 1) / ranks * ops[Collective.REDUCE_SCATTER_TENSOR][1])

    across = 2 * (groups - 1) / groups * comm[Axis.DP_REPLICATE].nbytes if Axis.DP_REPLICATE in comm else 0.0
    experts = comm.get("experts")  # the experts' own groups, over their link
    own = wire(experts.ops, expert_width) / link["experts"] if experts is not None else 0.0
    return wire(comm["dp_shard"].ops, width) / link["dp_shard"] + across / link["dp_replicate"] + own


def links(est: MeshEstimate, hw: Hardware) -> dict[str, str]:
    """Which link each group uses ("dp": the gradients' group, dp x cp; the cp group alone at dp=1;
    "experts": the ranks holding the same experts, across dp rows unless dp=1)."""
    node = hw.gpus_per_node
    stage = est.pp * est.cp * est.tp  # ranks from one dp row to the next
    span = {"tp": est.tp, "cp": est.cp * est.tp, "pp": stage,
            "dp": est.world_size if est.dp > 1 else est.cp * est.tp,
            "ep": est.ep if est.ep <= est.tp else est.ep // est.tp * stage,
            "experts": est.world_size if est.dp > 1 else est.tp,
            "dp_shard": est.dp_shard * stage if est.dp_shard > 1 else est.cp * est.tp, "dp_replicate": est.world_size}
    return {group: "nvlink" if ranks <= node else "ib" for group, ranks in span.items()}


def step_time(est: MeshEstimate, hw: Hardware) -> StepTime:
    bandwidth = {"nvlink": hw.nvlink_gbps * 1e9, "ib": hw.ib_gbps * 1e9}
    link = {g: bandwidth[kind] for g, kind in links(est, hw).items()}
    rate = hw.tflops * 1e12
    tokens = est.tokens_per_microbatch
    slowest = compute_mb = tp_mb = pp_mb = cp_mb = ep_mb = 0.0
    costs = {}
    for s in est.stages:
        plain = s.flops_per_microbatch / est.cp / rate  # forward and backward, without recomputation
        c = plain * (4 / 3 if est.recompute == Recompute.FULL else 1)
        t = _tp_wire_bytes(s.comm["tp"].ops, tp=est.tp) / est.microbatches / link["tp"] if Axis.TP in s.comm else 0.0
        r = s.comm["cp"].ops.get(Collective.SEND, (0, 0))[1] / est.microbatches / link["cp"] if Axis.CP in s.comm else 0.0
        # the activation out, its gradient back, per chunk
        p = 2 * est.virtual_stages * est.boundary_bytes / link["pp"] if est.pp > 1 else 0.0
        e = s.comm["ep"].nbytes * (est.ep - 1) / est.ep / est.microbatches / link["ep"] if Axis.EP in s.comm else 0.0
        if c + t + r + p + e > slowest:
            slowest, compute_mb, tp_mb, cp_mb, pp_mb, ep_mb = c + t + r + p + e, c, t, r, p, e
            costs = op_costs(compute=plain, weight=s.weight_grad_flops_per_microbatch / est.cp / rate,
                             comm=t + r + p + e, recompute=est.recompute, schedule=est.schedule,
                             virtual_stages=est.virtual_stages)
    timing = pipeline_timing(stages=est.pp, microbatches=est.microbatches, schedule=est.schedule,
                             virtual_stages=est.virtual_stages, costs=costs)
    rounds = timing.makespan / slowest  # slowest microbatches' worth: M + pp - 1 for 1F1B
    dp = 0.0

    def moved(ranks: int, grad_bytes: int, weight_bytes: int) -> float:
        """Bytes a rank moves reducing ``grad_bytes`` over ``ranks``: an all-reduce's 2(n-1)/n, or
        ZeRO-1's reduce-scatter of them and all-gather of the weights, (n-1)/n each."""
        ring = (ranks - 1) / ranks
        return ring * (grad_bytes + weight_bytes) if est.zero else 2 * ring * grad_bytes

    def expert_weight_bytes(s) -> int:  # the ep-sharded experts' weights (in buckets of their own)
        return s.expert_params * s.weight_bytes // s.params if est.ep > 1 and s.params else 0

    if est.dp_shard > 1:
        dp = max(_fsdp_seconds(s.comm, width=est.dims.shard_width, groups=est.dims.dp_replicate,
                               expert_width=est.expert_replicas, link=link) for s in est.stages)
    elif est.replicas > 1:
        dp = max(moved(est.replicas, s.grad_bytes - s.expert_grad_bytes, s.weight_bytes - expert_weight_bytes(s))
                 for s in est.stages) / link["dp"]
    if est.ep > 1 and est.expert_replicas > 1 and est.dp_shard == 1:  # (FSDP's experts groups: above)
        dp += max(moved(est.expert_replicas, s.expert_grad_bytes, expert_weight_bytes(s))
                  for s in est.stages) / link["experts"]
    seconds = rounds * slowest + dp
    global_tokens = tokens * est.microbatches * est.dp
    return StepTime(seconds=seconds, compute=rounds * compute_mb, tp=rounds * tp_mb, pp=rounds * pp_mb, dp=dp,
                    cp=rounds * cp_mb, tokens_per_s=global_tokens / seconds,
                    utilization=est.flops_per_step / seconds / (est.world_size * rate), ep=rounds * ep_mb)
