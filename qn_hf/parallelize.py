"""``parallelize``: validate, join the process group, build the mesh, shard, synchronize."""

from __future__ import annotations

import datetime
import warnings
from collections.abc import Sequence

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh

from .comm import flat_broadcast_
from .data_parallel import DEFAULT_BUCKET_MB, GradBuckets
from .mesh import ParallelDims, build_mesh, check_mesh, default_device, init_distributed, launched_world_size
from .parallel_model import Groups, ParallelModel
from .pipeline.runtime import Peers
from .pipeline.split import StagePlan, StandIn, apply_stage
from .plan import ModelPolicy, TpPlan
from .rng import SHARED, TP_LOCAL, RngStreams, stream_seeds
from .shard import ShardSpec
from .tensor_parallel import apply_tp_plan
from .validate import check_parallel_config

_MARK = "_qn_hf_parallelized"


def parallelize(
    model: nn.Module,
    *,
    dp: int = 1,
    tp: int = 1,
    pp: int = 1,
    microbatches: int = 1,
    schedule: str = "1f1b",
    policy: ModelPolicy | None = None,
    layers_per_stage: Sequence[int] | None = None,
    mesh: DeviceMesh | None = None,
    device: torch.device | None = None,
    seed: int | None = None,
    bucket_mb: float = DEFAULT_BUCKET_MB,
    checkpoint: str | None = None,
    timeout: datetime.timedelta = datetime.timedelta(minutes=10),
) -> ParallelModel:
    """Shard ``model`` (in place) over a (dp, pp, tp) mesh and return its ``ParallelModel``.

    Every check that can fail runs before the first collective, identically on every rank.
    ``layers_per_stage`` sets how many blocks each pipeline stage gets (default: as even as
    possible, earlier stages taking the remainder). ``mesh`` reuses an existing ("dp", "pp", "tp") mesh; ``seed`` seeds dropout (default: rank 0's
    ``torch.initial_seed()``, shared with all ranks); ``bucket_mb`` is the size of the gradient
    buckets all-reduced over dp during backward; ``checkpoint`` (a Hugging Face directory or a qn_hf
    checkpoint) supplies the weights: with a model built on the ``meta`` device, each rank
    allocates and reads only its own shard, so no rank ever holds the whole model; ``timeout``
    bounds every collective when this call creates the process group.
    """
    if getattr(model, _MARK, False):
        raise ValueError("this model is already parallelized; load a fresh copy to parallelize it again")
    checked = check_parallel_config(model, dp=dp, tp=tp, pp=pp, microbatches=microbatches, schedule=schedule,
                                    policy=policy, layers_per_stage=layers_per_stage)
    dims, plan, stage_plan = checked.dims, checked.tp_plan, checked.stage_plan
    if not bucket_mb > 0:
        raise ValueError(f"bucket_mb={bucket_mb!r} must be positive")
    dims.check_world_size(launched_world_size())
    _check_tensors(model, checkpoint=checkpoint)

    device = device or default_device()
    init_distributed(device=device, timeout=timeout)
    dims.check_world_size(dist.get_world_size())
    if mesh is None:
        mesh = build_mesh(dims, device=device, timeout=timeout)
    check_mesh(mesh, dims)
    groups = Groups(
        dp=mesh.get_group("dp"),
        tp=mesh.get_group("tp"),
        pp=mesh.get_group("pp"),
        kv=_kv_replica_group(mesh, plan, timeout),
        tie=_tie_group(mesh, stage_plan, timeout),
    )
    coords = {d: mesh.get_local_rank(d) for d in ("dp", "pp", "tp")}
    if pp > 1 and microbatches < pp and dist.get_rank() == 0:
        bubble = (pp - 1) / (microbatches + pp - 1)
        warnings.warn(f"microbatches={microbatches} < pp={pp}: each stage idles {bubble:.0%} of a step (pipeline bubble "
                      f"(pp-1)/(microbatches+pp-1)); use microbatches >= 2*pp={2 * pp} if the batch allows", stacklevel=2)

    stage = apply_stage(model, stage_plan, stage=coords["pp"])
    plan = plan.only(lambda name: _on_this_stage(model, name))
    specs, vocab = apply_tp_plan(model, plan, tp_rank=coords["tp"], group=groups.tp)
    if checkpoint is not None and any(p.is_meta for p in model.parameters()):
        _materialize(model, device)
    else:
        model.to(device)
    if checkpoint is None:  # loading gives every replica the same bytes anyway
        _synchronize_replicas(model, specs, groups, stage_plan)
    rng = _install_rng_streams(model, plan, coords, device, seed)
    setattr(model, _MARK, True)
    pm = ParallelModel(
        module=model,
        mesh=mesh,
        dims=dims,
        groups=groups,
        plan=plan,
        stage_plan=stage_plan,
        stage=stage,
        peers=_peers(mesh, coords),
        specs=specs,
        vocab=vocab,
        microbatches=microbatches,
        schedule=schedule,
        device=device,
        rng=rng,
        buckets=_grad_buckets(model, groups, dims, bucket_mb),
    )
    if checkpoint is not None:
        pm.load_checkpoint(checkpoint)
    return pm


