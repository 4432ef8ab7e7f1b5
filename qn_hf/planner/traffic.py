"""Per-step communication of one rank of a pipeline stage, by group, as ``CommMeter`` counts it (the
payload this rank hands to each call: an all-reduce's tensor, a reduce-scatter's whole input, an
all-gather's own piece).

* tp, by op: per microbatch, a forward all-reduce of each row-parallel output and vocab-parallel
  embedding output, a backward all-reduce of the input of each tp entry (attention, MLP) and of each
  column layer outside one (the vocab-parallel head), and the vocab-parallel loss's 3 floats per row
  in two all-reduces. Full recomputation runs a block's forward again in backward, and with it the
  all-reduce of each row layer that has something saved after it in the block (``Trace.rerun``);
  selective recomputation keeps the collectives' outputs (recompute.py) and communicates nothing again. With sequence parallelism the entries and their row layers communicate as the
  trace recorded instead (``Trace.sequence``: an entry all-gathers its input forward and
  reduce-scatters its gradient, a row layer reduce-scatters forward and all-gathers backward, each
  stage's first block all-gathers its input's gradient, its last block or the final norm all-gathers
  its output; without recomputation each entry gathers its saved input again in backward),
  full recomputation repeating the forward ones run before the block's last save. Per step,
  one flat all-reduce of the gradients summed over tp (``TpPlan.grad_sum``: per-head norms, and with
  sequence parallelism the norms and row biases between the regions; under ZeRO this rank's pieces).
* pp: per microbatch, the hidden state forward and its gradient backward to each neighbour (both
  directions counted on each rank; with sequence parallelism this tp rank's slice of the sequence,
  all-gathered over tp by the receiver), the 4-byte loss. A steady step: the 64-byte shape header
  goes only with the first step of a batch shape. With V chunks per rank (interleaved_1f1b) each
  chunk has its own neighbours around the ring of ranks (chunk c receives from c-1, sends to c+1).
* dp: without ZeRO, an all-reduce of every gradient bucket; with ZeRO, a reduce-scatter of every
  bucket (the padded buffer, gradient dtype) and, after the optimizer step, an all-gather of every
  weight bucket (this rank's piece, parameter dtype); then the 8-byte target count and 4-byte loss.
  On gloo ZeRO's two are issued as one reduce and one broadcast per dp rank's piece
  (data_parallel.py), so each bucket takes 2 dp calls carrying the whole padded buffers.
  With cp > 1 the buckets and the loss go over "replicas" (the dp x cp ranks holding the same
  shard; ZeRO's pieces are 1/(dp x cp) of a bucket) and only the target count over dp.
* cp: ring attention's sends and receives (``context.ring_ops``), by op.
* ep (expert parallelism), per microbatch and MoE layer on the stage: ``all_to_all_single`` of the
  expert counts and of the token rows there and back forward, the rows' gradients back and there
  backward, priced at uniform routing, and with tp > 1 the tp all-gathers of the token split
  (``experts.expert_ops``), by op. experts: the ep-sharded experts' gradient buckets, all-reduced
  over the ranks holding the same experts (dp x tp / ep of them) instead of dp.
* kv: replicated KV-head gradients when tp exceeds the KV heads; tie: a weight tied across the first
  and last stage (gradient dtype; under ZeRO only this rank's piece of them).
* float16's loss scaling: a 4-byte overflow flag over the whole job ("world", or the mesh dimension
  that spans it).
* host: every step's agreement on its batches before the first collective (``step/agreement.py``),
  a max-reduction over the hosts of the whole job of three int64 per rank (its replica, its batch's layout
  and contents digests) and three more (any rank's failure), when the job has more than one rank: the
  whole vector sent and received in each of ceil(log2 world) rounds (``comm.host_max_``), priced as
  point-to-point transfers.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from ..comm import flat_runs, host_max_rounds
from ..comm_meter import Collective
from ..config.dims import Axis
from ..config.layout import GroupRole
from ..config.options import Dispatch, LossKind, Recompute
from ..config.parallel_config import ParallelConfig
from ..context_parallel.costs import ring_ops
from ..expert_parallel.costs import ExpertCall, expert_ops
from ..policies.styles import Style
from ..policies.tp_plan import TpPlan
from ..tensor_parallel.sequence_costs import GATHER
from .memory import Bucket, owned
from .trace import Trace


@dataclass(frozen=True)
class GroupTraffic:
    calls: int
    nbytes: int
    ops: dict[Collective, tuple[int, int]] = field(default_factory=dict)  # op -> (calls, bytes); tp, cp, ep only, else empty


@dataclass(frozen=True)
class StageGradients:
    """What one rank of a stage reduces once a step, as the estimate laid it out: the gradient
    buckets summed over the replicas (``buckets``: none where nothing is summed there, or under
    dp_shard, whose FSDP groups reduce instead) and over the ranks holding the same experts
    (``expert_buckets``), each sharded under ZeRO-1 where that applies (``zero``, ``zero_experts``);
    and the flat sums, parameter -> elements: the replicated KV heads' (``kv``), a weight tied across
    the first and last stage (``tied``), this stage's copy of what every stage holds (``every``,
    summed over pp), what is summed over tp (``grad_sum``). ``pieces``: under dp_shard, this rank's
    elements of each parameter, which the tp, kv, tie and pp sums move (under ZeRO-1 its pieces of
    the buckets, derived from them)."""

    buckets: Sequence[Bucket] = ()
    expert_buckets: Sequence[Bucket] = ()
    zero: bool = False
    zero_experts: bool = False
    kv: dict[str, int] = field(default_factory=dict)
    tied: dict[str, int] = field(default_factory=dict)
    every: dict[str, int] = field(default_factory=dict)
    grad_sum: dict[str, int] = field(default_factory=dict)
    pieces: dict[str, int] | None = None


def _tp_microbatch(s: int, *, plan: TpPlan, trace: Trace, stage_of: Callable[[str], int], act_elem: int,
                   recompute: str | None, loss_chunks: int = 0) -> dict[Collective, list[int]]:
    """One microbatch's tp collectives on stage ``s``: op -> [calls, bytes]. ``loss_chunks``: the chunks of
    its loss (``loss_chunk_tokens``; 0: at once), each running the head and the vocab-parallel loss's two
    all-reduces, and both again when the backward recomputes it."""
    ops: dict[Collective, list[int]] = defaultdict(lambda: [0, 0])

    def add(op: Collective, calls: int, nbytes: int) -> None:
        ops[op][0] += calls
        ops[op][1] += nbytes

    sp = plan.sequence_parallel

    def entered(name: str) -> bool:
        return any(name.startswith(e + ".") for e in plan.tp_entries)

    for name, style in plan.rules:
        if stage_of(name) != s or name not in trace.io:
            continue
        io = trace.io[name]
        if style == Style.VOCAB_EMBEDDING or (style == Style.ROWWISE and not sp):  # sp: reduce-scattered (below)
            add(Collective.ALL_REDUCE, io.calls, io.out_numel * act_elem)
            if recompute == Recompute.FULL and name in trace.rerun:  # selective keeps the sum (recompute.py)
                add(Collective.ALL_REDUCE, io.calls, io.out_numel * act_elem)
        elif style.startswith(Style.COLWISE) or style == Style.VOCAB_COLWISE:
            head = loss_chunks > 0 and name == plan.head.vocab_output  # the head runs once a chunk
            if not entered(name):
                add(Collective.ALL_REDUCE, loss_chunks if head else io.calls, io.in_numel * act_elem)
            if style == Style.VOCAB_COLWISE and plan.loss is LossKind.CAUSAL_LM:
                add(Collective.ALL_REDUCE, 4 * loss_chunks if head else 2, 3 * trace.logits_rows * 4 * (2 if head else 1))
    for name in () if sp else plan.tp_entries:
        if stage_of(name) == s and name in trace.io:
            add(Collective.ALL_REDUCE, trace.io[name].calls, trace.io[name].in_numel * act_elem)
    for c in trace.sequence:
        if stage_of(c.module) == s and not (c.regather and recompute is not None):
            for op, numel in filter(None, (c.forward, c.backward)):
                add(op, 1, numel * act_elem)
            if recompute == Recompute.FULL and c.rerun and c.forward is not None:
                add(c.forward[0], 1, c.forward[1] * act_elem)
    return ops


def _summed(params: dict[str, int], pieces: dict[str, int] | None) -> list[int]:
    """Elements of each tensor a flat all-reduce sums (a parameter's, or under ZeRO this rank's piece
    of it), those with any, in order."""
    numels = [pieces.get(n, 0) for n in params] if pieces is not None else list(params.values())
    return [n for n in numels if n]


def _group(ops: dict[Collective, list[int]] | dict[Collective, tuple[int, int]]) -> GroupTraffic:
    return GroupTraffic(sum(c for c, _ in ops.values()), sum(b for _, b in ops.values()),
                        {op: (c, b) for op, (c, b) in sorted(ops.items())})


def bucket_traffic(buckets: Sequence[Bucket], *, ranks: int, zero: bool, backend: str, grad_elem: int,
                   param_elem: int) -> tuple[int, int]:
    """Calls and bytes (as ``CommMeter`` counts them) of one step's reduction of ``buckets`` over
    ``ranks``: an all-reduce per bucket; under ZeRO-1 a reduce-scatter and an all-gather of the
    weights per bucket, which gloo runs as one reduce and one broadcast per piece (buckets.py)."""
    if zero and backend == "gloo":
        return 2 * ranks * len(buckets), sum(b.padded * (grad_elem + param_elem) for b in buckets)
    if zero:
        return 2 * len(buckets), sum(b.padded * grad_elem + b.piece(ranks) * param_elem for b in buckets)
    return len(buckets), sum(b.padded for b in buckets) * grad_elem


def stage_traffic(s: int, *, parallel: ParallelConfig, plan: TpPlan, trace: Trace, stage_of: Callable[[str], int],
                  act_elem: int, param_elem: int, grad_elem: int, grads: StageGradients, backend: str = "nccl",
                  experts: tuple[ExpertCall, ...] = (), kept: Callable | None = None,
                  loss_chunks: int = 0) -> dict[str, GroupTraffic]:
    """Stage ``s``'s traffic under ``parallel`` (its degrees, microbatches, chunks, recomputation and
    float16's loss scaling); ``grads``: what the stage reduces; ``experts``: the trace's experts calls
    (in the compute dtype); ``kept``: the planner's ``Planner._kept``, which keeps a microbatch's tp
    collectives per stage, plan and trace (the same at every dp, dp_shard and microbatch count);
    ``loss_chunks``: how many chunks a microbatch's loss takes (``loss_chunk_tokens``; 0: one, whole)."""
    dims, microbatches, recompute = parallel.dims, parallel.microbatches, parallel.recompute
    tp, pp, cp = dims.tp, dims.pp, dims.cp
    buckets, zero = grads.buckets, grads.zero
    out: dict[str, GroupTraffic] = {}
    pieces = owned(buckets, dp=dims.replicas) if zero else grads.pieces
    # under sequence parallelism each tp rank dispatches its own slice: no tp sharing out (dispatch.py)
    dispatch = expert_ops(experts, ep=dims.ep, tp=1 if plan.sequence_parallel else tp, recompute=recompute,
                          on_stage=lambda name: stage_of(name) == s,
                          gather=parallel.expert_dispatch is Dispatch.ALL_GATHER)
    last = pp * parallel.virtual_stages - 1
    chunks = range(s, last + 1, pp)
    # sequence parallelism sends each tp rank's slice between stages; the receiver gathers them
    wire = tp if plan.sequence_parallel else 1
    if tp > 1:
        def microbatch() -> dict[Collective, list[int]]:
            return _tp_microbatch(s, plan=plan, trace=trace, stage_of=stage_of, act_elem=act_elem, recompute=recompute,
                                  loss_chunks=loss_chunks)

        found = (microbatch() if kept is None else
                 kept(("tp", s, act_elem, recompute, loss_chunks), (plan, trace, stage_of), microbatch))
        ops = defaultdict(lambda: [0, 0], {op: list(v) for op, v in found.items()})  # a copy: added to below
        received = sum(c > 0 for c in chunks) if wire > 1 else 0
        if received:
            calls, nbytes = ops[GATHER]
            ops[GATHER] = [calls + received, nbytes + received * trace.boundary_numel // wire * act_elem]
        for op, (c, b) in dispatch.get("tp", {}).items():
            ops[op] = [ops[op][0] + c, ops[op][1] + b]
        ops = {op: [c * microbatches, b * microbatches] for op, (c, b) in ops.items()}
        summed = _summed(grads.grad_sum, pieces)
        if summed:
            calls, nbytes = ops.get(Collective.ALL_REDUCE, (0, 0))
            ops[Collective.ALL_REDUCE] = [calls + len(flat_runs([n * grad_elem for n in summed])),
                                          nbytes + sum(summed) * grad_elem]
        out[GroupRole.TENSOR] = _group(ops)
    if pp > 1:
        edges = sum((c > 0) + (c < last) for c in chunks)  # per microbatch: an activation and a gradient each
        # a steady step: the activation header went with the first step of this batch shape (runtime.py)
        act = trace.boundary_numel // wire * act_elem
        out[GroupRole.STAGES] = GroupTraffic(2 * edges * microbatches + 1, 2 * edges * microbatches * act + 4)
        shared = _summed(grads.every, pieces)  # one flat all-reduce of what every stage holds
        if shared:
            runs = len(flat_runs([n * grad_elem for n in shared]))
            transfers = out[GroupRole.STAGES]
            out[GroupRole.STAGES] = GroupTraffic(transfers.calls + runs, transfers.nbytes + sum(shared) * grad_elem)
    if cp > 1:
        ring = ring_ops(trace.ring, cp=cp, tp=tp, act_elem=act_elem, recompute=recompute,
                        on_stage=lambda name: stage_of(name) == s)
        if ring:
            out[GroupRole.SEQUENCE] = _group({op: (c * microbatches, b * microbatches) for op, (c, b) in ring.items()})
    if Axis.EP in dispatch:
        out[GroupRole.TOKEN_EXCHANGE] = _group({op: (c * microbatches, b * microbatches)
                                                for op, (c, b) in dispatch[Axis.EP].items()})
    if grads.expert_buckets:
        calls, nbytes = bucket_traffic(grads.expert_buckets, ranks=dims.expert_replicas, zero=grads.zero_experts,
                                       backend=backend, grad_elem=grad_elem, param_elem=param_elem)
        out[GroupRole.EXPERT_SUM] = GroupTraffic(calls, nbytes)
    if dims.replicas > 1:  # the gradient buckets, then the 4-byte loss
        calls, nbytes = bucket_traffic(buckets, ranks=dims.replicas, zero=zero, backend=backend, grad_elem=grad_elem,
                                       param_elem=param_elem)
        out[GroupRole.GRADIENT_SUM if cp > 1 else GroupRole.BATCH] = GroupTraffic(calls + 1, nbytes + 4)
    if dims.dp > 1 and plan.loss:  # the 8-byte target count
        previous = out.get(GroupRole.BATCH, GroupTraffic(0, 0))
        out[GroupRole.BATCH] = GroupTraffic(previous.calls + 1, previous.nbytes + 8)
    for group, params in ((GroupRole.KV_COPIES, grads.kv), (GroupRole.TIED_STAGES, grads.tied)):
        numels = _summed(params, pieces)
        if numels:
            out[group] = GroupTraffic(len(flat_runs([n * grad_elem for n in numels])), sum(numels) * grad_elem)
    if dims.world_size > 1:  # the batch agreement's votes, (world + 1) x 3 int64, sent and received each round
        transfers = 2 * host_max_rounds(dims.world_size)
        out[GroupRole.HOST] = GroupTraffic(transfers, transfers * 3 * 8 * (dims.world_size + 1))
    if parallel.mixed_precision is not None and parallel.mixed_precision.scaled:  # float16's overflow flag
        # CommMeter names the default group by a mesh dim spanning it, the last in GroupRole's order (at world
        # size 1 no mesh dim's group is the default group: "world")
        spanning = [role for role in GroupRole if dims.world_size > 1 and role.value in dims.names
                    and getattr(dims, role.value) == dims.world_size]
        group = spanning[-1] if spanning else "world"
        previous = out.get(group, GroupTraffic(0, 0))
        if previous.ops:  # an all-reduce of the flag, in the op breakdown too
            calls, nbytes = previous.ops.get(Collective.ALL_REDUCE, (0, 0))
            out[group] = _group({**previous.ops, Collective.ALL_REDUCE: (calls + 1, nbytes + 4)})
        else:
            out[group] = GroupTraffic(previous.calls + 1, previous.nbytes + 4)
    return out
