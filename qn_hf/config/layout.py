"""Where each rank sits: the global rank at each place of the mesh, and every group of ranks a dimension
communicates in, as arithmetic on the degrees alone (no process group exists here). ``mesh.build_groups``
creates its groups from these lists; the planner prices each group on the link its ranks really use and
names the groups that cross nodes, from the same lists.

The global ranks are numbered in ``RANK_ORDER`` (the axes table's, ``dims.AXES``), slowest first, as Megatron
and torchtitan number them: pp outermost (its point-to-point transfers are a step's smallest and rarest, so
stages may lie on other nodes), then dp, then cp, then tp fastest. torchrun numbers a node's ranks
consecutively (``LOCAL_WORLD_SIZE`` of them, node after node), so a node holds whole tp groups first, then whole
cp rings and the ep blocks (consecutive ranks of a stage's dp x tp grid) as far as they fit, and only dp and pp
reach across nodes before them.
"""

from __future__ import annotations

import functools
from collections.abc import Mapping
from types import MappingProxyType

import torch

from ..arguments import Choice
from .dims import MESH_AXES, RANK_ORDER, Axis, ParallelDims


class GroupRole(Choice):
    """What the ranks of a group do together: every kind of process group, by role. ``rank_groups`` lists the
    world's groups of the mesh's axes and the gradient sum, and of the token exchange, the expert sum, the weight
    shards and their replicas where ep or dp_shard is used; ``mesh.build_groups`` builds what a run uses (the KV
    copies, tied stages and host too) and ``mesh.Groups.of(role)`` hands out this rank's (None: none built). A
    role that is one mesh axis's takes the axis's name. The order is the one a group serving two roles is named
    by, the later winning (at cp=1 the gradient sum's group is the dp group)."""

    GRADIENT_SUM = "replicas"  # hold the same shard and sum its gradients: dp x cp
    BATCH = "dp"  # train other sequences at one (pp, cp, tp)
    TENSOR = "tp"  # hold the shards of each layer
    STAGES = "pp"  # hold the stages of one (dp, cp, tp)
    SEQUENCE = "cp"  # split each sequence (ring attention)
    TOKEN_EXCHANGE = "ep"  # share out one model's experts and exchange tokens
    EXPERT_SUM = "experts"  # hold the same experts and sum their gradients
    WEIGHT_SHARD = "dp_shard"  # shard one copy of the weights (FSDP), with their cp ranks
    SHARD_REPLICAS = "dp_replicate"  # hold the same weight shards (hybrid sharding's all-reduce)
    KV_COPIES = "kv"  # tp ranks holding the same replicated KV heads
    TIED_STAGES = "tie"  # the first and last stage, holding a tied weight's two copies
    HOST = "host"  # every rank, over gloo: what the hosts agree on before a step's collectives


def rank_grid(dims: ParallelDims) -> torch.Tensor:
    """The global rank at each place of the mesh, indexed as ``dims.names`` ((dp, pp, tp), or (dp, pp, cp, tp)
    with cp), numbered in ``RANK_ORDER``."""
    order = [axis for axis in RANK_ORDER if axis.value in dims.names]
    grid = torch.arange(dims.world_size).reshape([getattr(dims, axis.value) for axis in order])
    return grid.permute([order.index(Axis(name)) for name in dims.names]).contiguous()


def full_grid(dims: ParallelDims) -> torch.Tensor:
    """``rank_grid`` as [dp, pp, cp, tp] (cp of size 1 when absent)."""
    return rank_grid(dims).reshape([getattr(dims, spec.axis.value) for spec in MESH_AXES])


def expert_groups(grid: torch.Tensor, dims: ParallelDims) -> tuple[list[list[int]], list[list[int]]]:
    """The ep groups and the expert-replica groups of every stage, from the [dp, pp, cp, tp] grid of
    global ranks. Each cp rank's dp x tp ranks of a stage, in (dp, tp) order, are cut into blocks of
    ``ep`` consecutive ranks (whole tp groups, or parts of one): each block shares out the experts,
    member i holding expert block i, and exchanges the tokens of its cp rank's part of the sequences.
    The ranks at the same place i of every block of every cp rank hold the same experts: they sum
    their gradients (cp ranks see other tokens of the same sequences, as dp ranks see other rows)."""
    blocks, members = [], []
    for p in range(dims.pp):
        stage_blocks = []
        for c in range(dims.cp):
            flat = grid[:, p, c, :].reshape(-1).tolist()
            stage_blocks += [flat[i : i + dims.ep] for i in range(0, len(flat), dims.ep)]
        blocks += stage_blocks
        members += [[block[i] for block in stage_blocks] for i in range(dims.ep)]
    return blocks, members


def shard_groups(grid: torch.Tensor, dims: ParallelDims) -> tuple[list[list[int]], list[list[int]]]:
    """The dp_shard groups (dp_shard consecutive dp ranks of one (pp, tp), with all their cp ranks: cp ranks
    hold the same weights and sum gradients as dp ranks do, so weights are sharded over dp_shard x cp, as
    torchtitan does) and the dp_replicate groups (the ranks at the same place of each such group: hybrid
    sharding's all-reduce; empty when dp_shard == dp)."""
    width = dims.dp_shard * dims.cp
    rows = [grid[:, p, :, t].reshape(dims.dp_replicate, width) for p in range(dims.pp) for t in range(dims.tp)]
    shard = [row[r].tolist() for row in rows for r in range(dims.dp_replicate)]
    replicate = [row[:, s].tolist() for row in rows for s in range(width)] if dims.dp_replicate > 1 else []
    return shard, replicate


@functools.lru_cache(maxsize=256)  # the planner asks once per mesh it prices, of thousands at a thousand GPUs
def rank_groups(dims: ParallelDims) -> Mapping[str, tuple[tuple[int, ...], ...]]:
    """Every group of each role over the whole world: the mesh's axes (dp, pp, cp, tp), the gradient sum (dp x cp),
    with ep the token exchange and the expert sum, with dp_shard the weight shards and their replicas."""
    grid = full_grid(dims)
    groups = {GroupRole(spec.axis.value): grid.movedim(d, -1).reshape(-1, grid.shape[d]).tolist()
              for d, spec in enumerate(MESH_AXES)}
    groups[GroupRole.GRADIENT_SUM] = [grid[:, q, :, b].reshape(-1).tolist()
                                      for q in range(dims.pp) for b in range(dims.tp)]
    if dims.ep > 1:
        groups[GroupRole.TOKEN_EXCHANGE], groups[GroupRole.EXPERT_SUM] = expert_groups(grid, dims)
    if dims.dp_shard > 1:
        groups[GroupRole.WEIGHT_SHARD], groups[GroupRole.SHARD_REPLICAS] = shard_groups(grid, dims)
    # read-only: the cache hands the same value to every caller
    return MappingProxyType({kind: tuple(tuple(g) for g in lists) for kind, lists in groups.items()})


@functools.lru_cache(maxsize=8192)  # the planner prices thousands of meshes at a thousand GPUs, some many times
def crosses_nodes(dims: ParallelDims, ranks_per_node: int) -> Mapping[str, bool]:
    """For each kind of group of more than one rank: whether any of its groups holds ranks of two nodes, the
    world's ranks ``ranks_per_node`` a node, node after node (as torchrun numbers them). Read-only (cached)."""
    return MappingProxyType({kind: any(len({r // ranks_per_node for r in group}) > 1 for group in groups)
                             for kind, groups in rank_groups(dims).items() if groups and len(groups[0]) > 1})
