"""What the planner does not model, in one place: a mesh that needs it is refused with a
``ValueError`` that says what to plan instead (``parallelize`` itself would accept it)."""

from __future__ import annotations

from torch import nn

from ..expert_parallel.apply import experts_modules, sharded_experts
from ..tensor_parallel.plan import TpPlan


def check_modelled(model: nn.Module, *, model_type: str, plan: TpPlan, ep: int, dp_shard: int) -> None:
    untraced = ("the experts' row gathers at ep=1 (each MoE block's experts gather every tp rank's tokens)"
                if plan.sequence_experts else
                f"the whole regions (block children that run on the gathered sequence: "
                f"{', '.join(plan.whole_regions[:2])}, ...)" if plan.whole_regions else None)
    if untraced:
        raise ValueError(f"sequence_parallel=True on {model_type}: the planner does not trace "
                         f"{untraced}; plan without sequence_parallel, or measure a run")
    if ep > 1 and dp_shard > 1:
        raise ValueError(f"dp_shard={dp_shard} with ep={ep}: the planner does not model the experts' own FSDP "
                         f"groups (over the ranks holding the same experts) yet; plan dp_shard without ep, or "
                         f"measure a run")
    if ep > 1 and len(sharded_experts(model)) != len(experts_modules(model)):
        raise ValueError(f"ep={ep}: the planner models the dispatch of transformers' fused experts only; "
                         f"{model_type}'s experts take every token once per expert (Llama 4's form), "
                         f"whose all-to-alls it does not trace; plan at ep=1 or measure a run")
