"""The step-time model: a mesh's estimate priced with a machine's figures (``calibration.py``),
measured by ``qn-hf-plan --calibrate`` or, without a calibration, the stated ``Hardware`` figures
(every figure then assumed, and named in ``StepTime.assumed``).

For each pipeline stage, one microbatch on one rank costs

    compute = dense matrix products' FLOPs at the calibrated rate for their shape (rows: the
              tokens a rank runs, 1/cp of the microbatch's; width: hidden / tp); routed experts'
              active FLOPs at the grouped products' rate for theirs (rows: the tokens one expert
              gets at uniform routing), under ep times the busiest ep rank's load over the mean
              (``MeshEstimate.expert_imbalance``: the router's measured loads, or uniform routing's);
              attention's FLOPs on its own fit (a call per block, and per ring step under cp); every
              other op of the forward (``Trace.ops``) at the per-op latency plus the bytes it writes
              at the memory rate (the op latency is measured forward and backward together); times
              4/3 under full recomputation (the forward runs again), the other ops' share a third
              more under selective recomputation (the elementwise work is redone). On a GPU the
              host launches ahead of the device: the larger of the launches' latency and the work;
              all of it times the calibration's ``compute_scale`` (kernels composed into a step
              against the same kernels timed alone)
    tp, cp, ep = each collective the estimate counts for the group (``GroupTraffic.ops``: calls and
              payload per op) at the calibrated fit for that op over that many ranks on that link
    pp      = the sends of one microbatch's activation and gradient, at the p2p fit

and the pipeline takes the schedule's own time: every rank's action list timed
(``schedule_check.timed``) with its own stage's microbatch cut into per-op costs F, B and zb_h1's W
(``schedules.op_costs``), so that a cut whose last stage also runs the head waits where a run does. Ring attention posts each block's transfer before computing the block
in hand and waits after it (ring_attention.py), so ``overlap`` x the attention's time of the cp
time is hidden.

Once a step, every other group the estimate counts (dp's buckets, or ZeRO-1's pieces, the experts'
buckets, FSDP's gathers and reductions, kv, tie, the batch agreement, fp16's flag) at its fits.
qn_hf posts the dp buckets asynchronously as backward fills them (data_parallel/buckets.py), so
``overlap`` x the last microbatch's backward of them is hidden; FSDP prefetches the next block's
gather during compute, so ``overlap`` x the step's compute of its time is hidden. The optimizer
step (AdamW) runs at the calibration's measured fit: a latency per parameter tensor and the rank's
state (weights, gradients, moments) at its rate; without one, at the op fit (the state read and
written once; a few ops per tensor on a CPU, a few per step on a GPU, where torch takes its
foreach path).

Ranks drift apart over compute, so a blocking exchange costs its transfer and a wait for the last
rank to arrive, measured after compute segments of several lengths (``Calibration.waits``): each
stage's compute is cut by its blocking exchanges (a microbatch's tp and ep collectives, pipeline
receives and ring steps; FSDP's gathers and reductions; the step's end), and each waits as after an
even share of it, the microbatches' waits in the pipeline's costs and the others once a step.

qn_hf's own host work (``Calibration.overheads``, measured on tiny models' steps): once a step, and
at each call of the tp, cp, ep and pp groups (in the pipeline's costs) and FSDP's (once a step).

A group's link is the node's when all its ranks share a node (ranks are laid out dp, pp, cp, tp
with tp fastest; an ep group is ep consecutive ranks of a stage's dp x tp grid) and the network's
otherwise.
"""

from __future__ import annotations

import functools
from collections.abc import Mapping
from dataclasses import dataclass, field
from types import MappingProxyType

from ..comm_meter import Collective
from ..config.dims import Axis
from ..config.layout import GroupRole, crosses_nodes
from ..config.options import Recompute
from ..expert_parallel.routing_costs import ROUTING_UNIFORM
from ..pipeline.costs import op_costs, pipeline_timing
from .calibration import NO_WAITS, Calibration, Link, assumed
from .results import MeshEstimate, MeshWork, StageEstimate, StageWork
from .traffic import GroupTraffic

GIB = 1024**3
# torch's AdamW: about this many ops per parameter tensor on a CPU (its single-tensor path), per step
# on a GPU (the foreach path: one launch per op for a list of tensors)
OPTIMIZER_OPS = 10


