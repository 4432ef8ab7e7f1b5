"""The configuration checks ``parallelize`` and the planner share, so that what ``qn-hf-plan``
accepts trains and what it rejects fails in ``parallelize`` with the same message.

Everything here reads the model's structure only (it works on a ``meta``-device model) and needs
no process group: the composition of the features (``composition.py``), what compiles, the policy,
head and KV-head divisibility, and the pipeline cut (pp no larger than the number of blocks,
``layers_per_stage`` summing up). The options on their own were checked when the ``ParallelConfig``
was built. Each check itself has one home (``arguments``, ``ParallelDims``, ``check_schedule_args``,
the composition table, the plan builders); this is where ``parallelize`` and the planner call them
all, in the same order.
"""

from __future__ import annotations

from dataclasses import dataclass

from torch import nn

from ..config.composition import Feature, check_composition
from ..config.dims import ParallelDims
from ..config.parallel_config import ParallelConfig
from ..context_parallel.apply import check_context_parallel
from ..data_parallel.batch_statistics import check_batch_statistics
from ..expert_parallel.apply import check_expert_parallel, expert_parallel_plan, expert_tp_blocks, token_wise_blocks
from ..memory.recompute import check_recompute
from ..pipeline.seq2seq import check_seq2seq_pipeline
from ..pipeline.split import StagePlan, build_stage_plan
from ..policies import resolve_policy
from ..policies.model_policy import ModelPolicy
from ..step.compile import check_compile
from ..tensor_parallel.plan import TpPlan, build_tp_plan
from ..tensor_parallel.sequence_parallel import sequence_parallel_plan


@dataclass(frozen=True)
class CheckedConfig:
    config: ParallelConfig
    policy: ModelPolicy
    tp_plan: TpPlan
    stage_plan: StagePlan

    @property
    def dims(self) -> ParallelDims:
        return self.config.dims


def check_parallel_config(model: nn.Module, config: ParallelConfig | None = None, *, policy: ModelPolicy | None = None,
                          extra: frozenset[Feature] = frozenset(), **keywords: object) -> CheckedConfig:
    """Raise ``ValueError`` naming the value and the fix for anything ``model`` cannot take under
    ``config`` (whose own options ``ParallelConfig.from_keywords`` checked; or build it here from
    ``parallelize``'s ``keywords``). ``extra``: the features the run adds beyond ``config`` (LoRA when
    the model is a PEFT model, ZeRO for the planner)."""
    if config is None:
        config = ParallelConfig.from_keywords(**keywords)
    check_composition(config.features | extra, config.values(model_type=model.config.model_type))
    dims = config.dims
    resolved = resolve_policy(model, policy)
    tp_plan = build_tp_plan(model, resolved, tp=dims.tp, sequence_parallel=config.sequence_parallel)
    stage_plan = build_stage_plan(model, resolved, stages=dims.pp, layers_per_stage=config.layers_per_stage,
                                  virtual=config.virtual_stages)
    check_compile(model, compile=config.compile, schedule=config.schedule, cp=dims.cp, ep=dims.ep,
                  layers=stage_plan.layers)
    # before recomputation's own check: what BatchNorm refuses holds whatever the blocks are
    check_batch_statistics(model, dims=dims, microbatches=config.microbatches, recompute=config.recompute)
    for layers in stage_plan.block_lists or (None,):
        check_recompute(model, recompute=config.recompute, layers=layers)
    if stage_plan.seq2seq is not None:
        check_seq2seq_pipeline(stage_plan.seq2seq, dp_shard=dims.dp_shard, compile=config.compile,
                               sequence_parallel=config.sequence_parallel, stages=dims.pp)
    check_context_parallel(model, cp=dims.cp, plan=tp_plan)
    check_expert_parallel(model, dims=dims, plan=tp_plan)
    tp_plan = expert_parallel_plan(model, tp_plan, ep=dims.ep)
    if config.sequence_parallel:  # MoE blocks route this rank's tokens: as they are (ep), or gathered (expert-TP)
        tp_plan = sequence_parallel_plan(model, tp_plan, stage_plan,
                                         token_wise=(token_wise_blocks if dims.ep > 1 else expert_tp_blocks)(model, tp_plan))
    return CheckedConfig(config=config, policy=resolved, tp_plan=tp_plan, stage_plan=stage_plan)
