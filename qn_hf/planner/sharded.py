"""Sharded data parallelism (``dp_shard`` > 1): what one rank of a stage holds and moves when FSDP2
shards its weights (data_parallel/sharded.py), as the planner counts it.

FSDP's groups are the stage's blocks (``stage_plan.layers``), one each, and the root (everything else
the stage holds: embeddings, final norm, head, a tied copy, what every stage holds). Every parameter
(a tp rank's shard of it) is split along dim 0 over the W = dp_shard x cp ranks of its group, each
rank holding ceil(rows / W) rows of it in storage (the last ranks' padded, so every rank holds the
same bytes: rank 0's rows are the real ones).

Under expert parallelism each fused experts module ep sharded (this rank's E/ep experts) is a group
of its own, formed before the block that holds it, over the X = dp x tp / ep x cp ranks of the stage
holding the same experts (the expert replicas, the ranks that sum their gradients without FSDP): its
E/ep rows split over X as above, one group over all X ranks (no hybrid split), its collectives on
``"experts"``. With X = 1 (every expert block held by one rank of the stage) FSDP leaves the experts
alone: whole on their rank in the model's dtype (under mixed precision they compute in it too, which
the estimate's trace follows), their gradients in ``.grad``, nothing gathered or reduced. A block's
group is then the rest of the block.

Held between steps, per rank: the shards in the model's dtype (under mixed precision they are the
float32 masters; nothing is cast or copied), their gradients in the same dtype, AdamW's two moments
of the shards and its 4-byte step per tensor. While a step runs, besides activations:

* gathered weights, in the compute dtype, whole and padded (a gathered parameter is a view of its
  all-gather output: W shards of ceil(rows / W) rows): the root's for the whole step; without a
  pipeline three blocks at once at most, in forward: the block running, its all-gather output (FSDP
  keeps a forward all-gather's output until the next copy-out) and the next block's, prefetched
  before the running block computes (in backward two: the running block and the prefetched one's
  output); under a pipeline gathering per microbatch two (no forward prefetch there), and gathering
  once a step every block of the stage and once more the last one's all-gather output, which FSDP
  keeps until its next copy-out. An experts group is gathered inside its block's forward, not
  prefetched: while its all-gather runs, the block's kept output is still alive (the blocks above
  plus the experts' output); its copy-out frees that and adds the experts' weights (the blocks above
  less one, plus the experts twice). So with B the largest block and E the largest experts group,
  without a pipeline 2B + E + max(B, E), per microbatch B + E + max(B, E) (backward holds no more:
  a block, its experts and one prefetched group), and once a step every group plus the last
  one's output, an experts group's;
* under a pipeline, the gradients accumulated whole over the step's microbatches until the step's one
  reduction (float32 under mixed precision, FSDP's reduce dtype; else the weights' dtype). Without one,
  each group's whole gradient lives only between its backward and its reduce-scatter (not counted,
  like the other buffers that die inside a step).

Traffic per step, as ``CommMeter`` counts it (each call's payload: an all-gather's own shard, a
reduce-scatter's whole input, the hybrid all-reduce's reduced shard), on ``"dp_shard"``: a group's
all-gather of its shards in the compute dtype; without a pipeline, per microbatch, the root once and
each block twice (forward; backward, after FSDP freed it), and a reduce-scatter of every group
(W times its shard, in float32 under mixed precision); under one, every group gathered and reduced
once per step, or gathering per microbatch each block twice per microbatch. With dp_shard < dp, each
reduced shard all-reduced across the dp / dp_shard groups on ``"dp_replicate"``. The experts' groups
move as blocks do, over their X ranks on ``"experts"`` (never hybrid: nothing on "dp_replicate").
"""

from __future__ import annotations

from dataclasses import dataclass

from ..comm_meter import Collective
from ..config.options import Gather
from ..config.parallel_config import ParallelConfig
from .memory import STEP_BYTES
from .traffic import GroupTraffic


@dataclass(frozen=True)
class Unit:
    """One FSDP group on a stage: its parameters' elements held per rank (padded rows) and whole."""

    shard: int
    whole: int


