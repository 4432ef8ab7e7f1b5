"""``auto_config``: the configuration the planner predicts fastest among those that fit, for a world
size, a global batch and a sequence length.

What is searched: every mesh ``search`` enumerates (dp, tp, pp, cp, ep, dp_shard), at every
micro-batch size (a power of two up to ``MAX_MICRO_BATCH``) that trains exactly ``global_batch``
sequences per step, and under a pipeline the schedules 1F1B, interleaved 1F1B at two chunks per
rank and zb_h1. What can only be slower is left out: GPipe (1F1B's time, holding more
activations), at pp=1 a micro-batch smaller than the largest that fits (the same work in smaller
products), and recomputation for a configuration that fits without it (the forward runs again;
selective is tried before full), and after full recomputation, for one that still does not fit, the loss in
chunks (``loss_chunk_tokens``) and then the blocks' inputs held on the host (``offload``): ``shapes.MEMORY_OPTIONS``. ZeRO-1 is not
chosen: it is ``qn_hf.optimizer``'s option, not the configuration's, and dp_shard (searched)
shards what it shards and more. Options the caller fixes (``fixed``: ``ParallelConfig`` keywords,
as mixed precision or one degree) are kept in every candidate.

Pricing every candidate takes minutes at a thousand GPUs, so the search prices mesh shapes from
the lowest floor up (a step's least time at the shape: its matmuls and attention alone,
``cost.step_floor``) and stops where a floor exceeds the runner-up found so far: what it leaves out
could be neither chosen nor the runner-up (``auto_plan``).

The ranking is the planner's: fits in ``device_memory`` first, then the predicted step time
(``cost.step_time`` at the calibration, or at the stated GPU figures, each assumed one named in the
choice); times within ``TIE`` of the fastest are a tie, won by the fewest moving parts
(``moving_parts``), then by the configuration's own order, so the choice is a function of its inputs
alone: identical on every rank given the same calibration. ``auto_config`` without one measures this
machine (machine.py: every rank at once, kept for later jobs) unless it is a GPU the stated figures
describe; there, without ``device_memory``, it agrees each rank's device memory over the job, the
smallest, joining the launched job's process group first if it is not up yet.
"""

from __future__ import annotations

import datetime
import functools
import gc
import os
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, replace
from typing import TypeVar

import torch
import torch.distributed as dist
from torch import nn

from ..arguments import plural
from ..config.dims import DEGREES, MESH_DEGREES, TIE_ORDER, Axis
from ..config.parallel_config import ParallelConfig
from ..config.schedule import Schedule, as_schedule
from ..devices import default_device
from ..launch.nodes import ranks_per_node
from ..mesh import init_distributed, launched_world_size
from .calibration import Calibration
from .cost import COMM_PARTS, GIB, Hardware, StepTime
from .estimate import Planner
from .machine import machine_calibration
from .search import Candidate, Rejected, mesh_groups
from .shapes import MeshShape, memory_options, price, undominated, with_memory_options

_T = TypeVar("_T")
AUTO = "auto"  # parallelize's mesh= that asks for this module's choice
MAX_MICRO_BATCH = 8
_SCHEDULES = ((Schedule.ONE_F_ONE_B, 1), (Schedule.INTERLEAVED_1F1B, 2), (Schedule.ZB_H1, 1))


