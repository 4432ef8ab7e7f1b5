"""The parallel degrees as one value: every axis an ``Axis`` member, checked with the numbers in
the message, and the one place that derives the world size, the replicas and the expert replicas.

Pure arithmetic with no process group, so a bad configuration raises the same ``ValueError`` on
every rank before anything communicates.
"""

from __future__ import annotations

import functools
import math
import operator
from collections.abc import Iterable, Mapping
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


@dataclass(frozen=True)
class AxisSpec:
    """One parallel dimension as data: what it splits, where it sits, how it composes with the others.

    ``mesh``: its place among the device mesh's dims (None: carved out of mesh dims, taking no ranks of its own);
    ``rank_order``: its place in the numbering of the global ranks, slowest first (``config/layout.py``);
    ``named_at_one``: a mesh dim the mesh names even at degree 1 (cp is named only when used, so that 3-D
    meshes stay as they were); ``tie_order``: at equal predicted step time, ``mesh="auto"`` prefers the smaller
    degree of the axis first in this order (the mechanism a run can most easily do without: pipeline stages
    first, data parallelism last). A dim with no place on the mesh is carved out of the mesh dims' ranks (its
    ``splits`` says which); ``ParallelDims`` checks that it divides them."""

    axis: Axis
    splits: str
    tie_order: int
    mesh: int | None = None
    rank_order: int | None = None
    named_at_one: bool = True


# The one table of the degrees: their order is the keywords' (``parallelize(dp=, tp=, pp=, cp=, ep=, dp_shard=)``);
# what lists them reads them from here (the mesh's names, the rank numbering, the world size, messages, the
# planner's searched meshes); the places that still spell them out are counted by tests/test_structure.py.
# Each row: the axis, what it splits, its tie order (auto's preference at equal time), its places.
AXES: tuple[AxisSpec, ...] = (
    AxisSpec(Axis.DP, "the batch: each replica trains other sequences", 5, mesh=0, rank_order=1),
    AxisSpec(Axis.TP, "each layer's weights, by columns or rows (heads, channels)", 1, mesh=3, rank_order=3),
    AxisSpec(Axis.PP, "the layers: consecutive blocks per stage", 0, mesh=1, rank_order=0),
    AxisSpec(Axis.CP, "each sequence, by tokens (ring attention)", 2, mesh=2, rank_order=2, named_at_one=False),
    AxisSpec(Axis.EP, "each MoE layer's experts, over ranks of a stage's dp x tp grid; tokens travel to them", 3),
    AxisSpec(Axis.DP_SHARD, "one copy of the weights, gradients and optimizer state, over groups of dp ranks", 4),
)
DEGREES: tuple[str, ...] = tuple(spec.axis.value for spec in AXES)  # the keyword names, in the keywords' order
MESH_AXES: tuple[AxisSpec, ...] = tuple(sorted((s for s in AXES if s.mesh is not None), key=lambda s: s.mesh))
MESH_DEGREES: tuple[str, ...] = tuple(s.axis.value for s in AXES if s.mesh is not None)  # those taking ranks, in order
TIE_ORDER: tuple[str, ...] = tuple(s.axis.value for s in sorted(AXES, key=lambda s: s.tie_order))
RANK_ORDER: tuple[Axis, ...] = tuple(s.axis for s in sorted((s for s in AXES if s.rank_order is not None),
                                                            key=lambda s: s.rank_order))


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
        for name in DEGREES:
            check_positive_int(name, getattr(self, name))
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

    @classmethod
    def of(cls, values: Mapping[str, object], *, axes: Iterable[str] = DEGREES) -> ParallelDims:
        """The degrees ``values`` (e.g. ``parallelize``'s keywords) holds among ``axes``, the others 1."""
        return cls(**{name: values[name] for name in axes if name in values})

    def degrees(self) -> dict[str, int]:
        """Every degree by name, in the keywords' order."""
        return {name: getattr(self, name) for name in DEGREES}

    @functools.cached_property  # (a frozen value: computed once; the planner asks for it per mesh and stage)
    def world_size(self) -> int:
        return math.prod(getattr(self, spec.axis.value) for spec in MESH_AXES)

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

    @functools.cached_property
    def names(self) -> tuple[str, ...]:
        """The mesh's dim names (plain strings, as DeviceMesh keeps them): cp appears only when it is
        used, so 3-D meshes stay as they were."""
        return tuple(s.axis.value for s in MESH_AXES if s.named_at_one or getattr(self, s.axis.value) > 1)

    @property
    def shape(self) -> tuple[int, ...]:
        return tuple(getattr(self, name) for name in self.names)

    @property
    def replicas(self) -> int:
        """How many ranks hold the same parameter shard (and sum its gradients): dp x cp."""
        return self.dp * self.cp

    def in_use(self, axes: Iterable[str] = DEGREES) -> list[str]:
        """``axis=degree`` for each of ``axes`` above 1, as messages name the mechanisms a mesh runs."""
        return [f"{name}={getattr(self, name)}" for name in map(str, axes) if getattr(self, name) > 1]

    def check_world_size(self, world_size: int) -> None:
        if world_size != self.world_size:
            order = [name for name in MESH_DEGREES if name in self.names]
            product, values = "*".join(order), "*".join(str(getattr(self, n)) for n in order)
            raise ValueError(
                f"world size {world_size} != {product} = {values} = {self.world_size}; "
                f"launch {plural(self.world_size, 'process')} (e.g. torchrun --nproc-per-node {self.world_size}) "
                f"or change {'/'.join(order)} so that their product is {world_size}"
            )


class NamedDegrees:
    """The degrees by name (``est.tp``) for a value that holds a ``ParallelDims`` as ``dims``: the
    planner's estimates and the zoo's meshes are read a column at a time (a property per degree, below)."""

    dims: ParallelDims


for _name in DEGREES:  # (properties, not __getattr__: the planner reads them millions of times a search)
    setattr(NamedDegrees, _name, property(operator.attrgetter(f"dims.{_name}")))
del _name