@dataclass(frozen=True)
class Hardware:
    gpu_memory: int = 80 * GIB
    gpus_per_node: int = 8
    tflops: float = 400.0  # sustained dense FLOP/s per GPU, in TFLOP/s (bf16 on an H100 at ~40% of peak)
    nvlink_gbps: float = 450.0  # GB/s per GPU inside a node
    ib_gbps: float = 50.0  # GB/s per GPU across nodes (one 400 Gb/s NIC per GPU)
    host_gbps: float = 25.0  # GB/s per GPU each way to and from pinned host memory (PCIe 5 x16, below its peak)


# A step's communication by the group it runs on (``config/layout.GroupRole``), as a user reads each part; "dp" is
# the gradients' reductions, once a step (dp x cp, the experts', FSDP's), less what overlaps
COMM_PARTS: dict[GroupRole, str] = {
    GroupRole.TENSOR: "tp communication", GroupRole.STAGES: "pipeline transfers",
    GroupRole.BATCH: "gradient reduction", GroupRole.SEQUENCE: "ring attention transfers",
    GroupRole.TOKEN_EXCHANGE: "expert all-to-alls",
}


@dataclass(frozen=True)
class StepTime:
    """A step's predicted time and its parts: the slowest stage's, scaled to the schedule's makespan. Each part of
    ``comm`` reads as an attribute named as its group's role (``t.tp``, ``t.dp``...; ``COMM_PARTS``)."""

    seconds: float
    compute: float  # pipeline compute including the bubble
    # COMM_PARTS' groups, per step: the slowest stage's tp, pp and ep exchanges (cp's less what overlaps) scaled to
    # the makespan, and dp once a step; read-only
    comm: Mapping[GroupRole, float] = field(hash=False)
    tokens_per_s: float
    utilization: float  # model FLOPs per second / (GPUs * the fastest calibrated matmul rate)
    optimizer: float = 0.0  # the optimizer's step over this rank's state
    wait: float = 0.0  # ranks' waits at blocking exchanges (a microbatch's, in the pipeline, and once a step's)
    host: float = 0.0  # qn_hf's own host work (Calibration.overheads): per exchange, and once a step
    offload: float = 0.0  # offload="activations": the copies to the host and back its compute does not hide
    assumed: tuple[str, ...] = ()  # the figures not measured (no calibration: all of them)

    def as_dict(self) -> dict:
        """The parts by name, each group's by its role (``qn-hf-plan --json``'s ``step_time``)."""
        return {"seconds": self.seconds, "compute": self.compute,
                **{str(role): self.comm.get(role, 0.0) for role in COMM_PARTS},
                "tokens_per_s": self.tokens_per_s, "utilization": self.utilization, "optimizer": self.optimizer,
                "wait": self.wait, "host": self.host, "offload": self.offload, "assumed": self.assumed}


for _role in COMM_PARTS:  # t.tp, t.pp, t.dp, t.cp, t.ep
    assert not hasattr(StepTime, _role.value), _role  # a part never hides a field
    setattr(StepTime, _role.value, property(lambda self, role=_role: self.comm.get(role, 0.0), doc=COMM_PARTS[_role]))
del _role


def links(est: MeshEstimate, hw: Hardware) -> dict[str, str]:
    """Which link each group uses ("dp": the gradients' group, dp x cp; the cp group alone at dp=1;
    "experts": the ranks holding the same experts): "ib" where any of its groups holds ranks of two nodes,
    read from the groups the job builds (``config/layout.rank_groups``), ``hw.gpus_per_node`` ranks a node."""
    across = crosses_nodes(est.dims, hw.gpus_per_node) if est.world_size > hw.gpus_per_node else {}
    kinds = {role: role for role in (GroupRole.TENSOR, GroupRole.SEQUENCE, GroupRole.STAGES, GroupRole.TOKEN_EXCHANGE,
                                     GroupRole.EXPERT_SUM, GroupRole.WEIGHT_SHARD, GroupRole.SHARD_REPLICAS,
                                     GroupRole.GRADIENT_SUM)}
    # "dp" names the gradients' sum: the dp x cp ranks', or the cp ranks' alone at dp=1
    kinds[GroupRole.BATCH] = GroupRole.GRADIENT_SUM if est.dp > 1 else GroupRole.SEQUENCE
    return {str(group): "ib" if across.get(kind, False) else "nvlink" for group, kind in kinds.items()}


