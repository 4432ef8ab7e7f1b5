"""What the planner does not model, in one place: a mesh that needs it is refused with a
``ValueError`` that says what to plan instead (``parallelize`` itself would accept it)."""

from __future__ import annotations

from torch import nn

from ..expert_parallel.apply import experts_modules, sharded_experts
from ..policies.tp_plan import TpPlan


def check_modelled(model: nn.Module, *, model_type: str, plan: TpPlan, ep: int, stages: int = 1,
                   loop_count: str | None = None) -> None:
    untraced = ("the experts' row gathers at ep=1 (each MoE block's experts gather every tp rank's tokens)"
                if plan.sequence_experts else
                f"the whole regions (block children that run on the gathered sequence: "
                f"{', '.join(plan.whole_regions[:2])}, ...)" if plan.whole_regions else None)
    if untraced:
        raise ValueError(f"sequence_parallel=True on {model_type}: the planner does not trace "
                         f"{untraced}; plan without sequence_parallel, or measure a run")
    if ep > 1 and len(sharded_experts(model)) != len(experts_modules(model)):
        raise ValueError(f"ep={ep}: the planner models the dispatch of transformers' fused experts only; "
                         f"{model_type}'s experts take every token once per expert (Llama 4's form), "
                         f"whose all-to-alls it does not trace; plan at ep=1 or measure a run")
    if stages > 1 and loop_count is not None:
        # the trace records the module's calls under one name, which a pipeline holds on every stage
        raise ValueError(f"pp={stages} on {model_type}: its blocks are one module its forward calls "
                         f"config.{loop_count} times, whose calls the planner does not share out between the "
                         f"stages; plan at pp=1 or measure a run")


def modelled_experts(model: nn.Module) -> int:
    """The routed experts of each MoE layer, for a model whose experts the planner can plan under ep
    (transformers' fused experts, as many in every layer); 0 for any other model (dense, or experts
    ep shards in another form, which ``check_modelled`` refuses)."""
    fused, sharded = experts_modules(model), sharded_experts(model)
    sizes = {module.num_experts for module in fused.values()}
    return sizes.pop() if len(sizes) == 1 and len(fused) == len(sharded) else 0
