"""Where every tensor of a model goes at a given (tp, pp), computed from its config alone.

The model is built on the ``meta`` device (no weights, no memory) and the real policy, tp plan and
stage cut are applied to it, exactly as ``parallelize`` does, so the conversion tools and
``parallelize`` cannot disagree about a layout. No process group is needed. Which class to build is
the caller's to say, or the config's (its ``architectures``); ``candidate_classes`` lists what a
config without one may be.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import transformers

from ..arguments import check_positive_int
from ..config.schedule import Schedule, check_schedule_args
from ..pipeline.split import PipelineTie, build_stage_plan, stage_of_module
from ..policies import resolve_policy
from ..policies.model_policy import ModelPolicy
from ..tensor_parallel.apply import apply_tp_plan
from ..tensor_parallel.plan import build_tp_plan
from ..tensor_parallel.shard import ShardSpec


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
    aliases: frozenset[str] = frozenset()  # names of tied tensors saved once, under another name
    model_class: str = ""  # the transformers class laid out


def named_class(config: transformers.PretrainedConfig) -> type | None:
    """The transformers model class the config's first ``architectures`` entry names, if it is one."""
    names = getattr(config, "architectures", None)
    first = names[0] if isinstance(names, list) and names else None
    cls = getattr(transformers, first, None) if isinstance(first, str) else None
    return cls if isinstance(cls, type) and issubclass(cls, transformers.PreTrainedModel) else None


def candidate_classes(config: transformers.PretrainedConfig) -> list[type]:
    """Every transformers model class registered for the config's ``model_type``, its causal LM first
    and its base model last: what a checkpoint that records no class may hold."""
    from transformers.models.auto import modeling_auto

    tasks = [name for name in dir(modeling_auto) if name.startswith("MODEL_FOR_") and name.endswith("_MAPPING_NAMES")]
    tables = sorted(tasks, key=lambda name: name != "MODEL_FOR_CAUSAL_LM_MAPPING_NAMES") + ["MODEL_MAPPING_NAMES"]
    found: list[type] = []
    for table in tables:
        names = getattr(modeling_auto, table).get(config.model_type, ())
        for name in [names] if isinstance(names, str) else names:
            cls = getattr(transformers, name, None)
            if isinstance(cls, type) and issubclass(cls, transformers.PreTrainedModel) and cls not in found:
                found.append(cls)
    return found


def meta_model(config: transformers.PretrainedConfig, *, cls: type | None = None) -> torch.nn.Module:
    """``cls`` (by default the class the config names, else its base model) on the meta device."""
    cls = cls or named_class(config)
    with torch.device("meta"):
        return cls(config) if cls is not None else transformers.AutoModel.from_config(config)


def layout_class(layout: Layout) -> type:
    """The transformers class ``layout`` laid out."""
    return getattr(transformers, layout.model_class)


def model_layout(config: transformers.PretrainedConfig, *, tp: int, pp: int, policy: ModelPolicy | None = None,
                 layers_per_stage: list[int] | None = None, virtual_stages: int = 1, cls: type | None = None) -> Layout:
    for name, degree, fix in (("tp", tp, "1 keeps every tensor whole"), ("pp", pp, "1 is one stage"),
                              ("virtual_stages", virtual_stages, "1 is one chunk per stage")):
        check_positive_int(name, degree, fix=fix)  # 0 ranks divided by zero further on
    model = meta_model(config, cls=cls)
    every = frozenset(n for n, _ in model.named_parameters(remove_duplicate=False))
    aliases = every - {n for n, _ in model.named_parameters()}
    policy = resolve_policy(model, policy)
    plan = build_tp_plan(model, policy, tp=tp)
    if virtual_stages != 1:  # chunks exist only under interleaved 1F1B: the same checks as a run's
        check_schedule_args(stages=pp, microbatches=pp, schedule=Schedule.INTERLEAVED_1F1B, virtual_stages=virtual_stages)
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
    return Layout(tp=tp, pp=pp, tensors=tensors, ties=stage_plan.ties, virtual_stages=virtual_stages, aliases=aliases,
                  model_class=type(model).__name__)
