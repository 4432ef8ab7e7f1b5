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

from collections.abc import Callable
from dataclasses import dataclass
from typing import TypeVar

from torch import nn

from ..config.composition import check_composition
from ..config.dims import ParallelDims
from ..config.features import Feature
from ..config.parallel_config import ParallelConfig
from ..context_parallel.apply import check_context_parallel
from ..data_parallel.batch_statistics import batch_statistics_layers, check_batch_statistics
from ..expert_parallel.apply import check_expert_parallel, expert_parallel_plan, expert_tp_blocks, token_wise_blocks
from ..memory.recompute import check_recompute
from ..pipeline.seq2seq import check_seq2seq_pipeline
from ..pipeline.split import StagePlan, build_stage_plan
from ..policies import resolve_policy
from ..policies.model_policy import ModelPolicy
from ..policies.tp_plan import TpPlan
from ..step.compile import check_compile
from ..step.loss_chunks import check_loss_chunks
from ..tensor_parallel.plan import build_tp_plan
from ..tensor_parallel.sequence_parallel import sequence_parallel_plan

_T = TypeVar("_T")


class CheckMemo:
    """What each check of ``check_parallel_config`` answered for one model, by the values it reads:
    the planner puts thousands of configurations of one model through the checks, and each check
    reads the model's structure under a few values only (the tp plan: tp and sequence parallelism;
    the cut: pp and the chunks), so each is run once per distinct value. A refusal is kept too and
    raised again as it was (a new ``ValueError`` with the same message). ``parallelize`` checks
    once and keeps none."""

    def __init__(self) -> None:
        self._answers: dict[tuple, tuple[bool, object]] = {}

    def __call__(self, key: tuple, check: Callable[[], _T]) -> _T:
        if key not in self._answers:
            try:
                self._answers[key] = (True, check())
            except ValueError as e:
                self._answers[key] = (False, str(e))
        ok, answer = self._answers[key]
        if not ok:
            raise ValueError(answer)
        return answer


def _unkept(key: tuple, check: Callable[[], _T]) -> _T:
    return check()


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
                          extra: frozenset[Feature] = frozenset(), memo: CheckMemo | None = None,
                          **keywords: object) -> CheckedConfig:
    """Raise ``ValueError`` naming the value and the fix for anything ``model`` cannot take under
    ``config`` (whose own options ``ParallelConfig.from_keywords`` checked; or build it here from
    ``parallelize``'s ``keywords``). ``extra``: the features the run adds beyond ``config`` (LoRA when
    the model is a PEFT model, ZeRO for the planner). ``memo``: the answers kept across calls for
    this ``model`` and ``policy`` (``CheckMemo``)."""
    if config is None:
        config = ParallelConfig.from_keywords(**keywords)
    check_composition(config.features | extra, config.values(model_type=model.config.model_type))
    dims = config.dims
    kept = memo or _unkept
    resolved = kept(("policy",), lambda: resolve_policy(model, policy))
    tp, sp, pp = dims.tp, config.sequence_parallel, dims.pp
    cut = (pp, None if config.layers_per_stage is None else tuple(config.layers_per_stage), config.virtual_stages)
    tp_plan = kept(("tp", tp, sp), lambda: build_tp_plan(model, resolved, tp=tp, sequence_parallel=sp))
    stage_plan = kept(("cut", cut), lambda: build_stage_plan(model, resolved, stages=pp,
                                                             layers_per_stage=config.layers_per_stage,
                                                             virtual=config.virtual_stages))
    kept(("compile", config.compile, config.schedule, dims.cp, dims.ep, cut),
         lambda: check_compile(model, compile=config.compile, schedule=config.schedule, cp=dims.cp, ep=dims.ep,
                               layers=stage_plan.layers))
    # before recomputation's own check: what BatchNorm refuses holds whatever the blocks are (a model
    # without it passes at every mesh: one answer; its refusals name the degrees, so per mesh otherwise)
    norms = kept(("batch statistics layers",), lambda: bool(batch_statistics_layers(model)))
    kept(("batch statistics", *((dims, config.microbatches, config.recompute) if norms else ())),
         lambda: check_batch_statistics(model, dims=dims, microbatches=config.microbatches, recompute=config.recompute))
    for layers in stage_plan.block_lists or (None,):
        kept(("recompute", config.recompute, layers),
             lambda: check_recompute(model, recompute=config.recompute, layers=layers))
    if stage_plan.seq2seq is not None:
        check_seq2seq_pipeline(stage_plan.seq2seq, dp_shard=dims.dp_shard, compile=config.compile,
                               sequence_parallel=sp, stages=pp)
    kept(("cp", dims.cp, tp, sp), lambda: check_context_parallel(model, cp=dims.cp, plan=tp_plan))
    kept(("loss chunks", config.loss_chunk_tokens),
         lambda: check_loss_chunks(model, tokens=config.loss_chunk_tokens, loss=tp_plan.loss,
                                   seq2seq=stage_plan.seq2seq is not None))
    kept(("ep", dims.ep, tp, sp, config.expert_dispatch),  # (it reads ep, the plan and the dispatch)
         lambda: check_expert_parallel(model, dims=dims, plan=tp_plan, dispatch=config.expert_dispatch))
    tp_plan = kept(("ep plan", tp, sp, dims.ep), lambda: expert_parallel_plan(model, tp_plan, ep=dims.ep))
    if sp:  # MoE blocks route this rank's tokens: as they are (ep), or gathered (expert-TP)
        tp_plan = kept(("sp plan", tp, dims.ep, cut), lambda: sequence_parallel_plan(
            model, tp_plan, stage_plan,
            token_wise=(token_wise_blocks if dims.ep > 1 else expert_tp_blocks)(model, tp_plan)))
    return CheckedConfig(config=config, policy=resolved, tp_plan=tp_plan, stage_plan=stage_plan)