@dataclass(frozen=True)
class Choice:
    """``auto_plan``'s answer: the chosen configuration with its micro-batch size, predicted step
    time and peak memory per rank; the runner-up and why it lost; every feasible candidate priced
    (all of them under ``exhaustive``: the benchmark measures them), how many were left unpriced, and
    what the search rejected; the figures assumed, not measured."""

    config: ParallelConfig
    micro_batch_size: int
    time: StepTime
    peak_bytes: int
    runner_up: Candidate | None
    why: str
    feasible: tuple[Candidate, ...]
    rejected: tuple[Rejected, ...] = ()
    assumed: tuple[str, ...] = ()
    device_memory: int = 0
    unpriced: int = 0  # configurations slower than the runner-up by their compute, or over the memory by their state

    def summary(self) -> str:
        lines = [f"chosen: {describe(self.config, self.micro_batch_size)}: predicted step "
                 f"{self.time.seconds * 1e3:.1f} ms, peak {self.peak_bytes / GIB:.2f} GiB per rank "
                 f"of {self.device_memory / GIB:.2f} GiB"]
        if self.runner_up is not None:
            up = self.runner_up
            lines.append(f"runner-up: {describe(up.estimate.parallel, up.estimate.micro_batch_size)}: "
                         f"{up.time.seconds * 1e3:.1f} ms ({self.why})")
        lines.append(f"{plural(len(self.feasible), 'feasible configuration')} ranked"
                     + (f"; {plural(self.unpriced, 'configuration')} left unpriced (slower than the runner-up by "
                        f"their matmuls and attention alone, or over the memory by their state alone)"
                        if self.unpriced else ""))
        if self.assumed:
            lines.append("assumed, not measured (run qn-hf-plan --calibrate): " + ", ".join(self.assumed))
        return "\n".join(lines)


def describe(config: ParallelConfig, micro_batch_size: int) -> str:
    """One line a user can copy: the degrees that are not 1, the schedule under a pipeline, the rest."""
    d = config.dims
    degrees = d.in_use() or ["dp=1"]
    rest = [f"microbatches={config.microbatches}", f"micro_batch_size={micro_batch_size}"]
    if d.pp > 1:
        rest.append(f"schedule={config.schedule.value}")
        if config.virtual_stages > 1:
            rest.append(f"virtual_stages={config.virtual_stages}")
    if config.recompute is not None:
        rest.append(f"recompute={config.recompute.value}")
    if config.loss_chunk_tokens is not None:
        rest.append(f"loss_chunk_tokens={config.loss_chunk_tokens}")
    if config.offload is not None:
        rest.append(f"offload={config.offload.value}")
    if config.mixed_precision is not None:
        rest.append(f"mixed_precision={config.mixed_precision.value}")
    return ", ".join(degrees + rest)


# StepTime's parts, as a user reads them
_PARTS = {"compute": "compute and pipeline bubble", **{role.value: text for role, text in COMM_PARTS.items()},
          "optimizer": "optimizer step"}


def _why(chosen: Candidate, other: Candidate) -> str:
    """The part of the predicted time where ``other`` loses the most to ``chosen``."""
    if other.time.seconds <= chosen.time.seconds:
        return (f"x{other.time.seconds / chosen.time.seconds:.3f}: a tie (within {TIE:.0%}), and the chosen one runs "
                f"fewer mechanisms")
    worst = max(_PARTS, key=lambda p: getattr(other.time, p) - getattr(chosen.time, p))
    extra = getattr(other.time, worst) - getattr(chosen.time, worst)
    return f"x{other.time.seconds / chosen.time.seconds:.2f} slower: {_PARTS[worst]} +{extra * 1e3:.1f} ms"


def _order(c: Candidate) -> tuple:
    """Fits first, then predicted time; ties by the configuration's own fields (deterministic)."""
    p = c.estimate.parallel
    d = p.dims
    return (not c.fits, round(c.time.seconds, 12), *(getattr(d, name) for name in TIE_ORDER), p.schedule.value,
            p.virtual_stages, p.recompute.value if p.recompute else "", p.loss_chunk_tokens or 0,
            p.offload.value if p.offload else "", -c.estimate.micro_batch_size)


# Predicted times closer than this are a tie: the predictions are not that exact (docs/auto.md measures
# them within 30%), and a mechanism that is not needed is work and collectives a run need not take on.
TIE = 0.01


def moving_parts(config: ParallelConfig) -> int:
    """How many mechanisms ``config`` runs beyond plain data parallelism: each degree above 1 but dp's,
    chunks beyond one per stage, a schedule other than 1F1B under a pipeline, recomputation, the loss in chunks,
    offload."""
    d = config.dims
    return (sum(degree > 1 for name, degree in d.degrees().items() if name != Axis.DP) + (config.virtual_stages > 1)
            + (d.pp > 1 and config.schedule is not Schedule.ONE_F_ONE_B) + (config.recompute is not None)
            + (config.loss_chunk_tokens is not None) + (config.offload is not None))