def _check_tensors(model: nn.Module, *, checkpoint: str | None) -> None:
    # Frozen parameters (requires_grad=False: a PEFT base, MoE routing biases that transformers updates
    # outside the optimizer) take no part in any gradient collective: buckets and sums take only the
    # parameters that train, the same set on every rank of a group.
    dtypes = {p.dtype for p in model.parameters() if p.is_floating_point()}
    if len(dtypes) > 1:
        raise ValueError(f"the model's parameters mix dtypes {sorted(map(str, dtypes))}; cast it to one, e.g. model.to(torch.bfloat16)")
    devices = {t.device for t in model.parameters()} | {t.device for t in model.buffers()}
    if any(d.type == "meta" for d in devices):
        if checkpoint is None:
            raise ValueError("the model is on the meta device; pass checkpoint=<HF directory or qn_hf checkpoint> "
                             "so each rank reads its shard, or load real weights first")
        return
    if len(devices) > 1:
        raise ValueError(f"the model's tensors are spread over devices {sorted(map(str, devices))}; move it to one device first")


def _kv_replica_group(mesh: DeviceMesh, plan: TpPlan, timeout: datetime.timedelta):
    """Groups of consecutive tp ranks that hold the same KV heads; all ranks create all groups."""
    replicas = plan.layout.kv_replicas
    if replicas == 1 or not any(style == "colwise_kv" for _, style in plan.rules):
        return None
    mine = None
    for tp_ranks in mesh.mesh.reshape(-1, plan.tp).tolist():
        for i in range(0, plan.tp, replicas):
            ranks = tp_ranks[i : i + replicas]
            group = dist.new_group(ranks, timeout=timeout)
            if dist.get_rank() in ranks:
                mine = group
    return mine


def _materialize(model: nn.Module, device: torch.device) -> None:
    """Allocate this rank's (already sharded) meta tensors; the checkpoint fills the parameters.
    Non-persistent buffers (rotary frequencies) are in no checkpoint: HF's own init recomputes them."""
    model.to_empty(device=device)
    init = getattr(model, "_init_weights", None)
    with torch.no_grad():
        for module in model.modules():
            if hasattr(module, "reset_buffers"):  # a parallel layer that keeps a replaced module's buffers
                module.reset_buffers()
            elif module._non_persistent_buffers_set and not isinstance(module, StandIn):
                if init is None:
                    raise ValueError(f"{type(module).__name__} has non-persistent buffers and the model no _init_weights")
                init(module)


def _grad_buckets(model: nn.Module, groups: Groups, dims: ParallelDims, bucket_mb: float) -> GradBuckets | None:
    if dims.dp == 1:
        return None
    params = [p for p in model.parameters() if p.requires_grad]
    return GradBuckets(params, group=groups.dp, bucket_bytes=int(bucket_mb * 1024 * 1024))


def _on_this_stage(model: nn.Module, name: str) -> bool:
    """Whether the module ``name`` is real on this rank (not dropped, not a stage stand-in)."""
    module = model
    for part in name.split("."):
        module = getattr(module, part, None)
        if not isinstance(module, nn.Module) or isinstance(module, StandIn):
            return False
    return True


def _tie_group(mesh: DeviceMesh, stage_plan: StagePlan, timeout: datetime.timedelta):
    """For each (dp, tp): the first and last stage, which hold the two copies of a tied weight."""
    if not stage_plan.ties:
        return None
    mine = None
    grid = mesh.mesh  # [dp, pp, tp]
    for d in range(grid.shape[0]):
        for t in range(grid.shape[2]):
            ranks = [int(grid[d, 0, t]), int(grid[d, -1, t])]
            group = dist.new_group(ranks, timeout=timeout)
            if dist.get_rank() in ranks:
                mine = group
    return mine


def _peers(mesh: DeviceMesh, coords: dict[str, int]) -> Peers:
    grid = mesh.mesh
    d, p, t = coords["dp"], coords["pp"], coords["tp"]
    return Peers(
        prev=int(grid[d, p - 1, t]) if p > 0 else None,
        next=int(grid[d, p + 1, t]) if p < grid.shape[1] - 1 else None,
    )


def _synchronize_replicas(
    model: nn.Module, specs: dict[str, ShardSpec | None], groups: Groups, stage_plan: StagePlan
) -> None:
    """Make copies that must be equal exactly equal: what is replicated across tp (from tp rank 0),
    KV-head replicas (from the first replica), the last stage's copy of a tied weight (from the
    first stage), and everything across dp (from dp rank 0)."""
    named = dict(model.named_parameters())
    tied = [named[n].data for tie in stage_plan.ties for n in (tie.owner, tie.follower) if n in named]
    tp_replicated = [p.data for n, p in named.items() if specs.get(n) is None]
    kv_replicated = [p.data for n, p in named.items() if (s := specs.get(n)) is not None and s.replicas > 1]
    with torch.no_grad():
        flat_broadcast_(tp_replicated, src_group_rank=0, group=groups.tp)
        if groups.kv is not None:
            flat_broadcast_(kv_replicated, src_group_rank=0, group=groups.kv)
        if groups.tie is not None:
            flat_broadcast_(tied, src_group_rank=0, group=groups.tie)
        flat_broadcast_([p.data for p in named.values()], src_group_rank=0, group=groups.dp)


def _install_rng_streams(
    model: nn.Module, plan: TpPlan, coords: dict[str, int], device: torch.device, seed: int | None
) -> RngStreams:
    if seed is None:
        shared = torch.tensor([torch.initial_seed() % (2**62)], dtype=torch.int64, device=device)
        dist.broadcast(shared, src=0)
        seed = int(shared.item())
    streams = RngStreams(
        device=device, seeds=stream_seeds(base_seed=seed, dp_rank=coords["dp"], tp_rank=coords["tp"], pp_rank=coords["pp"])
    )
    for name in plan.tp_rng_regions:
        streams.hook_module(model.get_submodule(name), TP_LOCAL)
    for name in plan.shared_rng_regions:
        streams.hook_module(model.get_submodule(name), SHARED)
    return streams
