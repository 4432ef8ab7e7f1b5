"""Sharded data parallelism (``dp_shard`` > 1): what one rank of a stage holds and moves when FSDP2
shards its weights (data_parallel/sharded.py), as the planner counts it.

FSDP's groups are the stage's blocks (``stage_plan.layers``), one each, and the root (everything else
the stage holds: embeddings, final norm, head, a tied copy, what every stage holds). Every parameter
(a tp rank's shard of it) is split along dim 0 over the W = dp_shard x cp ranks of its group, each
rank holding ceil(rows / W) rows of it in storage (the last ranks' padded, so every rank holds the
same bytes: rank 0's rows are the real ones).

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
  keeps until its next copy-out;
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
reduced shard all-reduced across the dp / dp_shard groups on ``"dp_replicate"``.
"""

from __future__ import annotations

from dataclasses import dataclass

from ..comm_meter import Collective
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


def units(held: tuple[tuple[str, int], ...], rows: dict[str, int], *, layers: str,
          width: int) -> tuple[Unit, list[Unit]]:
    """The stage's FSDP groups: the root (empty on a middle stage) and each block it holds, in order."""
    groups: dict[str, list[tuple[int, int]]] = {"": []}
    for name, numel in held:
        block = name[len(layers) + 1:].partition(".")[0] if name.startswith(layers + ".") else ""
        groups.setdefault(block, []).append((shard_numel(numel, rows[name], width), numel))
    root, *blocks = (Unit(shard=sum(s for s, _ in g), whole=sum(w for _, w in g)) for g in groups.values())
    return root, blocks


@dataclass(frozen=True)
class ShardedStage:
    weight_bytes: int
    grad_bytes: int
    moment_bytes: int
    step_bytes: int  # AdamW's step counter per tensor
    gathered_bytes: int  # whole weights in the compute dtype, the most held at once in a step
    accumulated_grad_bytes: int  # whole gradients kept until the step's reduction (pipeline only)
    pieces: dict[str, int]  # this rank's elements of each parameter (what tp / tie / pp sums move)
    comm: dict[str, GroupTraffic]


def sharded_stage(held: tuple[tuple[str, int], ...], rows: dict[str, int], *, layers: str, dp: int, dp_shard: int,
                  cp: int, pp: int, microbatches: int, per_microbatch: bool, elem: int, compute_elem: int,
                  reduce_elem: int) -> ShardedStage:
    """One stage's figures (module docstring). ``elem``: the model's dtype (shards, their gradients,
    AdamW's moments); ``compute_elem``: the gathered weights'; ``reduce_elem``: the reduction's and
    the accumulated gradients' (float32 under mixed precision); ``per_microbatch``: the pipeline
    gathers per microbatch."""
    width = dp_shard * cp
    root, blocks = units(held, rows, layers=layers, width=width)
    groups = ([root] if root.whole else []) + blocks  # a group without parameters communicates nothing
    shard = sum(u.shard for u in groups)
    # whole weights are held padded: each parameter is a view of its all-gather output, W padded shards
    largest = max((b.shard * width for b in blocks), default=0)
    if pp == 1:  # the running block, its all-gather output FSDP keeps in forward, the next one's prefetched
        gathered = root.shard * width + 3 * largest
    elif per_microbatch:  # no forward prefetch (see ShardedParameters): the running block and one output
        gathered = root.shard * width + 2 * largest
    else:
        gathered = root.shard * width + sum(b.shard * width for b in blocks) + largest
    if pp == 1:
        gather_calls = microbatches * ((root.shard > 0) + 2 * len(blocks))
        gather_elems = microbatches * (root.shard + 2 * sum(b.shard for b in blocks))
        reductions = microbatches
    else:
        per_block = 2 * microbatches if per_microbatch else 1
        gather_calls = (root.shard > 0) + per_block * len(blocks)
        gather_elems = root.shard + per_block * sum(b.shard for b in blocks)
        reductions = 1
    comm = {"dp_shard": GroupTraffic(gather_calls + reductions * len(groups),
                                     gather_elems * compute_elem + reductions * width * shard * reduce_elem, {
        Collective.ALL_GATHER_INTO_TENSOR: (gather_calls, gather_elems * compute_elem),
        Collective.REDUCE_SCATTER_TENSOR: (reductions * len(groups), reductions * width * shard * reduce_elem)})}
    if dp > dp_shard:
        comm["dp_replicate"] = GroupTraffic(reductions * len(groups), reductions * shard * reduce_elem,
                                            {Collective.ALL_REDUCE: (reductions * len(groups),
                                                                     reductions * shard * reduce_elem)})
    pieces = {name: shard_numel(numel, rows[name], width) for name, numel in held}
    return ShardedStage(weight_bytes=shard * elem, grad_bytes=shard * elem, moment_bytes=2 * shard * elem,
                        step_bytes=len(held) * STEP_BYTES, gathered_bytes=gathered * compute_elem,
                        accumulated_grad_bytes=sum(u.whole for u in groups) * reduce_elem if pp > 1 else 0,
                        pieces=pieces, comm=comm)
