"""``parallelize``: validate, join the process group, build the mesh, shard, synchronize."""

from __future__ import annotations

import datetime
import warnings

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh

from ..arguments import unknown_keywords
from ..checkpoint.background import BackgroundSaves
from ..config.dims import MESH_DEGREES, Axis, ParallelDims
from ..config.features import Feature
from ..config.parallel_config import ParallelConfig
from ..context_parallel.ring_attention import PieceLayout
from ..data_parallel.grad_sync import GradSync, grad_buckets
from ..data_parallel.precision import LossScaler
from ..devices import default_device
from ..failure import refused_on_every_rank
from ..mesh import build_groups, init_distributed, launched_world_size
from ..parallel_model import ParallelModel
from ..peft.lora import Adapter, unwrap_peft
from ..pipeline.runtime import StageExecutor
from ..planner.auto import AUTO, auto_config
from ..planner.calibration import Calibration
from ..policies.model_policy import ModelPolicy
from ..policies.styles import Style
from ..step.runner import StepContext
from ..validation.checks import check_parallel_config
from .passes import Build, run_passes

_MARK = "_qn_hf_parallelized"


def parallelize(
    model: nn.Module,
    config: ParallelConfig | None = None,
    *,
    policy: ModelPolicy | None = None,
    mesh: DeviceMesh | str | None = None,
    device: torch.device | None = None,
    seed: int | None = None,
    checkpoint: str | None = None,
    timeout: datetime.timedelta = datetime.timedelta(minutes=10),
    global_batch: int | None = None,
    seq_len: int | None = None,
    calibration: Calibration | str | None = None,
    **options: object,
) -> ParallelModel:
    """Shard ``model`` (in place) as ``config`` says, or the ``options`` (``ParallelConfig``'s keywords, which
    its docstring describes: the degrees ``dp``, ``tp``, ``pp``, ``cp``, ``ep``, ``dp_shard``, the schedule,
    precision, recomputation, ...; they build the same value), and return its ``ParallelModel``.

    Every check that can fail runs before the first collective, identically on every rank. What this call takes
    besides says where the model runs and what it starts from: ``policy`` describes an architecture
    (default: the one for ``model.config.model_type``); ``mesh`` reuses an existing ("dp", "pp", "tp") mesh;
    ``seed`` seeds dropout (default: rank 0's ``torch.initial_seed()``, shared with all ranks); ``checkpoint``
    (a Hugging Face directory or a qn_hf checkpoint) supplies the weights: with a model built on the ``meta``
    device, each rank allocates and reads only its own shard, so no rank ever holds the whole model; ``timeout``
    bounds every collective when this call creates the process group.

    ``mesh="auto"`` lets the planner choose the configuration (``qn_hf.auto_config``): the fastest it
    predicts that fits, training exactly ``global_batch`` sequences of ``seq_len`` tokens per step
    (both required then), at ``calibration`` (a ``qn-hf-plan --calibrate`` file, or its value) or this
    machine's (measured quickly, kept; planner/machine.py); the options given beside it are kept.
    ``pm.parallel_config`` says what was chosen; each dp rank's ``train_step`` takes
    ``global_batch / dp`` sequences.
    """
    defaults = ParallelConfig.keyword_defaults()  # the options parallelize takes, and their defaults
    unknown = {name: value for name, value in options.items() if name not in defaults}
    if unknown:  # Python's own TypeError would not say which keyword was meant
        raise refused_on_every_rank(TypeError(unknown_keywords(unknown, parallelize, tuple(defaults))))
    try:
        if getattr(model, _MARK, False):
            raise ValueError("this model is already parallelized; load a fresh copy to parallelize it again")
        model, adapter = unwrap_peft(model)  # a PEFT model: the HF model inside, LoRA layers in place
        if adapter is not None and checkpoint is not None:
            raise ValueError("checkpoint= with a PEFT model is not supported: its names are those of the LoRA-"
                             "wrapped model; load the base with from_pretrained, wrap it with get_peft_model, then "
                             "parallelize")
        # the options given other than at their defaults: what mesh="auto" keeps, what config= leaves no room for
        changed = {name: value for name, value in options.items() if value != defaults[name]}
        if isinstance(mesh, str) or global_batch is not None or seq_len is not None or calibration is not None:
            config = _auto(model, config, mesh=mesh, fixed=changed, global_batch=global_batch, seq_len=seq_len,
                           calibration=calibration)
            mesh = None
            options = {}
        if config is None:
            # The launch first: with the wrong number of processes every other message would name the wrong
            # fix (ep must divide dp*tp, ... of degrees the user did not mean); but dp_shard's, which says what
            # dp it needs (dp_shard=4 alone usually means dp=4 too).
            ParallelDims.of(options, axes=(*MESH_DEGREES, Axis.DP_SHARD)).check_world_size(launched_world_size())
            config = ParallelConfig.from_keywords(**options)
        elif not isinstance(config, ParallelConfig):
            raise ValueError(f"config={config!r} must be a qn_hf.ParallelConfig (or pass the keywords instead)")
        elif changed:
            raise ValueError(f"parallelize(model, config, {', '.join(sorted(changed))}=...): the config already holds "
                             f"every option; put them in it (dataclasses.replace(config, ...)) or pass keywords only")
        return _parallelize(model, config, adapter=adapter, policy=policy, mesh=mesh, device=device, seed=seed,
                            checkpoint=checkpoint, timeout=timeout)
    except ValueError as e:  # every refusal is raised alike on every rank, before any collective
        refused_on_every_rank(e)
        raise


