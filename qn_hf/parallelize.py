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
from .step.compile import apply_compile
from .context_parallel.apply import apply_context_parallel
from .expert_parallel.dispatch import ExpertRoute
from .expert_parallel.apply import apply_expert_parallel, experts_modules
from .peft.lora import unwrap_peft
from .context_parallel.ring_attention import ChunkLayout
from .data_parallel.buckets import DEFAULT_BUCKET_MB, GradBuckets, bucket_size_bytes
from .mesh import Coords, Groups, ParallelDims, build_groups, default_device, init_distributed, launched_world_size
from .parallel_model import ParallelModel
from .pipeline.runtime import StageExecutor
from .pipeline.split import StagePlan
from .pipeline.stage import apply_stage
from .pipeline.schedule import as_schedule
from .pipeline.standins import StandIn
from .placement import ShardPlacement
from .data_parallel.precision import PRECISIONS, LossScaler, apply_mixed_precision
from .memory.recompute import apply_recompute
from .tensor_parallel.sequence_parallel import apply_sequence_parallel, final_norm, regathers, sequence_wire
from .tensor_parallel.plan import ModelPolicy, TpPlan
from .tensor_parallel.rng import SHARED, TP_LOCAL, RngStreams, stream_seeds
from .tensor_parallel.shard import ShardSpec, over_experts
from .tensor_parallel.apply import apply_tp_plan
from .pipeline.weight_grad import WeightGradQueue, make_deferrable
from .config.composition import Feature
from .config.parallel_config import ParallelConfig
from .config.validate import check_parallel_config
from .failure import refused_on_every_rank
from .arguments import unknown_keywords
from .tensor_parallel.styles import Style

_MARK = "_qn_hf_parallelized"


def parallelize(
    model: nn.Module,
    *,
    dp: int = 1,
    tp: int = 1,
    pp: int = 1,
    cp: int = 1,
    ep: int = 1,
    microbatches: int = 1,
    schedule: str = "1f1b",
    virtual_stages: int = 1,
    policy: ModelPolicy | None = None,
    layers_per_stage: Sequence[int] | None = None,
    mesh: DeviceMesh | None = None,
    device: torch.device | None = None,
    seed: int | None = None,
    bucket_mb: float = DEFAULT_BUCKET_MB,
    checkpoint: str | None = None,
    timeout: datetime.timedelta = datetime.timedelta(minutes=10),
    mixed_precision: str | None = None,
    recompute: str | None = None,
    sequence_parallel: bool = False,
    compile: bool = False,
    **unknown: object,
) -> ParallelModel:
    """Shard ``model`` (in place) over a (dp, pp, tp) mesh, or (dp, pp, cp, tp) with ``cp`` > 1, and
    return its ``ParallelModel``.

    Every check that can fail runs before the first collective, identically on every rank.
    ``layers_per_stage`` sets how many blocks each pipeline stage gets (default: as even as
    possible, earlier stages taking the remainder); with ``schedule="interleaved_1f1b"`` the model is
    cut into pp x ``virtual_stages`` chunks, rank r running chunks r, r+pp, ..., and
    ``layers_per_stage`` has one entry per chunk. ``mesh`` reuses an existing ("dp", "pp", "tp") mesh; ``seed`` seeds dropout (default: rank 0's
    ``torch.initial_seed()``, shared with all ranks); ``bucket_mb`` is the size of the gradient
    buckets all-reduced over dp during backward; ``checkpoint`` (a Hugging Face directory or a qn_hf
    checkpoint) supplies the weights: with a model built on the ``meta`` device, each rank
    allocates and reads only its own shard, so no rank ever holds the whole model; ``timeout``
    bounds every collective when this call creates the process group. ``mixed_precision`` ("bf16" or
    "fp16") computes in that dtype with float32 gradients and float32 master weights in
    ``qn_hf.optimizer`` (precision.py); ``recompute`` ("full" or "selective") recomputes each block's
    activations in backward (recompute.py); ``sequence_parallel`` splits the activations between
    tensor-parallel regions over the tp ranks along the sequence (sequence_parallel.py); ``cp`` splits
    each sequence over that many ranks, with ring attention (context_parallel.py); ``ep`` shards the
    experts of MoE layers over that many of a stage's dp x tp ranks, tokens travelling to them
    (expert_parallel.py); ``compile`` compiles each block of this stage in place with ``torch.compile``
    (inductor), the collectives inside traced as functional collectives (compile.py).
    """
    if unknown:  # Python's own TypeError would not say which keyword was meant
        raise refused_on_every_rank(TypeError(unknown_keywords(unknown, parallelize)))
    try:
        return _parallelize(model, dp=dp, tp=tp, pp=pp, cp=cp, ep=ep, microbatches=microbatches, schedule=schedule,
                            virtual_stages=virtual_stages, policy=policy, layers_per_stage=layers_per_stage, mesh=mesh,
                            device=device, seed=seed, bucket_mb=bucket_mb, checkpoint=checkpoint, timeout=timeout,
                            mixed_precision=mixed_precision, recompute=recompute, sequence_parallel=sequence_parallel,
                            compile=compile)
    except ValueError as e:  # every refusal is raised alike on every rank, before any collective
        refused_on_every_rank(e)
        raise


