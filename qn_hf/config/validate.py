"""The configuration checks ``parallelize`` and the planner share, so that what ``qn-hf-plan``
accepts trains and what it rejects fails in ``parallelize`` with the same message.

Everything here reads the model's structure only (it works on a ``meta``-device model) and needs
no process group: mesh degrees, microbatches, schedule, what compiles, bucket size, the policy, head
and KV-head divisibility, and the pipeline cut (pp no larger than the number of blocks, ``layers_per_stage``
summing up). Each check itself has one home (``arguments``, ``ParallelDims``, ``check_schedule_args``,
the plan builders); this is where ``parallelize`` and the planner call them all, in the same order.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from torch import nn

from ..arguments import check_choice, check_positive
from ..step.compile import check_compile
from ..context_parallel.apply import check_context_parallel
from ..expert_parallel.apply import check_expert_parallel, expert_parallel_plan
from ..data_parallel.buckets import DEFAULT_BUCKET_MB
from ..mesh import ParallelDims
from ..pipeline.schedule import as_schedule, check_schedule_args
from ..pipeline.split import StagePlan, build_stage_plan
from ..tensor_parallel.plan import ModelPolicy, TpPlan, build_tp_plan
from ..policies import resolve_policy
from ..data_parallel.precision import PRECISIONS
from ..memory.recompute import check_recompute
from ..tensor_parallel.sequence_parallel import sequence_parallel_plan


@dataclass(frozen=True)
class CheckedConfig:
    dims: ParallelDims
    policy: ModelPolicy
    tp_plan: TpPlan
    stage_plan: StagePlan


def check_parallel_config(model: nn.Module, *, dp: int, tp: int, pp: int, microbatches: int, schedule: str,
                          virtual_stages: int = 1, policy: ModelPolicy | None = None,
                          layers_per_stage: Sequence[int] | None = None,
                          bucket_mb: float = DEFAULT_BUCKET_MB, mixed_precision: str | None = None,
                          recompute: str | None = None, sequence_parallel: bool = False, cp: int = 1,
                          ep: int = 1, compile: bool = False) -> CheckedConfig:
    """Raise ``ValueError`` naming the value and the fix for anything ``model`` cannot take."""
    dims = ParallelDims(dp=dp, tp=tp, pp=pp, cp=cp, ep=ep)
    check_schedule_args(stages=pp, microbatches=microbatches, schedule=schedule, virtual_stages=virtual_stages)
    _check_schedule_composition(schedule, sequence_parallel=sequence_parallel, cp=cp, ep=ep)
    check_compile(model, compile=compile, schedule=schedule, cp=cp, ep=ep)
    check_positive("bucket_mb", bucket_mb)
    if not isinstance(sequence_parallel, bool):
        raise ValueError(f"sequence_parallel={sequence_parallel!r} must be True or False")
    if mixed_precision is not None:
        check_choice("mixed_precision", mixed_precision, tuple(PRECISIONS))
    resolved = resolve_policy(model, policy)
    tp_plan = build_tp_plan(model, resolved, tp=tp, sequence_parallel=sequence_parallel)
    stage_plan = build_stage_plan(model, resolved, stages=pp, layers_per_stage=layers_per_stage,
                                  virtual=virtual_stages)
    check_recompute(model, recompute=recompute, layers=stage_plan.layers)
    check_context_parallel(model, cp=cp, plan=tp_plan, sequence_parallel=sequence_parallel)
    check_expert_parallel(model, dims=dims, plan=tp_plan, sequence_parallel=sequence_parallel)
    tp_plan = expert_parallel_plan(model, tp_plan, ep=ep)
    if sequence_parallel:
        tp_plan = sequence_parallel_plan(model, tp_plan, stage_plan)
    return CheckedConfig(dims=dims, policy=resolved, tp_plan=tp_plan, stage_plan=stage_plan)


def _check_schedule_composition(schedule: str, *, sequence_parallel: bool, cp: int, ep: int) -> None:
    """The features interleaved 1F1B and ZB-H1 are not yet built or tested with."""
    kind = as_schedule(schedule)
    if not (kind.chunks or kind.split_backward):
        return
    if kind.split_backward and sequence_parallel:
        raise ValueError("schedule='zb_h1' with sequence_parallel=True is not supported yet: a deferred weight "
                         "gradient would keep the whole gathered input of each layer until its weight pass, which "
                         "sequence parallelism exists to avoid; use schedule='1f1b' or 'interleaved_1f1b' with it")
    for name, used in ((f"cp={cp}", cp > 1), (f"ep={ep}", ep > 1)):
        if used:
            raise ValueError(f"schedule={schedule!r} with {name} is not supported yet; use schedule='1f1b' with it")
