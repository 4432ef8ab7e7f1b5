"""``parallelize``: validate, join the process group, build the mesh, shard, synchronize."""

from __future__ import annotations

import datetime
import warnings
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh

from .step.compile import apply_compile
from .context_parallel.apply import RingSwitch, apply_context_parallel
from .expert_parallel.dispatch import ExpertRoute
from .expert_parallel.apply import apply_expert_parallel, sharded_experts
from .peft.lora import unwrap_peft
from .context_parallel.ring_attention import ChunkLayout
from .data_parallel.buckets import DEFAULT_BUCKET_MB
from .data_parallel.grad_sync import grad_buckets
from .data_parallel.sharded import ShardedParameters
from .mesh import Coords, Groups, ParallelDims, build_groups, default_device, init_distributed, launched_world_size
from .parallel_model import ParallelModel
from .pipeline.runtime import StageExecutor
from .pipeline.split import StagePlan, on_every_stage
from .pipeline.stage import StageModules, apply_stage
from .pipeline.schedule import as_schedule
from .pipeline.standins import StandIn
from .placement import ShardPlacement, materialize
from .data_parallel.precision import PRECISIONS, LossScaler, apply_mixed_precision
from .memory.recompute import apply_recompute
from .tensor_parallel.sequence_hooks import SequenceParallelSwitch, apply_sequence_parallel, sequence_wire
from .tensor_parallel.sequence_parallel import final_norm, regathers
from .tensor_parallel.plan import ModelPolicy, TpPlan
from .tensor_parallel.rng import RngStreams, draws_in_training, stream_seeds
from .tensor_parallel.shard import ShardSpec
from .tensor_parallel.apply import VocabShard, apply_tp_plan
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
    dp_shard: int = 1,
    dp_shard_gather: str = "step",
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
    ``qn_hf.optimizer`` (data_parallel/precision.py); ``recompute`` ("full" or "selective") recomputes each block's
    activations in backward (memory/recompute.py); ``sequence_parallel`` splits the activations between
    tensor-parallel regions over the tp ranks along the sequence (tensor_parallel/sequence_parallel.py); ``cp`` splits
    each sequence over that many ranks, with ring attention (context_parallel/); ``ep`` shards the
    experts of MoE layers over that many of a stage's dp x tp ranks, tokens travelling to them
    (expert_parallel/); ``compile`` compiles each block of this stage in place with ``torch.compile``
    (inductor), the collectives inside traced as functional collectives (step/compile.py); ``dp_shard``
    shards weights, gradients and optimizer state over groups of that many dp ranks with torch's
    ``fully_shard`` (data_parallel/sharded.py), under a pipeline gathered once a step or per microbatch
    (``dp_shard_gather``: "step" or "microbatch").
    """
    if unknown:  # Python's own TypeError would not say which keyword was meant
        raise refused_on_every_rank(TypeError(unknown_keywords(unknown, parallelize)))
    try:
        return _parallelize(model, dp=dp, tp=tp, pp=pp, cp=cp, ep=ep, microbatches=microbatches, schedule=schedule,
                            virtual_stages=virtual_stages, policy=policy, layers_per_stage=layers_per_stage, mesh=mesh,
                            device=device, seed=seed, bucket_mb=bucket_mb, checkpoint=checkpoint, timeout=timeout,
                            mixed_precision=mixed_precision, recompute=recompute, sequence_parallel=sequence_parallel,
                            compile=compile, dp_shard=dp_shard, dp_shard_gather=dp_shard_gather)
    except ValueError as e:  # every refusal is raised alike on every rank, before any collective
        refused_on_every_rank(e)
        raise


def _parallelize(model: nn.Module, *, dp: int, tp: int, pp: int, cp: int, ep: int, microbatches: int, schedule: str,
                 virtual_stages: int, policy: ModelPolicy | None, layers_per_stage: Sequence[int] | None,
                 mesh: DeviceMesh | None, device: torch.device | None, seed: int | None, bucket_mb: float,
                 checkpoint: str | None, timeout: datetime.timedelta, mixed_precision: str | None,
                 recompute: str | None, sequence_parallel: bool, compile: bool, dp_shard: int,
                 dp_shard_gather: str) -> ParallelModel:
    if getattr(model, _MARK, False):
        raise ValueError("this model is already parallelized; load a fresh copy to parallelize it again")
    model, adapter = unwrap_peft(model)  # a PEFT model: the HF model inside, LoRA layers in place
    if adapter is not None and checkpoint is not None:
        raise ValueError("checkpoint= with a PEFT model is not supported: its names are those of the LoRA-wrapped "
                         "model; load the base with from_pretrained, wrap it with get_peft_model, then parallelize")
    # The launch first: with the wrong number of processes every other message would name the wrong fix
    # (ep must divide dp*tp, ... of degrees the user did not mean).
    ParallelDims(dp=dp, tp=tp, pp=pp, cp=cp, dp_shard=dp_shard).check_world_size(launched_world_size())
    config = ParallelConfig.from_keywords(dp=dp, tp=tp, pp=pp, cp=cp, ep=ep, microbatches=microbatches,
                                          schedule=schedule, virtual_stages=virtual_stages,
                                          layers_per_stage=layers_per_stage, bucket_mb=bucket_mb,
                                          mixed_precision=mixed_precision, recompute=recompute,
                                          sequence_parallel=sequence_parallel, compile=compile, dp_shard=dp_shard,
                                          dp_shard_gather=dp_shard_gather)
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

    build = Build(model=model, config=config, plan=plan, stage_plan=stage_plan, groups=groups, device=device,
                  checkpoint=checkpoint, seed=seed, cp_layout=ChunkLayout(size=cp),
                  precision=PRECISIONS.get(mixed_precision))
    for step in PASSES:
        if step.applies(build):
            step.run(build)
    setattr(model, _MARK, True)
    pm = ParallelModel(
        module=model,
        placement=build.placement,
        plan=build.plan,
        stage=build.stage,
        executor=StageExecutor(stage=coords.pp, peers=groups.peers, device=device,
                               chunks=stage_plan.chunks, weights=build.weights),
        vocab=build.vocab,
        microbatches=microbatches,
        schedule=schedule,
        rng=build.rng,
        buckets=grad_buckets(model, build.placement, bucket_mb, experts=False),
        expert_buckets=grad_buckets(model, build.placement, bucket_mb, experts=True),
        precision=build.precision,
        scaler=LossScaler() if mixed_precision == "fp16" else None,
        cp_layout=build.cp_layout,
        deferred=frozenset(build.deferred),
        adapter=adapter,
        parallel_config=config,
        sequence_parallel_switch=build.sp_switch, ring_switch=build.ring_switch, sharded=build.sharded,
    )
    pm.check_composes_with()  # refused above already; this warns (rank 0) about pairs no test compares yet
    if checkpoint is not None:
        pm.load_checkpoint(checkpoint)
    return pm


@dataclass
class Build:
    """What the passes share: the model they change in place, what they start from (the first block
    of fields) and what earlier passes made for later ones (the second)."""

    model: nn.Module
    config: ParallelConfig
    plan: TpPlan
    stage_plan: StagePlan
    groups: Groups
    device: torch.device
    checkpoint: str | None
    seed: int | None
    cp_layout: ChunkLayout  # which chunks of each sequence the cp ranks hold (not pipeline chunks)
    precision: torch.dtype | None
    expert_specs: dict[str, ShardSpec] = field(default_factory=dict)
    final: nn.Module | None = None  # the last stage's final norm (sequence parallelism gathers after it)
    stage: StageModules | None = None
    specs: dict[str, ShardSpec | None] = field(default_factory=dict)
    vocab: VocabShard | None = None
    placement: ShardPlacement | None = None
    rng: RngStreams | None = None
    weights: WeightGradQueue | None = None
    deferred: list[str] = field(default_factory=list)
    sp_switch: SequenceParallelSwitch | None = None
    ring_switch: RingSwitch | None = None
    sharded: ShardedParameters | None = None


@dataclass(frozen=True)
class Pass:
    """One in-place change of the model: when it applies, what it reads and makes (``Build`` fields),
    and why it runs where it does in ``PASSES``."""

    name: str
    applies: Callable[[Build], bool]
    run: Callable[[Build], None]
    needs: tuple[str, ...]
    makes: tuple[str, ...]
    why_here: str


def _context_parallel(b: Build) -> None:
    b.ring_switch = apply_context_parallel(b.model, group=b.groups.cp, layout=b.cp_layout)


def _cast(b: Build) -> None:
    apply_mixed_precision(b.model, b.precision)


def _expert_parallel(b: Build) -> None:
    experts = next(iter(sharded_experts(b.model).values())).num_experts
    # under sp the MoE blocks take this rank's slice, except while generate turns off the (later-made) switch
    split = (lambda: b.sp_switch.on) if b.plan.sequence_parallel else None
    route = ExpertRoute(experts=experts, ep=b.config.dims.ep, group=b.groups.ep, tp=b.groups.tp, tokens_split=split)
    b.expert_specs = apply_expert_parallel(b.model, route=route, ep_rank=b.groups.coords.ep)


def _stage_cut(b: Build) -> None:
    last = b.groups.coords.pp == b.config.dims.pp - 1
    b.final = final_norm(b.model, b.stage_plan) if last else None
    b.stage = apply_stage(b.model, b.stage_plan, stage=b.groups.coords.pp)
    b.plan = b.plan.only(lambda name: _on_this_stage(b.model, name))


def _tensor_parallel(b: Build) -> None:
    b.specs, b.vocab = apply_tp_plan(b.model, b.plan, tp_rank=b.groups.coords.tp, group=b.groups.tp)
    b.specs.update({n: s for n, s in b.expert_specs.items() if n in b.specs})  # this stage's experts
    b.placement = ShardPlacement(dims=b.config.dims, groups=b.groups, specs=b.specs, ties=b.stage_plan.ties,
                                 device=b.device,
                                 every_stage=frozenset(n for n, _ in b.model.named_parameters()
                                                       if on_every_stage(b.stage_plan, n.rpartition(".")[0])))


def _sequence_parallel(b: Build) -> None:
    b.sp_switch = apply_sequence_parallel(b.model, plan=b.plan, stage_plan=b.stage_plan, stage=b.groups.coords.pp,
                                          final=b.final, group=b.groups.tp,
                                          regather=regathers(b.config.recompute) and not b.config.compile)
    b.stage.wire = sequence_wire(b.groups.tp)


def _place_on_device(b: Build) -> None:
    if b.checkpoint is not None and any(p.is_meta for p in b.model.parameters()):
        materialize(b.model, b.device)
    else:
        b.model.to(b.device)


def _synchronize(b: Build) -> None:
    b.placement.synchronize(b.model)


def _dropout_streams(b: Build) -> None:
    b.rng = _install_rng_streams(b.model, b.plan, b.groups.coords, b.device, b.seed, replica=b.placement.replica_rank)


def _recompute(b: Build) -> None:
    apply_recompute(b.model, recompute=b.config.recompute, layers=b.stage_plan.layers, rng=b.rng)


def _split_backward(b: Build) -> None:
    b.weights = WeightGradQueue()
    b.deferred = make_deferrable(b.model, queue=b.weights, skip=b.stage_plan.heads)


def _shard_data_parallel(b: Build) -> None:
    blocks = list(b.model.get_submodule(b.stage_plan.layers))
    experts = list(sharded_experts(b.model).values()) if b.config.dims.ep > 1 else []
    b.sharded = ShardedParameters(b.model, mesh=b.groups.shard_mesh, blocks=blocks, compute_dtype=b.precision,
                                  experts=experts, expert_mesh=b.groups.expert_shard_mesh,
                                  pipelined=b.config.dims.pp > 1, gather=b.config.dp_shard_gather)
    b.stage.enter_at_top = b.config.dims.pp > 1  # FSDP's root hooks sit on the task model (sharded.py)


def _cast_here(b: Build) -> bool:
    """Mixed precision casts the model itself, unless FSDP casts as it gathers (dp_shard)."""
    return b.precision is not None and b.config.dims.dp_shard == 1


def _compile(b: Build) -> None:
    apply_compile(b.model, layers=b.stage_plan.layers)


def _always(b: Build) -> bool:
    return True


# The order is the code: ``tests/test_structure.py`` checks that every field a pass needs is one
# parallelize starts from or one an earlier pass makes.
PASSES: tuple[Pass, ...] = (
    Pass("context parallel", lambda b: b.config.dims.cp > 1, _context_parallel, ("model", "groups", "cp_layout"), ("ring_switch",),
         "before the stage cut and the tp patches: their config copies take the attention choice"),
    Pass("cast", _cast_here, _cast, ("model", "precision"), (),
         "before the stage cut: stand-ins take their dtype from the modules they replace"),
    Pass("expert parallel", lambda b: b.config.dims.ep > 1, _expert_parallel, ("model", "groups"), ("expert_specs",),
         "before the stage cut, as cp: the stages' config copies take the experts choice"),
    Pass("stage cut", _always, _stage_cut, ("model", "stage_plan", "plan", "groups"), ("final", "stage", "plan"),
         "before tp: only this stage's modules are sharded; the final norm is found on the whole model"),
    Pass("tensor parallel", _always, _tensor_parallel, ("model", "plan", "groups", "expert_specs", "stage_plan"),
         ("specs", "vocab", "placement"), "after the cut, before anything that asks where a shard sits"),
    Pass("sequence parallel", lambda b: b.plan.sequence_parallel, _sequence_parallel,
         ("model", "plan", "stage_plan", "final", "stage", "groups"), ("sp_switch",),
         "after tp: its hooks sit on the parallel layers and the blocks between them"),
    Pass("place on device", _always, _place_on_device, ("model", "checkpoint", "device"), (),
         "after every shard: each rank allocates only its own (a meta model is materialized here)"),
    Pass("cast new parameters", _cast_here, _cast, ("model", "precision"), (),
         "again: sharding and materializing made new parameters (float32 gradients)"),
    Pass("synchronize replicas", lambda b: b.checkpoint is None, _synchronize, ("model", "placement"), (),
         "on the device, after the last new parameter; loading a checkpoint gives every replica the same bytes"),
    Pass("dropout streams", _always, _dropout_streams, ("model", "plan", "groups", "seed", "device", "placement"),
         ("rng",), "after the shards exist; the streams are seeded per replica, which the placement says"),
    Pass("recompute", lambda b: b.config.recompute is not None, _recompute, ("model", "stage_plan", "rng"), (),
         "after the dropout streams: a recomputed block replays their state"),
    Pass("shard data parallel", lambda b: b.config.dims.dp_shard > 1, _shard_data_parallel,
         ("model", "groups", "stage_plan", "stage", "precision"), ("sharded",),
         "after every hook on the blocks (recomputation's included) and the replicas' synchronized weights: "
         "FSDP shards what is final"),
    Pass("split backward", lambda b: b.config.schedule.split_backward, _split_backward, ("model", "stage_plan"),
         ("weights", "deferred"), "zb_h1: after the layers are final, they queue their weight gradients for the W passes"),
    Pass("compile", lambda b: b.config.compile, _compile, ("model", "stage_plan"), (),
         "last: after every hook and recomputation is in place; each block compiles at its first call"),
)


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


def _on_this_stage(model: nn.Module, name: str) -> bool:
    """Whether the module ``name`` is real on this rank (not dropped, not a stage stand-in)."""
    module = model
    for part in name.split("."):
        module = getattr(module, part, None)
        if not isinstance(module, nn.Module) or isinstance(module, StandIn):
            return False
    return True


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
    if plan.tp > 1 and draws_in_training(model):  # else every draw comes from the shared stream (rng.py)
        streams.hook_regions(model, tp_local=plan.tp_rng_regions, shared=plan.shared_rng_regions)
    return streams