def machine(hw: Hardware, calibration: Calibration | None, *, world_size: int) -> Calibration:
    """The figures a step is priced at: the calibration, or the hardware's stated ones."""
    if calibration is not None:
        return calibration
    return _stated(hw, world_size)


@functools.lru_cache(maxsize=16)  # a search prices thousands of meshes at the same figures
def _stated(hw: Hardware, world_size: int) -> Calibration:
    return assumed(tflops=hw.tflops, nvlink_gbps=hw.nvlink_gbps, ib_gbps=hw.ib_gbps, gpus_per_node=hw.gpus_per_node,
                   gpu_memory=hw.gpu_memory, world_size=world_size, host_gbps=hw.host_gbps)


_MICROBATCH_GROUPS = (GroupRole.TENSOR, GroupRole.SEQUENCE, GroupRole.TOKEN_EXCHANGE, GroupRole.STAGES)
# posted as backward fills them (FSDP's experts: with FSDP)
_BUCKETS = (GroupRole.BATCH, GroupRole.GRADIENT_SUM, GroupRole.EXPERT_SUM)
_FSDP = (GroupRole.WEIGHT_SHARD, GroupRole.SHARD_REPLICAS)
# priced as pairwise transfers: the pipeline's, and the hosts' exchange (comm.host_max_)
_P2P = (GroupRole.STAGES, GroupRole.HOST)


def group_sizes(est: MeshEstimate) -> dict[str, int]:
    """Ranks in each group the estimate counts traffic for (pp: the pair a transfer joins; a group
    not named, as fp16's flag's "world", spans the world)."""
    dims = est.dims
    return {GroupRole.TENSOR: est.tp, GroupRole.SEQUENCE: est.cp, GroupRole.TOKEN_EXCHANGE: est.ep,
            GroupRole.STAGES: 2, GroupRole.BATCH: est.dp, GroupRole.GRADIENT_SUM: est.replicas,
            GroupRole.EXPERT_SUM: est.expert_replicas, GroupRole.WEIGHT_SHARD: dims.shard_width,
            GroupRole.SHARD_REPLICAS: dims.dp_replicate, GroupRole.KV_COPIES: est.tp, GroupRole.TIED_STAGES: 2,
            GroupRole.HOST: est.world_size, "world": est.world_size}


class _Fits:
    """``Calibration.collective``'s answers kept for one step's pricing (it looks them up by op, size
    and link among every measured fit, and a step asks for the same few many times)."""

    def __init__(self, cal: Calibration) -> None:
        self._cal, self._found = cal, {}

    def collective(self, op: Collective, *, ranks: int, link: Link):
        key = (op, ranks, link)
        if key not in self._found:
            self._found[key] = self._cal.collective(op, ranks=ranks, link=link)
        return self._found[key]


def _group_seconds(traffic: GroupTraffic, *, ranks: int, link: Link, cal: Calibration | _Fits, p2p: bool) -> float:
    if ranks <= 1:
        return 0.0
    if p2p:  # both directions are counted on each rank; a transfer takes its send's time
        return cal.collective(Collective.SEND, ranks=2, link=link).seconds(traffic.nbytes / 2, calls=traffic.calls / 2)
    if traffic.ops:
        return sum(cal.collective(Collective(op), ranks=ranks, link=link).seconds(nbytes, calls=calls)
                   for op, (calls, nbytes) in traffic.ops.items())
    return cal.collective(Collective.ALL_REDUCE, ranks=ranks, link=link).seconds(traffic.nbytes, calls=traffic.calls)


def compute_dtype(est: MeshEstimate | MeshWork) -> str:
    precision = est.parallel.mixed_precision
    return str(precision.dtype).removeprefix("torch.") if precision is not None else est.dtype


