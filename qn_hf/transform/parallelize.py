"""A model transformed as a configuration says: validate, join the process group, build the mesh, shard,
synchronize (``build``); ``qn_hf.parallelize`` (entry/parallelize.py) chooses the configuration."""

from __future__ import annotations

import datetime
import warnings

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh

from ..checkpoint.background import BackgroundSaves
from ..config.features import Feature
from ..config.parallel_config import ParallelConfig
from ..context_parallel.ring_attention import PieceLayout
from ..data_parallel.grad_sync import GradSync, grad_buckets
from ..data_parallel.precision import LossScaler
from ..devices import default_device
from ..mesh import build_groups, init_distributed, launched_world_size
from ..parallel_model import ParallelModel
from ..peft.lora import Adapter, unwrap_peft
from ..pipeline.runtime import StageExecutor
from ..policies.model_policy import ModelPolicy
from ..policies.styles import Style
from ..step.runner import StepContext
from ..validation.checks import check_parallel_config
from .passes import Build, run_passes

_MARK = "_qn_hf_parallelized"
JOIN_TIMEOUT = datetime.timedelta(minutes=10)  # every collective's bound when parallelize creates the group


def prepare_model(model: nn.Module, *, checkpoint: str | None) -> tuple[nn.Module, Adapter | None]:
    """The model ``build`` transforms: refused when already parallelized; a PEFT model's HF model inside, its
    LoRA layers in place (with its ``Adapter``)."""
    if getattr(model, _MARK, False):
        raise ValueError("this model is already parallelized; load a fresh copy to parallelize it again")
    model, adapter = unwrap_peft(model)  # a PEFT model: the HF model inside, LoRA layers in place
    if adapter is not None and checkpoint is not None:
        raise ValueError("checkpoint= with a PEFT model is not supported: its names are those of the LoRA-"
                         "wrapped model; load the base with from_pretrained, wrap it with get_peft_model, then "
                         "parallelize")
    return model, adapter


def build(model: nn.Module, config: ParallelConfig, *, adapter: Adapter | None = None,
          policy: ModelPolicy | None = None, mesh: DeviceMesh | None = None, device: torch.device | None = None,
          seed: int | None = None, checkpoint: str | None = None,
          timeout: datetime.timedelta = JOIN_TIMEOUT) -> ParallelModel:
    """``model`` (``prepare_model``'s) transformed in place as ``config`` says: the checks, the process group and
    the groups, the passes; its ``ParallelModel``. ``qn_hf.parallelize`` (entry/parallelize.py) says what each
    argument means."""
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

    built = Build(model=model, config=config, plan=plan, stage_plan=stage_plan, groups=groups, device=device,
                  checkpoint=checkpoint, seed=seed, cp_layout=PieceLayout(size=dims.cp),
                  precision=config.mixed_precision.dtype if config.mixed_precision else None)
    run_passes(built)
    setattr(model, _MARK, True)
    context = StepContext(module=model, config=config, placement=built.placement, plan=built.plan, stage=built.stage,
                          executor=StageExecutor(stage=coords.pp, peers=groups.peers, device=device,
                                                 chunks=stage_plan.chunks, weights=built.weights),
                          vocab=built.vocab, cp_layout=built.cp_layout,
                          host_masks=built.host_masks, gather_switch=built.gather_switch, offload=built.offload)
    scaler = LossScaler() if config.mixed_precision and config.mixed_precision.scaled else None
    grads = GradSync(module=model, placement=built.placement, grad_sum=built.plan.grad_sum, scaler=scaler,
                     buckets=grad_buckets(model, built.placement, config.bucket_mb, experts=False),
                     expert_buckets=grad_buckets(model, built.placement, config.bucket_mb, experts=True))
    pm = ParallelModel(context=context, grads=grads, rng=built.rng, scaler=scaler,
                       deferred=frozenset(built.deferred), adapter=adapter,
                       switches=(built.sp_switch, built.attention_switch),
                       sharded=built.sharded, saves=BackgroundSaves(timeout=timeout))
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
