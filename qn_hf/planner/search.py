"""Every (dp, tp, pp, cp) for a number of GPUs, checked as ``parallelize`` checks, estimated and ranked.

Candidates keep tensor parallelism inside a node (tp divides the GPUs per node, or the whole world
when it is smaller) and, unless ``cp`` fixes it, take context parallelism among the divisors of
what is left up to ``max_cp`` (8) with its ring inside the node too (cp x tp ranks at most the GPUs
per node; ranks are laid out dp, pp, cp, tp): ring attention sends a key/value block per layer and
ring step, on the critical path unless the link outpaces attention. Each one goes through the same
validation ``parallelize`` runs (heads and KV heads over tp, blocks over pp, what ring attention
can compute) and ``train_step``'s check of the sequence length (2*cp pieces); a rejected mesh keeps
that exact message. Expert parallelism is given (``ep``: every mesh takes it, those whose dp x tp it
does not divide rejected with ``parallelize``'s message) or, for a model whose fused experts the
planner models (``Planner.experts``), enumerated (``ep=None``): each mesh at ep=1 and at every ep > 1
that divides both the experts of a layer and the mesh's dp x tp; a dense model is planned at ep=1.
Meshes with ep > 1 take cp=1 unless ``cp`` is given (each (tp, ep) traces its own dispatch, and
(cp, ep) pairs would multiply them). Sharded data parallelism is given too (``dp_shard``: every mesh
takes it, those whose dp it does not divide rejected), or enumerated (``dp_shard=None``: each mesh
at every dp_shard dividing its dp; ZeRO-1, if asked for, only at dp_shard=1, as dp_shard already
shards what ZeRO-1 shards and more). Accepted meshes are ranked:
those that fit the GPU memory first, then by estimated tokens per second.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field

from ..config.dims import MESH_DEGREES
from ..config.parallel_config import ParallelConfig
from ..config.schedule import Schedule, microbatches_allowed
from .calibration import Calibration
from .cost import Hardware, StepTime, step_time
from .estimate import Planner
from .results import MeshEstimate

MAX_CP = 8


@dataclass(frozen=True)
class Candidate:
    estimate: MeshEstimate
    time: StepTime
    peak_bytes: int
    fits: bool


@dataclass(frozen=True)
class Rejected:
    """A mesh ``parallelize`` (or the global batch) refuses, with its reason. The degrees (``ParallelDims``'
    names) are the ones asked for, kept as numbers: many are refused because ``ParallelDims`` itself refuses
    them (a dp_shard or an ep that does not divide), so no ``ParallelDims`` holds them."""

    degrees: Mapping[str, int] = field(hash=False)  # a dict, so not hashed: equal refusals hash alike by their reason
    reason: str

    @property
    def mesh(self) -> tuple[int, ...]:
        """The degrees of the mesh's own dims (those that take ranks), in ``MESH_DEGREES``' order."""
        return tuple(self.degrees.get(name, 1) for name in MESH_DEGREES)


def meshes(gpus: int, *, gpus_per_node: int, cp: int | None = None, max_cp: int = MAX_CP) -> list[dict[str, int]]:
    """The mesh dims' degrees (dp, tp, pp, cp) whose product is ``gpus``; ``cp`` None: every divisor up to
    ``max_cp`` whose ring stays in a node (see the module docstring)."""
    out = []
    for tp in range(1, gpus + 1):
        if gpus % tp or (gpus >= gpus_per_node and gpus_per_node % tp) or tp > gpus_per_node:
            continue
        rest = gpus // tp
        for c in [cp] if cp is not None else range(1, min(rest, max_cp, max(1, gpus_per_node // tp)) + 1):
            if rest % c:
                continue
            for pp in range(1, rest // c + 1):
                if (rest // c) % pp == 0:
                    out.append(dict(dp=rest // c // pp, tp=tp, pp=pp, cp=c))
    return out


def microbatches_for(pp: int, requested: int | None, *, schedule: str = "1f1b", dp: int = 1,
                     global_batch: int | None = None, micro_batch_size: int = 1) -> int:
    """Microbatches per step: as requested (an M the schedule refuses is refused with its message);
    with a ``global_batch``, what trains exactly that many sequences at this dp (``ValueError`` when
    dp x micro-batch size does not divide it); else the first M from 4 per stage that the schedule
    allows (1F1B's bubble (pp-1)/(5pp-1) < 20%)."""
    if requested is not None:
        return requested
    if global_batch is not None:
        per = dp * micro_batch_size
        if global_batch % per:
            raise ValueError(f"the global batch of {global_batch} sequences is not a whole number of microbatches "
                             f"of dp={dp} x micro-batch {micro_batch_size} = {per} sequences")
        return global_batch // per
    m = 4 * pp
    while not microbatches_allowed(schedule=schedule, stages=pp, microbatches=m):
        m += 1
    return m


def at_mesh(options: Mapping[str, object], degrees: Mapping[str, int], *, microbatches: int) -> ParallelConfig:
    """``options`` (``ParallelConfig`` keywords: the schedule, virtual stages, precision, recomputation,
    sequence parallelism, buckets and gather every mesh shares) at these ``degrees`` (by name) and microbatches,
    checked as ``parallelize`` checks its keywords: the ``ValueError`` that rejects the mesh, else the value."""
    return ParallelConfig.from_keywords(**{**options, **degrees, "microbatches": microbatches})


def search(planner: Planner, options: Mapping[str, object], *, gpus: int, hw: Hardware, zero: bool = False,
           microbatches: int | None = None, global_batch: int | None = None, fixed: dict[str, int] | None = None,
           cp: int | None = None, max_cp: int = MAX_CP, ep: int | None = 1,
           dp_shard: int | None = 1, calibration: Calibration | None = None,
           single_stage: bool = True) -> tuple[list[Candidate], list[Rejected]]:
    """Every mesh for ``gpus`` (``cp`` and ``max_cp`` as ``meshes`` takes them; ``fixed`` degrees, e.g.
    ``{"tp": 8}``, kept), each ``options`` at its degrees and microbatches (``at_mesh``: the degrees
    and microbatches of ``options`` are the search's, its other fields every mesh's; a schedule some
    meshes cannot run, as interleaved_1f1b at pp=1, rejects those with its message), estimated with
    ``zero`` (as ``Planner.estimate``). With ``global_batch`` every mesh trains exactly that many
    sequences per step (its microbatches follow from dp); a mesh that cannot is rejected, saying
    why. ``ep`` and ``dp_shard``: given, or None to enumerate them (module docstring). Step times
    at ``calibration`` (``cost.step_time``; None: ``hw``'s stated figures). ``single_stage`` False: the
    meshes with pp > 1 only (one stage runs every schedule alike: a caller searching several
    schedules prices it under one)."""
    groups, rejected = mesh_groups(planner, options, gpus=gpus, hw=hw, zero=zero, microbatches=microbatches,
                                   global_batch=global_batch, fixed=fixed, cp=cp, max_cp=max_cp, ep=ep,
                                   dp_shard=dp_shard, single_stage=single_stage)
    accepted = []
    for group in groups:
        for parallel in group.configs:
            found = estimated(planner, parallel, zero=group.zero_at(parallel), hw=hw, calibration=calibration,
                              rejected=rejected)
            if found is not None:
                accepted.append(found)
    accepted.sort(key=lambda c: (not c.fits, -c.time.tokens_per_s))
    return accepted, rejected


@dataclass(frozen=True)
class MeshGroup:
    """One mesh shape's configurations (dp, tp, pp, cp, ep, its microbatches and the options), at
    each dp_shard searched: they share the stages' compute (a step's floor, ``cost.step_floor``)."""

    configs: tuple[ParallelConfig, ...]
    zero: bool  # ZeRO-1 asked for
    dp_shard_given: bool  # False: enumerated, and ZeRO-1 applies at dp_shard=1 only (module docstring)

    def zero_at(self, parallel: ParallelConfig) -> bool:
        """Whether ``parallel`` (one of ``configs``) is estimated with ZeRO-1."""
        return self.zero and (self.dp_shard_given or parallel.dims.dp_shard == 1)


def mesh_groups(planner: Planner, options: Mapping[str, object], *, gpus: int, hw: Hardware, zero: bool = False,
                microbatches: int | None = None, global_batch: int | None = None, fixed: dict[str, int] | None = None,
                cp: int | None = None, max_cp: int = MAX_CP, ep: int | None = 1, dp_shard: int | None = 1,
                single_stage: bool = True) -> tuple[list[MeshGroup], list[Rejected]]:
    """``search``'s configurations, not yet estimated, one ``MeshGroup`` per (mesh, ep), and the
    meshes refused before any estimate (the global batch at a dp, a degree ``ParallelConfig`` refuses)."""
    groups, rejected = [], []
    cp = 1 if cp is None and ep is not None and ep > 1 else cp
    fixed = fixed or {}
    for mesh in meshes(gpus, gpus_per_node=hw.gpus_per_node, cp=cp, max_cp=max_cp):
        dp, pp = mesh["dp"], mesh["pp"]
        if any(mesh[k] != v for k, v in fixed.items()) or pp == 1 and not single_stage:
            continue
        try:
            steps = microbatches_for(pp, microbatches, schedule=options.get("schedule", Schedule.ONE_F_ONE_B), dp=dp,
                                     global_batch=global_batch, micro_batch_size=planner.micro_batch_size)
        except ValueError as e:  # the global batch at this dp: the same reason at every ep and dp_shard
            rejected.append(Rejected(degrees=dict(mesh, ep=ep or 1, dp_shard=dp_shard or 1), reason=str(e)))
            continue
        for e in [ep] if ep is not None else expert_degrees(planner.experts, mesh, cp_given=cp is not None):
            shards = [d for d in range(1, dp + 1) if dp % d == 0] if dp_shard is None else [dp_shard]
            configs = []
            for shard in shards:
                degrees = dict(mesh, ep=e, dp_shard=shard)
                try:
                    configs.append(at_mesh(options, degrees, microbatches=steps))
                except ValueError as error:
                    _refused(rejected, Rejected(degrees=degrees, reason=str(error)))
            if configs:
                groups.append(MeshGroup(configs=tuple(configs), zero=zero, dp_shard_given=dp_shard is not None))
    return groups, rejected


def estimated(planner: Planner, parallel: ParallelConfig, *, zero: bool, hw: Hardware,
              calibration: Calibration | None, rejected: list[Rejected]) -> Candidate | None:
    """``parallel`` estimated and priced, or None with the reason ``parallelize`` would refuse it
    added to ``rejected``."""
    try:
        est = planner.estimate(parallel, zero=zero)
    except ValueError as error:
        refuse(rejected, parallel, error)
        return None
    return evaluate(est, hw=hw, calibration=calibration)


def refuse(rejected: list[Rejected], parallel: ParallelConfig, error: ValueError) -> None:
    """``parallel``'s refusal added to ``rejected`` (``_refused``)."""
    _refused(rejected, Rejected(degrees=parallel.dims.degrees(), reason=str(error)))


def _refused(rejected: list[Rejected], refusal: Rejected) -> None:
    """``refusal`` listed unless the same mesh was refused for the same reason at another ep or dp_shard."""
    if not any((o.mesh, o.reason) == (refusal.mesh, refusal.reason) for o in rejected):
        rejected.append(refusal)


def expert_degrees(experts: int, mesh: Mapping[str, int], *, cp_given: bool) -> list[int]:
    """The ep a search tries on a mesh: 1, and for a model with ``experts`` routed experts per layer
    (0: none the planner shards) every ep > 1 dividing them and dp x tp (only at cp=1 unless cp was
    given: module docstring); ``mesh``: the mesh dims' degrees by name."""
    more = range(2, experts + 1) if mesh["cp"] == 1 or cp_given else ()
    return [1] + [e for e in more if experts % e == 0 and mesh["dp"] * mesh["tp"] % e == 0]


def evaluate(est: MeshEstimate, *, hw: Hardware, calibration: Calibration | None = None) -> Candidate:
    peak = est.peak_bytes
    return Candidate(estimate=est, time=step_time(est, hw, calibration), peak_bytes=peak, fits=peak <= hw.gpu_memory)