def micro_batch_sizes(global_batch: int) -> list[int]:
    return [m for m in (1, 2, 4, 8, 16, 32) if m <= MAX_MICRO_BATCH and global_batch % m == 0]


def _collector_paused(search: Callable[..., _T]) -> Callable[..., _T]:
    """``search`` run with Python's cyclic garbage collector off, and on again after as it was: a search
    builds millions of small objects it keeps to its end (its caches, the candidates), and the
    collector's passes over them took a sixth of a search at a thousand GPUs (4 s of 21 for Mixtral
    8x22B), while it makes next to no cyclic garbage (the peak memory is the same without them);
    reference counting frees what it drops as always."""
    @functools.wraps(search)
    def paused(*args, **kwargs) -> _T:
        enabled = gc.isenabled()
        gc.disable()
        try:
            return search(*args, **kwargs)
        finally:
            if enabled:
                gc.enable()
    return paused


@_collector_paused
def auto_plan(config, *, global_batch: int, seq_len: int, world_size: int, device_memory: int,
              calibration: Calibration | None = None, dtype: torch.dtype = torch.float32,
              model_class: type | None = None, fixed: Mapping[str, object] | None = None,
              gpus_per_node: int | None = None, expert_loads: Sequence[Sequence[float]] | None = None,
              exhaustive: bool = False) -> Choice:
    """Search (module docstring) and rank; ``ValueError`` when nothing fits, naming the closest
    miss and what would make it fit. ``config``: the model's ``PretrainedConfig``; ``expert_loads``:
    the router's loads per MoE layer and batch (expert_parallel/routing_costs.py; None: uniform routing).

    Mesh shapes are priced in the order of their floors (``cost.step_floor`` from ``Planner.work``,
    the compute alone, before any estimate: the busiest rank's, then the schedule's lists walked for
    those that lead); once the least floor left exceeds the runner-up found so far, every shape left
    is left out (``Choice.unpriced``, with the configurations that, once one fits, hold more than the
    memory before any activation): none of its configurations could be chosen or be the runner-up,
    so both are an exhaustive search's (``exhaustive=True`` prices every one: ``feasible`` then lists
    them all)."""
    fixed = dict(fixed or {})
    if "microbatches" in fixed:
        raise ValueError(f"microbatches={fixed['microbatches']} with mesh='auto': the microbatches follow from the "
                         f"global batch, dp and the micro-batch size auto chooses; leave them out")
    degrees = {name: fixed.pop(name) for name in DEGREES if name in fixed}
    schedules = _schedules(fixed)
    fallbacks = memory_options(fixed)  # (raising here what parallelize refuses of the fixed ones)
    per_node = gpus_per_node or (calibration.ranks_per_node if calibration else min(world_size, 8))
    hw = Hardware(gpu_memory=device_memory, gpus_per_node=per_node)
    rejected: list[Rejected] = []
    shapes: dict[tuple, MeshShape] = {}
    first: Planner | None = None
    for mbs in micro_batch_sizes(global_batch):
        if first is None:
            first = Planner(config, seq_len=seq_len, micro_batch_size=mbs, dtype=dtype, model_class=model_class,
                            expert_loads=expert_loads)
        planner = first.at_micro_batch_size(mbs)
        for schedule, chunks in schedules:
            options = {**fixed, "schedule": schedule, "virtual_stages": chunks}
            groups, refused = mesh_groups(planner, options, gpus=world_size, hw=hw, global_batch=global_batch,
                                          # the mesh's dims fixed; ep and dp_shard searched per mesh unless given
                                          fixed={a: v for a, v in degrees.items() if a in MESH_DEGREES},
                                          cp=degrees.get(Axis.CP), ep=degrees.get(Axis.EP),
                                          dp_shard=degrees.get(Axis.DP_SHARD),
                                          # one stage runs every schedule alike: counted once, as 1F1B
                                          single_stage=len(schedules) == 1 or schedule == Schedule.ONE_F_ONE_B)
            rejected += refused
            for group in groups:
                d = group.configs[0].dims
                # at pp=1 a candidate is left out when its larger micro-batch fits (undominated):
                # every micro-batch size of such a shape is priced, or left out, together
                key = (replace(d, dp_shard=1), schedule, chunks) + ((mbs,) if d.pp > 1 else ())  # any dp_shard
                shapes.setdefault(key, MeshShape()).add(planner, group, hw=hw, calibration=calibration, rejected=rejected)
    live = sorted((shape for shape in shapes.values() if shape.configs), key=lambda shape: shape.floor)
    priced = price(live, exhaustive=exhaustive, device_memory=device_memory, options=fallbacks, hw=hw,
                   calibration=calibration, rejected=rejected)
    accepted, unpriced = priced.accepted, priced.unpriced
    if accepted and not any(c.fits for c in accepted):
        for i, planner in priced.hopeless:
            accepted[i] = with_memory_options(planner, accepted[i], fallbacks, hw=hw, calibration=calibration)
    if not accepted:
        reasons = sorted({r.reason for r in rejected})[:3]
        raise ValueError(f"no configuration of {config.model_type} trains a global batch of {global_batch} "
                         f"sequences of {seq_len} tokens on {world_size} ranks: " + "; ".join(reasons))
    accepted = undominated(accepted)
    accepted.sort(key=_order)
    if not accepted[0].fits:
        raise ValueError(_fits_nowhere(accepted[0], config=config, global_batch=global_batch, seq_len=seq_len,
                                       world_size=world_size, device_memory=device_memory))
    # a tie (within TIE of the fastest predicted) goes to the fewest moving parts
    tied = [c for c in accepted if c.fits and c.time.seconds <= accepted[0].time.seconds * (1 + TIE)]
    best = min(tied, key=lambda c: (moving_parts(c.estimate.parallel), _order(c)))
    feasible = (best, *(c for c in accepted if c.fits and c is not best))
    runner = feasible[1] if len(feasible) > 1 else None
    assumed = calibration.assumed if calibration is not None else best.time.assumed
    return Choice(config=best.estimate.parallel, micro_batch_size=best.estimate.micro_batch_size, time=best.time,
                  peak_bytes=best.peak_bytes, runner_up=runner, why=_why(best, runner) if runner else "",
                  feasible=feasible, rejected=tuple(rejected), assumed=assumed, device_memory=device_memory,
                  unpriced=unpriced)