def _parallelize(model: nn.Module, *, dp: int, tp: int, pp: int, cp: int, ep: int, microbatches: int, schedule: str,
                 virtual_stages: int, policy: ModelPolicy | None, layers_per_stage: Sequence[int] | None,
                 mesh: DeviceMesh | None, device: torch.device | None, seed: int | None, bucket_mb: float,
                 checkpoint: str | None, timeout: datetime.timedelta, mixed_precision: str | None,
                 recompute: str | None, sequence_parallel: bool, compile: bool) -> ParallelModel:
    if getattr(model, _MARK, False):
        raise ValueError("this model is already parallelized; load a fresh copy to parallelize it again")
    model, adapter = unwrap_peft(model)  # a PEFT model: the HF model inside, LoRA layers in place
    if adapter is not None and checkpoint is not None:
        raise ValueError("checkpoint= with a PEFT model is not supported: its names are those of the LoRA-wrapped "
                         "model; load the base with from_pretrained, wrap it with get_peft_model, then parallelize")
    # The launch first: with the wrong number of processes every other message would name the wrong fix
    # (ep must divide dp*tp, ... of degrees the user did not mean).
    ParallelDims(dp=dp, tp=tp, pp=pp, cp=cp).check_world_size(launched_world_size())
    config = ParallelConfig.from_keywords(dp=dp, tp=tp, pp=pp, cp=cp, ep=ep, microbatches=microbatches,
                                          schedule=schedule, virtual_stages=virtual_stages,
                                          layers_per_stage=layers_per_stage, bucket_mb=bucket_mb,
                                          mixed_precision=mixed_precision, recompute=recompute,
                                          sequence_parallel=sequence_parallel, compile=compile)
    features = config.features | ({Feature.LORA} if adapter is not None else set())
    checked = check_parallel_config(model, config, policy=policy, extra=features - config.features)
    dims, plan, stage_plan = checked.dims, checked.tp_plan, checked.stage_plan
    dims.check_world_size(launched_world_size())
    _check_tensors(model, checkpoint=checkpoint)

    device = device or default_device()
    init_distributed(device=device, timeout=timeout)
    dims.check_world_size(dist.get_world_size())
    low = {p.dtype for p in model.parameters()} & {torch.bfloat16, torch.float16}
    if low and mixed_precision is None and dist.get_rank() == 0:
        warnings.warn(f"the model is in {low.pop()} and mixed_precision=None: it trains as is, with gradients and "
                      f"optimizer moments in that dtype too; load it in float32 and pass mixed_precision='bf16' for "
                      f"float32 master weights and moments", stacklevel=2)
    kv_replicated = plan.layout.kv_replicas > 1 and any(style == Style.COLWISE_KV for _, style in plan.rules)
    groups = build_groups(dims, device=device, timeout=timeout, mesh=mesh,
                          kv_replicas=plan.layout.kv_replicas if kv_replicated else 1, tied_stages=bool(stage_plan.ties))
    coords = groups.coords
    if pp > 1 and microbatches < pp and as_schedule(schedule).idle_below_pp and dist.get_rank() == 0:
        bubble = (pp - 1) / (microbatches + pp - 1)
        warnings.warn(f"microbatches={microbatches} < pp={pp}: each stage idles {bubble:.0%} of a step (pipeline bubble "
                      f"(pp-1)/(microbatches+pp-1)); use microbatches >= 2*pp={2 * pp} if the batch allows", stacklevel=2)

    chunks = ChunkLayout(size=cp)
    if cp > 1:  # before the stage cut and the tp patches: their config copies take the attention choice
        apply_context_parallel(model, group=groups.cp, layout=chunks)
    precision = PRECISIONS.get(mixed_precision)
    if precision is not None:  # before the stage cut: stand-ins take their dtype from the modules they replace
        apply_mixed_precision(model, precision)
    expert_specs = {}
    if ep > 1:  # before the stage cut, as cp: the stages' config copies take the experts choice
        experts = next(iter(experts_modules(model).values())).num_experts
        route = ExpertRoute(experts=experts, ep=ep, group=groups.ep, tp=groups.tp)
        expert_specs = apply_expert_parallel(model, route=route, ep_rank=coords.ep)
    final = final_norm(model, stage_plan) if coords.pp == pp - 1 else None
    stage = apply_stage(model, stage_plan, stage=coords.pp)
    plan = plan.only(lambda name: _on_this_stage(model, name))
    specs, vocab = apply_tp_plan(model, plan, tp_rank=coords.tp, group=groups.tp)
    specs.update({n: s for n, s in expert_specs.items() if n in specs})  # this stage's experts
    if plan.sequence_parallel:
        apply_sequence_parallel(model, plan=plan, stage_plan=stage_plan, stage=coords.pp, final=final, group=groups.tp,
                                regather=regathers(recompute) and not compile)
        stage.wire = sequence_wire(groups.tp)
    if checkpoint is not None and any(p.is_meta for p in model.parameters()):
        _materialize(model, device)
    else:
        model.to(device)
    if precision is not None:  # again: sharding and materializing made new parameters (float32 gradients)
        apply_mixed_precision(model, precision)
    if checkpoint is None:  # loading gives every replica the same bytes anyway
        _synchronize_replicas(model, specs, groups, stage_plan)
    placement = ShardPlacement(dims=dims, groups=groups, specs=specs, ties=stage_plan.ties, device=device)
    rng = _install_rng_streams(model, plan, coords, device, seed, replica=placement.replica_rank)
    if recompute is not None:
        apply_recompute(model, recompute=recompute, layers=stage_plan.layers, rng=rng)
    weights, deferred = None, []
    if as_schedule(schedule).split_backward:  # split backward: linear layers queue their weight gradients for the W passes
        weights = WeightGradQueue()
        deferred = make_deferrable(model, queue=weights, skip=stage_plan.heads)
    if compile:  # after every hook and recomputation is in place; each block compiles at its first call
        apply_compile(model, layers=stage_plan.layers)
    setattr(model, _MARK, True)
    pm = ParallelModel(
        module=model,
        placement=placement,
        plan=plan,
        stage=stage,
        executor=StageExecutor(stage=coords.pp, peers=groups.peers, device=device,
                               chunks=stage_plan.chunks, weights=weights),
        vocab=vocab,
        microbatches=microbatches,
        schedule=schedule,
        rng=rng,
        buckets=_grad_buckets(model, groups.replicas, dims.replicas, bucket_mb, experts=False, specs=specs),
        expert_buckets=_grad_buckets(model, groups.experts, dims.expert_replicas, bucket_mb, experts=True, specs=specs),
        precision=precision,
        scaler=LossScaler() if mixed_precision == "fp16" else None,
        chunks=chunks,
        deferred=frozenset(deferred),
        adapter=adapter,
        parallel_config=config,
    )
    pm.check_composes_with()  # refused above already; this warns (rank 0) about pairs no test compares yet
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