def _kernels(est: MeshEstimate | MeshWork, s: StageEstimate | StageWork, cal: Calibration) -> tuple[float, float, float]:
    """One microbatch's matmuls, attention and zb_h1's deferred weight gradients on a rank of stage
    ``s``, at the calibration's rates: the least its forward and backward take (``compute_seconds``
    adds the other ops), read from the stage's FLOPs and the mesh's shape alone (an estimate's, or
    before it a ``MeshWork``'s: ``step_floor``)."""
    dtype = compute_dtype(est)
    rows = est.tokens_per_microbatch / est.cp
    width = max(est.hidden_size // est.tp, 1)
    rate = cal.matmul_rate(dtype, rows=rows, width=width)
    dense = (s.flops_per_microbatch - s.attention_flops_per_microbatch - s.expert_flops_per_microbatch) / est.cp
    matmul = dense / rate
    if s.expert_flops_per_microbatch:
        expert_rows = max(rows * est.expert_flop_share, 1.0)
        # under ep the all-to-alls wait for the busiest rank's experts (expert_parallel/routing_costs.py)
        matmul += (s.expert_flops_per_microbatch / est.cp * est.expert_imbalance
                   / cal.grouped_rate(dtype, rows=expert_rows * est.expert_imbalance, width=width))
    blocks = sum(b - a for a, b in s.chunks)
    attention = cal.attention_fit(dtype).seconds(s.attention_flops_per_microbatch / est.cp, calls=blocks * est.cp)
    weight = s.weight_grad_flops_per_microbatch / est.cp / rate
    # the kernels composed into a step run slower than alone (calibration.compute_scale)
    return matmul * cal.compute_scale, attention * cal.compute_scale, weight * cal.compute_scale


def compute_seconds(est: MeshEstimate, s: StageEstimate, cal: Calibration) -> tuple[float, float, float, float]:
    """One microbatch's forward and backward on a rank of stage ``s``, without recomputation:
    (all of it, of which attention, other ops, zb_h1's deferred weight gradients)."""
    matmul, attention, weight = _kernels(est, s, cal)
    others = cal.op.seconds(s.op_bytes_per_microbatch, calls=s.ops_per_microbatch) * cal.compute_scale
    if not cal.on_cpu:  # the host launches ahead of the device: the larger of launching and running
        launching = cal.op.latency * s.ops_per_microbatch
        running = matmul + attention + s.op_bytes_per_microbatch / cal.op.rate
        elementwise = max(launching - matmul - attention, s.op_bytes_per_microbatch / cal.op.rate)
        return max(launching, running), attention, elementwise, weight
    return matmul + attention + others, attention, others, weight


def optimizer_seconds(s: StageEstimate, cal: Calibration) -> float:
    """AdamW's step over a rank's state: at the calibration's measured optimizer fit, or (a file from
    before it was measured, or no calibration) at the op fit, a few ops per tensor on a CPU."""
    tensors = max(s.param_tensors, 1)
    if cal.optimizer is not None:
        return cal.optimizer.seconds(s.state_bytes, calls=tensors)
    return cal.op.seconds(2 * s.state_bytes, calls=OPTIMIZER_OPS * (tensors if cal.on_cpu else 1))


def offload_seconds(s: StageEstimate, cal: Calibration, *, compute: float) -> float:
    """One microbatch's block inputs to the host and back on a rank of stage ``s`` under ``offload`` (0 without),
    less what its ``compute`` hides: on a GPU they run on a side stream beside it, on a CPU they are its own work."""
    if not s.offloaded_bytes_per_microbatch:
        return 0.0
    copies = (cal.host_copy or cal.op).seconds(s.offloaded_bytes_per_microbatch,
                                               calls=sum(last - first for first, last in s.chunks))
    return copies if cal.on_cpu else max(copies - compute, 0.0)


def _waits(est: MeshEstimate, s: StageEstimate, cal: Calibration, sizes: dict[str, int], *,
           compute: float) -> tuple[float, float]:
    """Stage ``s``'s waits at blocking exchanges (calibration.WaitTable): (a microbatch's, once a
    step's). A step's compute is cut by its blocking exchanges: each microbatch's tp and ep
    collectives, pipeline receives and ring steps (a p2p transfer is counted on both its ends, one
    exchange), FSDP's gathers and reductions, and the step's end (the buckets' last wait, the
    loss); each waits as after an even share of the compute."""
    if cal.waits is None or est.world_size == 1:
        return 0.0, 0.0
    per_microbatch = sum(calls / (2 if g in (GroupRole.STAGES, GroupRole.SEQUENCE) else 1)
                         for g, calls in _microbatch_calls(s, sizes)) / est.microbatches
    per_step = 1 + _fsdp_calls(est, s)
    exchanges = per_microbatch * est.microbatches + per_step
    each = cal.waits.wait(compute * est.microbatches / exchanges)
    return per_microbatch * each, per_step * each


def _host(est: MeshEstimate, s: StageEstimate, cal: Calibration, sizes: dict[str, int]) -> tuple[float, float]:
    """Stage ``s``'s host work (``Calibration.overheads``): (a microbatch's, at each call of its tp,
    cp, ep and pp groups; once a step's, the step's own and FSDP's per call)."""
    if not cal.overheads or est.world_size == 1:
        return 0.0, cal.overheads.get("step", 0.0)
    per_microbatch = sum(cal.overheads.get(str(g), 0.0) * calls
                         for g, calls in _microbatch_calls(s, sizes)) / est.microbatches
    return per_microbatch, (cal.overheads.get("step", 0.0)
                            + cal.overheads.get(str(Axis.DP_SHARD), 0.0) * _fsdp_calls(est, s))


def _microbatch_calls(s: StageEstimate, sizes: dict[str, int]) -> list[tuple[str, int]]:
    """Stage ``s``'s step's calls of each group it runs per microbatch (tp, cp, ep, pp) over more than one rank."""
    return [(g, s.comm[g].calls) for g in _MICROBATCH_GROUPS if g in s.comm and sizes.get(g, 1) > 1]


def _fsdp_calls(est: MeshEstimate, s: StageEstimate) -> int:
    """Stage ``s``'s FSDP gathers and reductions in a step (none without dp_shard)."""
    return sum(s.comm[g].calls for g in _FSDP if g in s.comm) if est.dp_shard > 1 else 0


def step_time(est: MeshEstimate, hw: Hardware, calibration: Calibration | None = None) -> StepTime:
    cal = machine(hw, calibration, world_size=est.world_size)
    kinds = {g: Link.NODE if kind == "nvlink" else Link.NETWORK for g, kind in links(est, hw).items()}
    spanning = Link.NODE if est.world_size <= hw.gpus_per_node else Link.NETWORK
    sizes = group_sizes(est)

    fits = _Fits(cal)

    def seconds(group: str, traffic: GroupTraffic) -> float:
        return _group_seconds(traffic, ranks=sizes.get(group, est.world_size), link=kinds.get(group, spanning),
                              cal=fits, p2p=group in _P2P)

    again = 4 / 3 if est.recompute == Recompute.FULL else 1.0
    slowest = compute_mb = tp_mb = pp_mb = cp_mb = ep_mb = wait_mb = host_mb = backward_mb = offload_mb = 0.0
    costs, step_waits, step_host = [], [], []
    for s in est.stages:
        plain, attention, others, weight = compute_seconds(est, s, cal)
        redo = others / 3 if est.recompute == Recompute.SELECTIVE else 0.0  # in backward, before the gradients
        c = plain * again + redo
        per = {g: seconds(g, s.comm[g]) / est.microbatches for g in _MICROBATCH_GROUPS if g in s.comm}
        t, p, e = per.get(GroupRole.TENSOR, 0.0), per.get(GroupRole.STAGES, 0.0), per.get(GroupRole.TOKEN_EXCHANGE, 0.0)
        r = max(per.get(GroupRole.SEQUENCE, 0.0) - cal.overlap * attention * again, 0.0)
        w, once_w = _waits(est, s, cal, sizes, compute=c)
        h, once_h = _host(est, s, cal, sizes)
        o = offload_seconds(s, cal, compute=c)
        step_waits.append(once_w)
        step_host.append(once_h)
        costs.append(op_costs(compute=plain, weight=weight, comm=t + r + p + e + w + h + o, recompute=est.recompute,
                              schedule=est.schedule, virtual_stages=est.virtual_stages, redone=redo))
        if c + t + r + p + e + w + h + o > slowest:
            slowest, compute_mb, tp_mb, cp_mb, pp_mb, ep_mb = c + t + r + p + e + w + h + o, c, t, r, p, e
            wait_mb, host_mb, offload_mb = w, h, o
            backward_mb = c - plain / 3 + (t + r + e + w + h + o) / 2
    # each stage at its own costs: an unbalanced cut (the head on the last stage) waits where it does
    timing = pipeline_timing(stages=est.pp, microbatches=est.microbatches, schedule=est.schedule,
                             virtual_stages=est.virtual_stages, costs=costs)
    rounds = timing.makespan / slowest  # the parts below: the slowest stage's, scaled to the makespan

    def once(s: StageEstimate) -> float:
        """A stage's once-a-step groups, less what overlaps with its compute."""
        sharded = est.dp_shard > 1
        buckets = sum(seconds(g, s.comm[g]) for g in _BUCKETS if g in s.comm and not sharded)
        fsdp = sum(seconds(g, s.comm[g]) for g in (*_FSDP, GroupRole.EXPERT_SUM) if g in s.comm and sharded)
        rest = sum(seconds(g, traffic) for g, traffic in s.comm.items()
                   if g not in (*_MICROBATCH_GROUPS, *_BUCKETS, *_FSDP))
        return (buckets - cal.overlap * min(buckets, backward_mb) + fsdp
                - cal.overlap * min(fsdp, rounds * compute_mb) + rest)

    dp, step_wait, step_h = max((once(s) + w + h, w, h) for s, w, h in zip(est.stages, step_waits, step_host))
    optimizer = max(optimizer_seconds(s, cal) for s in est.stages)
    total = rounds * slowest + dp + optimizer
    dp -= step_wait + step_h  # reported among the waits and the host's work
    global_tokens = est.tokens_per_microbatch * est.microbatches * est.dp
    peak = max(max(max(row) for row in table.rates) for table in cal.matmul.values())
    comm = {GroupRole.TENSOR: rounds * tp_mb, GroupRole.STAGES: rounds * pp_mb, GroupRole.BATCH: dp,
            GroupRole.SEQUENCE: rounds * cp_mb, GroupRole.TOKEN_EXCHANGE: rounds * ep_mb}
    return StepTime(seconds=total, compute=rounds * compute_mb, comm=MappingProxyType(comm),
                    tokens_per_s=global_tokens / total,
                    utilization=est.flops_per_step / total / (est.world_size * peak), optimizer=optimizer,
                    wait=rounds * wait_mb + step_wait,
                    host=rounds * host_mb + step_h, offload=rounds * offload_mb,
                    assumed=cal.assumed + ((NO_WAITS,) if cal.waits is None and est.world_size > 1
                                           and NO_WAITS not in cal.assumed else ())
                    + ((ROUTING_UNIFORM,) if est.ep > 1 and not est.routing_measured else ()))


def step_floor(work: MeshWork | MeshEstimate, hw: Hardware, calibration: Calibration | None = None, *,
               timed: bool = True, recompute: Recompute | None = None) -> float:
    """A least step time for a mesh shape (its degrees but dp_shard, schedule, microbatches), from its
    compute (``Planner.work``, or an estimate): ``step_time`` of any of its configurations, at any
    dp_shard, at ``recompute`` or any recomputation if None, is at least this (up to float rounding),
    which lets a search pass over the shapes whose floor a priced configuration already beats. It is
    the pipeline's makespan with each op at its matmuls and attention alone (``_kernels``: the same at
    every dp_shard and recomputation; under full recomputation each backward runs them a third more):
    ``step_time`` runs the same lists with each op costing that and more (the other ops,
    communication, waits), a list's makespan never shrinks as an op grows (``schedule_check.timed``),
    and what it adds once a step (reductions less their overlap, the optimizer) is not negative while
    the overlap is at most 1 (0 past that: no floor). ``timed`` False: the busiest rank's ops end to
    end, which the makespan is at least, without walking the lists (a long pipeline's walk costs more
    than an estimate)."""
    cal = machine(hw, calibration, world_size=work.world_size)
    if cal.overlap > 1:
        return 0.0
    costs = [op_costs(compute=matmul + attention, weight=weight, comm=0.0, recompute=recompute, schedule=work.schedule,
                      virtual_stages=work.virtual_stages) for matmul, attention, weight in
             (_kernels(work, s, cal) for s in work.stages)]
    if not timed:  # each rank runs every op of its chunks once per microbatch
        return work.microbatches * work.virtual_stages * max(sum(c.values()) for c in costs)
    return pipeline_timing(stages=work.pp, microbatches=work.microbatches, schedule=work.schedule,
                           virtual_stages=work.virtual_stages, costs=costs).makespan