def _schedules(fixed: Mapping[str, object]) -> tuple[tuple[Schedule, int], ...]:
    """The (schedule, chunks per rank) searched: the fixed schedule alone, interleaved 1F1B alone when
    only ``virtual_stages`` > 1 is fixed, else every one of ``_SCHEDULES``."""
    chunks = fixed.get("virtual_stages", 1)
    if "schedule" in fixed:
        return ((as_schedule(fixed["schedule"]), chunks),)
    if chunks != 1:
        return ((Schedule.INTERLEAVED_1F1B, chunks),)
    return _SCHEDULES


def _fits_nowhere(closest: Candidate, *, config, global_batch: int, seq_len: int, world_size: int,
                  device_memory: int) -> str:
    need = closest.peak_bytes
    return (f"no configuration of {config.model_type} fits {device_memory / GIB:.2f} GiB per rank on {world_size} "
            f"ranks at a global batch of {global_batch} x {seq_len} tokens: the closest, "
            f"{describe(closest.estimate.parallel, closest.estimate.micro_batch_size)}, needs {need / GIB:.2f} GiB "
            f"({(need - device_memory) / GIB:.2f} GiB over, with full recomputation, the loss in chunks and offload "
            f"tried where not fixed). To make it fit: more "
            f"devices (about {-(-need * world_size // device_memory)} at this sharding), a shorter sequence "
            f"(activations grow with it), or devices with more memory")