def _grad_buckets(model: nn.Module, group: dist.ProcessGroup | None, size: int, bucket_mb: float, *, experts: bool,
                  specs: dict[str, ShardSpec | None]) -> GradBuckets | None:
    """The buckets of the parameters summed over ``group``: the ep-sharded experts over the ranks
    holding the same experts (``experts``), everything else over dp x cp. cp ranks hold the same
    weights and see different tokens of the same sequences: their gradients are partial sums like
    those of dp ranks, so one reduction covers both."""
    if size == 1:
        return None
    params = [p for n, p in model.named_parameters() if p.requires_grad and over_experts(specs.get(n)) == experts]
    return GradBuckets(params, group=group, bucket_bytes=bucket_size_bytes(bucket_mb)) if params else None



def _on_this_stage(model: nn.Module, name: str) -> bool:
    """Whether the module ``name`` is real on this rank (not dropped, not a stage stand-in)."""
    module = model
    for part in name.split("."):
        module = getattr(module, part, None)
        if not isinstance(module, nn.Module) or isinstance(module, StandIn):
            return False
    return True


def _synchronize_replicas(
    model: nn.Module, specs: dict[str, ShardSpec | None], groups: Groups, stage_plan: StagePlan
) -> None:
    """Make copies that must be equal exactly equal: what is replicated across tp (from tp rank 0),
    KV-head replicas (from the first replica), the last stage's copy of a tied weight (from the
    first stage), everything else across dp (from dp rank 0), and ep-sharded experts across the
    ranks holding the same block."""
    named = dict(model.named_parameters())
    tied = [named[n].data for tie in stage_plan.ties for n in (tie.owner, tie.follower) if n in named]
    tp_replicated = [p.data for n, p in named.items() if specs.get(n) is None]
    kv_replicated = [p.data for n, p in named.items() if (s := specs.get(n)) is not None and s.replicas > 1]
    experts = [p.data for n, p in named.items() if over_experts(specs.get(n))]
    with torch.no_grad():
        flat_broadcast_(tp_replicated, src_group_rank=0, group=groups.tp)
        if groups.kv is not None:
            flat_broadcast_(kv_replicated, src_group_rank=0, group=groups.kv)
        if groups.tie is not None:
            flat_broadcast_(tied, src_group_rank=0, group=groups.tie)
        flat_broadcast_([p.data for n, p in named.items() if not over_experts(specs.get(n))], src_group_rank=0,
                        group=groups.replicas)
        if groups.experts is not None:  # the ranks holding the same experts (dp x tp / ep of them)
            flat_broadcast_(experts, src_group_rank=0, group=groups.experts)


def _install_rng_streams(
    model: nn.Module, plan: TpPlan, coords: Coords, device: torch.device, seed: int | None, *, replica: int
) -> RngStreams:
    """Seeded per replica (dp x cp: different examples or tokens draw different masks), tp and pp."""
    if seed is None:
        shared = torch.tensor([torch.initial_seed() % (2**62)], dtype=torch.int64, device=device)
        dist.broadcast(shared, src=0)
        seed = int(shared.item())
    streams = RngStreams(
        device=device, seeds=stream_seeds(base_seed=seed, dp_rank=replica, tp_rank=coords.tp, pp_rank=coords.pp)
    )
    for name in plan.tp_rng_regions:
        streams.hook_module(model.get_submodule(name), TP_LOCAL)
    for name in plan.shared_rng_regions:
        streams.hook_module(model.get_submodule(name), SHARED)
    return streams
