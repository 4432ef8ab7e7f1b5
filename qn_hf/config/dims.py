"""The parallel degrees as one value: every axis an ``Axis`` member, checked with the numbers in
the message, and the one place that derives the world size, the replicas and the expert replicas.

Pure arithmetic with no process group, so a bad configuration raises the same ``ValueError`` on
every rank before anything communicates.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from ..arguments import Choice, check_positive_int, plural


class Axis(Choice):
    """A parallel dimension. dp, pp, cp and tp are the device mesh's dims; ep is carved out of a
    stage's dp x tp grid (``expert_groups``), so it is an axis of the coordinates, not of the mesh;
    dp_shard and dp_replicate split dp for sharded data parallelism (FSDP's own mesh: groups of
    dp_shard ranks sharding the weights, dp_replicate such groups holding the same shards)."""

    DP = "dp"
    PP = "pp"
    CP = "cp"
    TP = "tp"
    EP = "ep"
    DP_SHARD = "dp_shard"
    DP_REPLICATE = "dp_replicate"


MESH_DIMS = (Axis.DP, Axis.PP, Axis.TP)
MESH_DIMS_CP = (Axis.DP, Axis.PP, Axis.CP, Axis.TP)


@dataclass(frozen=True)
class ParallelDims:
    """Degrees of data, pipeline, context and tensor parallelism; ``world_size == dp * pp * cp * tp``.

    ``ep`` is not a mesh dim: experts are sharded over ``ep`` of the dp x tp ranks of a stage
    (``expert_groups``), so it must divide dp * tp and leaves the world size unchanged. Nor is
    ``dp_shard``: the dp ranks form dp/dp_shard groups of dp_shard consecutive ones, each group
    sharding the weights (``data_parallel/sharded.py``), so it must divide dp."""

    dp: int = 1
    tp: int = 1
    pp: int = 1
    cp: int = 1
    ep: int = 1
    dp_shard: int = 1

    def __post_init__(self) -> None:
        for axis in (Axis.DP, Axis.TP, Axis.PP, Axis.CP, Axis.EP):
            check_positive_int(axis.value, getattr(self, axis))
        check_positive_int(Axis.DP_SHARD.value, self.dp_shard)
        if self.dp % self.dp_shard:
            divisors = [d for d in range(1, self.dp + 1) if self.dp % d == 0]
            dp = math.lcm(self.dp, self.dp_shard)  # dp_shard adds no ranks: dp_shard=S alone usually means dp=S
            raise ValueError(f"dp_shard={self.dp_shard} must divide dp={self.dp}: dp_shard shards the weights within "
                             f"the dp ranks and adds no ranks of its own; set dp to a multiple of dp_shard, e.g. dp={dp}, "
                             f"dp_shard={self.dp_shard} ({plural(dp * self.tp * self.pp * self.cp, 'process')} with "
                             f"tp={self.tp}, pp={self.pp}, cp={self.cp}), or keep dp={self.dp} with dp_shard among {divisors}")
        if self.ep > 1:
            if (self.dp * self.tp) % self.ep:
                raise ValueError(f"ep={self.ep} must divide dp*tp = {self.dp}*{self.tp} = {self.dp * self.tp}: the "
                                 f"experts are sharded over ranks of the dp x tp grid of a stage; choose ep among the "
                                 f"divisors of {self.dp * self.tp}")
            if self.ep % self.tp and self.tp % self.ep:
                raise ValueError(f"ep={self.ep} and tp={self.tp}: one must divide the other, so that an ep group "
                                 f"holds whole tp groups or lies inside one; choose ep a multiple or a divisor of tp")

    @property
    def expert_replicas(self) -> int:
        """How many ranks of a stage hold the same experts (and sum their gradients): dp * tp / ep in
        each cp rank's grid, times cp (every cp rank holds the same experts and routes its own tokens)."""
        return self.dp * self.tp // self.ep * self.cp

    @property
    def world_size(self) -> int:
        return self.dp * self.pp * self.cp * self.tp

    @property
    def dp_replicate(self) -> int:
        """How many groups of ``dp_shard`` ranks hold the same sharded weights (hybrid sharding: their
        gradients are all-reduced across the groups)."""
        return self.dp // self.dp_shard

    @property
    def shard_width(self) -> int:
        """How many ranks split one copy of the weights under ``dp_shard`` (FSDP's group): dp_shard x
        cp, as every cp rank of a dp_shard group holds the same weights and takes a piece of them."""
        return self.dp_shard * self.cp

    @property
    def names(self) -> tuple[str, ...]:
        """The mesh's dim names (plain strings, as DeviceMesh keeps them): cp appears only when it is
        used, so 3-D meshes stay as they were."""
        return tuple(axis.value for axis in (MESH_DIMS_CP if self.cp > 1 else MESH_DIMS))

    @property
    def shape(self) -> tuple[int, ...]:
        return tuple(getattr(self, name) for name in self.names)

    @property
    def replicas(self) -> int:
        """How many ranks hold the same parameter shard (and sum its gradients): dp x cp."""
        return self.dp * self.cp

    def in_use(self, axes: tuple[Axis, ...] = (Axis.DP, Axis.TP, Axis.PP, Axis.CP, Axis.EP, Axis.DP_SHARD)) -> list[str]:
        """``axis=degree`` for each of ``axes`` above 1, as messages name the mechanisms a mesh runs."""
        return [f"{axis.value}={getattr(self, axis.value)}" for axis in axes if getattr(self, axis.value) > 1]

    def check_world_size(self, world_size: int) -> None:
        if world_size != self.world_size:
            order = (Axis.DP, Axis.TP, Axis.PP, Axis.CP) if self.cp > 1 else (Axis.DP, Axis.TP, Axis.PP)
            product, values = "*".join(order), "*".join(str(getattr(self, n)) for n in order)
            raise ValueError(
                f"world size {world_size} != {product} = {values} = {self.world_size}; "
                f"launch {plural(self.world_size, 'process')} (e.g. torchrun --nproc-per-node {self.world_size}) "
                f"or change {'/'.join(order)} so that their product is {world_size}"
            )


class NamedDegrees:
    """The degrees by name (``est.tp``) for a value that holds a ``ParallelDims`` as ``dims``: the
    planner's estimates and the zoo's meshes are read a column at a time."""

    dims: ParallelDims

    dp = property(lambda self: self.dims.dp)
    tp = property(lambda self: self.dims.tp)
    pp = property(lambda self: self.dims.pp)
    cp = property(lambda self: self.dims.cp)
    ep = property(lambda self: self.dims.ep)
    dp_shard = property(lambda self: self.dims.dp_shard)  # ranks of dp sharding one copy of the weights (FSDP)