def device_memory_default(calibration: Calibration | None, device: torch.device | None = None) -> int:
    """The calibration's figure, else the CUDA device's total memory, else this node's physical
    memory divided among its ranks."""
    if calibration is not None:
        return calibration.memory_bytes
    if device is not None and device.type == "cuda" or device is None and torch.cuda.is_available():
        return torch.cuda.get_device_properties(device or torch.cuda.current_device()).total_memory
    ranks = ranks_per_node() or launched_world_size()
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") // max(ranks, 1)


def auto_config(model: nn.Module, *, global_batch: int, seq_len: int, world_size: int | None = None,
                device_memory: int | None = None, calibration: Calibration | str | None = None,
                fixed: Mapping[str, object] | None = None,
                expert_loads: Sequence[Sequence[float]] | None = None) -> ParallelConfig:
    """The fastest configuration the planner finds that fits (see ``auto_plan``), training exactly
    ``global_batch`` sequences of ``seq_len`` tokens per step: ``parallelize(model, config)`` takes
    it, and each dp rank's ``train_step`` gets ``global_batch / dp`` sequences. ``world_size``
    defaults to the launched world, ``device_memory`` (bytes) to the device's (agreed over a running
    job: the smallest), ``calibration`` (a ``Calibration`` or its JSON file) to this machine's figures,
    measured by every rank at once the first time and kept (planner/machine.py), or on an H100 or H200, or
    planning for another world size than the launched one, the stated GPU figures. ``fixed``: ``ParallelConfig`` keywords every candidate keeps (mixed_precision, a degree).
    ``expert_loads``: for a model with routed experts, the pairs each expert received per MoE layer and batch of
    your data (``qn_hf.planner.measure_expert_loads``), so that ep is priced at your router's busiest
    rank; without them, at uniform routing (named in the choice's assumed figures)."""
    return auto_choice(model, global_batch=global_batch, seq_len=seq_len, world_size=world_size,
                       device_memory=device_memory, calibration=calibration, fixed=fixed,
                       expert_loads=expert_loads).config


def auto_choice(model: nn.Module, *, global_batch: int, seq_len: int, world_size: int | None = None,
                device_memory: int | None = None, calibration: Calibration | str | None = None,
                fixed: Mapping[str, object] | None = None,
                expert_loads: Sequence[Sequence[float]] | None = None) -> Choice:
    """``auto_config``'s whole answer (``Choice``), for a model (PEFT-wrapped or not)."""
    for name, value in (("global_batch", global_batch), ("seq_len", seq_len)):
        if not isinstance(value, int) or isinstance(value, bool) or value < 1:
            raise ValueError(f"{name}={value!r} must be a positive int (auto chooses the mesh for a step's shape)")
    base = model.get_base_model() if hasattr(model, "get_base_model") else model  # peft: the model it wraps
    if isinstance(calibration, (str, os.PathLike)):
        calibration = Calibration.load(os.fspath(calibration))
    if calibration is None:  # this machine's figures (measured once, kept), or the stated ones on a known GPU
        calibration = machine_calibration(world_size=world_size)
    world = world_size or launched_world_size()
    memory = device_memory or device_memory_default(calibration)
    if device_memory is None and calibration is None and launched_world_size() > 1:
        # each rank reads its own device: agreed over the job (its smallest), so every rank chooses alike;
        # a launched job whose group is not up yet joins it here, as parallelize would
        init_distributed(device=default_device(), timeout=datetime.timedelta(minutes=10))
        agreed = torch.tensor([memory], dtype=torch.int64)  # the smallest rank's, so every rank chooses alike
        if dist.get_backend() == "nccl":
            agreed = agreed.cuda()
        dist.all_reduce(agreed, op=dist.ReduceOp.MIN)
        memory = int(agreed.item())
    dtype = next((p.dtype for p in base.parameters() if p.is_floating_point()), torch.float32)
    return auto_plan(base.config, global_batch=global_batch, seq_len=seq_len, world_size=world, device_memory=memory,
                     calibration=calibration, dtype=dtype, model_class=type(base), fixed=fixed,
                     expert_loads=expert_loads, gpus_per_node=None if world_size else ranks_per_node())
