"""Where every tensor of a model goes at a given (tp, pp), computed from its config alone.

The model is built on the ``meta`` device (no weights, no memory) and the real policy, tp plan and
stage cut are applied to it, exactly as ``parallelize`` does, so the conversion tools and
``parallelize`` cannot disagree about a layout. No process group is needed.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import transformers

from .pipeline.schedule import check_schedule_args
from .pipeline.split import PipelineTie, build_stage_plan, stage_of_module
from .plan import ModelPolicy, build_tp_plan
from .policies import resolve_policy
from .shard import ShardSpec
from .tensor_parallel import apply_tp_plan


@dataclass(frozen=True)
class Place:
    stage: int
    spec: ShardSpec | None  # None: replicated across tp
    shape: tuple[int, ...]  # global (unpadded) shape


@dataclass(frozen=True)
class Layout:
    tp: int
    pp: int
    tensors: dict[str, Place]
    ties: tuple[PipelineTie, ...]
    virtual_stages: int = 1


def meta_model(config: transformers.PretrainedConfig) -> torch.nn.Module:
    """The model class the config names (its first ``architectures`` entry), on the meta device."""
    names = getattr(config, "architectures", None) or []
    cls = getattr(transformers, names[0], None) if names else None
    with torch.device("meta"):
        return cls(config) if cls is not None else transformers.AutoModel.from_config(config)


def model_layout(config: transformers.PretrainedConfig, *, tp: int, pp: int, policy: ModelPolicy | None = None,
                 layers_per_stage: list[int] | None = None, virtual_stages: int = 1) -> Layout:
    model = meta_model(config)
    policy = resolve_policy(model, policy)
    plan = build_tp_plan(model, policy, tp=tp)
    if virtual_stages != 1:  # chunks exist only under interleaved 1F1B: the same checks as a run's
        check_schedule_args(stages=pp, microbatches=pp, schedule="interleaved_1f1b", virtual_stages=virtual_stages)
    stage_plan = build_stage_plan(model, policy, stages=pp, layers_per_stage=layers_per_stage, virtual=virtual_stages)
    specs, _ = apply_tp_plan(model, plan, tp_rank=0, group=None)  # meta tensors: shapes only
    tensors = {}
    for name, p in model.named_parameters():
        spec = specs.get(name)
        shape = list(p.shape)
        if spec is not None:
            shape[spec.dim] = spec.size
        stage = stage_of_module(stage_plan, name.rpartition(".")[0])
        tensors[name] = Place(stage=0 if stage is None else stage, spec=spec, shape=tuple(shape))
    return Layout(tp=tp, pp=pp, tensors=tensors, ties=stage_plan.ties, virtual_stages=virtual_stages)