def _auto(model: nn.Module, config: ParallelConfig | None, *, mesh: object, fixed: dict[str, object],
          global_batch: int | None, seq_len: int | None, calibration: Calibration | str | None) -> ParallelConfig:
    """``mesh="auto"``: the planner's configuration, the options given beside it kept."""
    if mesh != AUTO:
        raise ValueError(f"mesh={mesh!r} with global_batch/seq_len/calibration: those choose the configuration "
                         f"and go with mesh='auto' only (mesh takes 'auto' or a DeviceMesh)")
    if config is not None:
        raise ValueError("parallelize(model, config, mesh='auto'): pass a configuration or let auto choose one, "
                         "not both")
    if global_batch is None or seq_len is None:
        raise ValueError(f"mesh='auto' needs global_batch= and seq_len= (got global_batch={global_batch}, "
                         f"seq_len={seq_len}): the fastest configuration depends on the step's shape")
    return auto_config(model, global_batch=global_batch, seq_len=seq_len, calibration=calibration, fixed=fixed)


def _parallelize(model: nn.Module, config: ParallelConfig, *, adapter: Adapter | None, policy: ModelPolicy | None,
                 mesh: DeviceMesh | None, device: torch.device | None, seed: int | None, checkpoint: str | None,
                 timeout: datetime.timedelta) -> ParallelModel:
    config.dims.check_world_size(launched_world_size())
    features = config.features | ({Feature.LORA} if adapter is not None else set())
    checked = check_parallel_config(model, config, policy=policy, extra=features - config.features)
    dims, plan, stage_plan = checked.dims, checked.tp_plan, checked.stage_plan
    _check_tensors(model, checkpoint=checkpoint)

    device = device or default_device()
    init_distributed(device=device, timeout=timeout)
    dims.check_world_size(dist.get_world_size())
    low = {p.dtype for p in model.parameters()} & {torch.bfloat16, torch.float16}
    if low and config.mixed_precision is None and dist.get_rank() == 0:
        warnings.warn(f"the model is in {low.pop()} and mixed_precision=None: it trains as is, with gradients and "
                      f"optimizer moments in that dtype too; load it in float32 and pass mixed_precision='bf16' for "
                      f"float32 master weights and moments", stacklevel=2)
    kv_replicated = plan.layout.kv_replicas > 1 and any(style == Style.COLWISE_KV for _, style in plan.rules)
    groups = build_groups(dims, device=device, timeout=timeout, mesh=mesh,
                          kv_replicas=plan.layout.kv_replicas if kv_replicated else 1, tied_stages=bool(stage_plan.ties))
    coords = groups.coords
    pp, microbatches = dims.pp, config.microbatches
    if pp > 1 and microbatches < pp and config.schedule.idle_below_pp and dist.get_rank() == 0:
        bubble = (pp - 1) / (microbatches + pp - 1)
        warnings.warn(f"microbatches={microbatches} < pp={pp}: each stage idles {bubble:.0%} of a step (pipeline bubble "
                      f"(pp-1)/(microbatches+pp-1)); use microbatches >= 2*pp={2 * pp} if the batch allows", stacklevel=2)

    build = Build(model=model, config=config, plan=plan, stage_plan=stage_plan, groups=groups, device=device,
                  checkpoint=checkpoint, seed=seed, cp_layout=PieceLayout(size=dims.cp),
                  precision=config.mixed_precision.dtype if config.mixed_precision else None)
    run_passes(build)
    setattr(model, _MARK, True)
    context = StepContext(module=model, config=config, placement=build.placement, plan=build.plan, stage=build.stage,
                          executor=StageExecutor(stage=coords.pp, peers=groups.peers, device=device,
                                                 chunks=stage_plan.chunks, weights=build.weights),
                          vocab=build.vocab, cp_layout=build.cp_layout,
                          host_masks=build.host_masks, gather_switch=build.gather_switch, offload=build.offload)
    scaler = LossScaler() if config.mixed_precision and config.mixed_precision.scaled else None
    grads = GradSync(module=model, placement=build.placement, grad_sum=build.plan.grad_sum, scaler=scaler,
                     buckets=grad_buckets(model, build.placement, config.bucket_mb, experts=False),
                     expert_buckets=grad_buckets(model, build.placement, config.bucket_mb, experts=True))
    pm = ParallelModel(context=context, grads=grads, rng=build.rng, scaler=scaler,
                       deferred=frozenset(build.deferred), adapter=adapter, switches=(build.sp_switch, build.attention_switch),
                       sharded=build.sharded, saves=BackgroundSaves(timeout=timeout))
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