def shard_numel(numel: int, rows: int, width: int) -> int:
    """Elements a rank stores of a ``numel``-element tensor of ``rows`` rows (dim 0) split over
    ``width`` ranks: ceil(rows / width) rows, FSDP's padded shard (``torch.chunk``'s split)."""
    return -(-rows // width) * (numel // rows) if rows else numel


@dataclass(frozen=True)
class StageUnits:
    """A stage's FSDP groups, in the order they gather in forward within a block."""

    root: Unit  # empty on a middle stage
    blocks: list[Unit]  # each block it holds, in order, its experts apart
    experts: list[Unit]  # the experts modules' own groups (over the expert replicas)
    left_whole: int  # elements of the experts FSDP leaves alone (one expert replica: X = 1)
    pieces: dict[str, int]  # this rank's elements of each parameter (what tp / tie / pp sums move)


def units(held: tuple[tuple[str, int], ...], rows: dict[str, int], *, layers: str, width: int,
          experts: frozenset[str] = frozenset(), expert_width: int = 1) -> StageUnits:
    """The stage's FSDP groups (module docstring); ``experts``: the names of the ep-sharded experts'
    parameters, split over ``expert_width`` ranks."""
    groups: dict[str, list[tuple[int, int]]] = {"": []}
    own: dict[str, list[tuple[int, int]]] = {}  # experts module -> its parameters
    left_whole = 0
    for name, numel in held:
        if name in experts and expert_width == 1:
            left_whole += numel
        elif name in experts:
            own.setdefault(name.rpartition(".")[0], []).append((shard_numel(numel, rows[name], expert_width), numel))
        else:
            block = name[len(layers) + 1:].partition(".")[0] if name.startswith(layers + ".") else ""
            groups.setdefault(block, []).append((shard_numel(numel, rows[name], width), numel))
    root, *blocks = (_unit(g) for g in groups.values())
    pieces = {name: shard_numel(numel, rows[name], expert_width if name in experts else width) for name, numel in held}
    return StageUnits(root=root, blocks=blocks, experts=[_unit(g) for g in own.values()], left_whole=left_whole,
                      pieces=pieces)


def _unit(params: list[tuple[int, int]]) -> Unit:
    return Unit(shard=sum(s for s, _ in params), whole=sum(w for _, w in params))


def _gathers_and_reductions(root: Unit | None, blocks: list[Unit], *, width: int, pp: int, microbatches: int,
                            per_microbatch: bool, compute_elem: int,
                            reduce_elem: int) -> dict[Collective, tuple[int, int]]:
    """One step's all-gathers and reduce-scatters of a set of groups over ``width`` ranks: ``root``
    gathered once per microbatch (once a step under a pipeline), each of ``blocks`` as a block."""
    root = root if root is not None and root.whole else None  # a group without parameters communicates nothing
    groups = ([root] if root else []) + blocks
    once = root.shard if root else 0
    if pp == 1:
        calls = microbatches * ((root is not None) + 2 * len(blocks))
        elems = microbatches * (once + 2 * sum(b.shard for b in blocks))
        reductions = microbatches
    else:
        per_block = 2 * microbatches if per_microbatch else 1
        calls = (root is not None) + per_block * len(blocks)
        elems = once + per_block * sum(b.shard for b in blocks)
        reductions = 1
    shard = sum(u.shard for u in groups)
    return {Collective.ALL_GATHER_INTO_TENSOR: (calls, elems * compute_elem),
            Collective.REDUCE_SCATTER_TENSOR: (reductions * len(groups), reductions * width * shard * reduce_elem)}


def _group(ops: dict[Collective, tuple[int, int]]) -> GroupTraffic:
    return GroupTraffic(sum(c for c, _ in ops.values()), sum(b for _, b in ops.values()), ops)


@dataclass(frozen=True)
class ShardedStage:
    weight_bytes: int
    grad_bytes: int
    moment_bytes: int
    step_bytes: int  # AdamW's step counter per tensor
    gathered_bytes: int  # whole weights in the compute dtype, the most held at once in a step
    accumulated_grad_bytes: int  # whole gradients kept until the step's reduction (pipeline only)
    expert_bytes: int  # of the weights (and of the gradients), the ep-sharded experts'
    pieces: dict[str, int]  # this rank's elements of each parameter (what tp / tie / pp sums move)
    comm: dict[str, GroupTraffic]


def sharded_stage(stage: StageUnits, *, parallel: ParallelConfig, elem: int, compute_elem: int,
                  reduce_elem: int) -> ShardedStage:
    """One stage's figures (module docstring) under ``parallel`` (its degrees, microbatches and
    ``dp_shard_gather``: the pipeline gathers once a step or per microbatch), from its groups
    (``units`` at ``parallel``'s shard width and expert replicas). ``elem``: the model's dtype (shards,
    their gradients, AdamW's moments); ``compute_elem``: the gathered weights'; ``reduce_elem``: the
    reduction's and the accumulated gradients' (float32 under mixed precision)."""
    dims, microbatches = parallel.dims, parallel.microbatches
    pp, width, expert_width = dims.pp, dims.shard_width, dims.expert_replicas
    per_microbatch = parallel.dp_shard_gather is Gather.MICROBATCH
    root, blocks, own = stage.root, stage.blocks, stage.experts
    # whole weights are held padded: each parameter is a view of its all-gather output, W padded shards
    block = max((b.shard * width for b in blocks), default=0)
    expert = max((e.shard * expert_width for e in own), default=0)
    if pp == 1:  # the running block, its all-gather output FSDP keeps in forward, the next one's prefetched
        gathered = root.shard * width + 2 * block + expert + max(block, expert)
    elif per_microbatch:  # no forward prefetch (see ShardedParameters): the running block and one output
        gathered = root.shard * width + block + expert + max(block, expert)
    else:  # every group, and the last one's output: an experts group's when the blocks hold one
        gathered = (root.shard * width + sum(b.shard * width for b in blocks)
                    + sum(e.shard * expert_width for e in own) + (expert if own else block))
    timing = {"pp": pp, "microbatches": microbatches, "per_microbatch": per_microbatch, "compute_elem": compute_elem,
              "reduce_elem": reduce_elem}
    comm = {"dp_shard": _group(_gathers_and_reductions(root, blocks, width=width, **timing))}
    if own:
        comm["experts"] = _group(_gathers_and_reductions(None, own, width=expert_width, **timing))
    groups = ([root] if root.whole else []) + blocks
    shard = sum(u.shard for u in groups)
    if dims.dp_replicate > 1:  # each group's reduced shard, after each reduce-scatter
        per_step = microbatches if pp == 1 else 1
        comm["dp_replicate"] = _group({Collective.ALL_REDUCE: (per_step * len(groups), per_step * shard * reduce_elem)})
    experts_held = sum(e.shard for e in own) + stage.left_whole
    held_elems = shard + experts_held
    return ShardedStage(weight_bytes=held_elems * elem, grad_bytes=held_elems * elem, moment_bytes=2 * held_elems * elem,
                        step_bytes=len(stage.pieces) * STEP_BYTES, gathered_bytes=gathered * compute_elem,
                        accumulated_grad_bytes=sum(u.whole for u in groups + own) * reduce_elem if pp > 1 else 0,
                        expert_bytes=experts_held * elem, pieces=stage.pieces, comm=comm)
