"""Policies: how to parallelize a Hugging Face architecture, as data, and the vocabulary they speak.

``model_policy.py`` (``ModelPolicy`` and the pipeline's stand-ins), ``styles.py`` (the tp styles a
rule names), ``patterns.py`` (wildcard module names, where the base model sits), ``heads.py``
(attention heads per rank), ``embedding_types.py`` (the embedding subclasses a parallel embedding
reproduces), ``module_kinds.py`` (projections, position-wise modules), ``peft_names.py`` (a model as
peft wrapped it). Ours, one data-only file per architecture keyed by ``config.model_type`` (gpt2.py,
llama.py, vit.py), and for every other model one derived from transformers' own plans (derive.py,
with amendments.py fixing or refusing those plans where they are wrong, entries.py finding the tp
entries and every_stage.py the modules a pipeline keeps on every stage), and for any other model its
body found from the module structure (body.py): where a pipeline may cut its forward
(stack_cut.py, with the cut's data in cuts.py), a tp plan from its projections' names and shapes
(structure.py) and the fused q|k|v projections only a forward knows the order of (fused.py).
``task.py`` finds the head of a task model and the loss its forward computes, whichever policy
describes the body; ``positions.py`` the longest sequences its absolute position tables serve; ``tp_plan.py``
holds ``TpPlan``, a policy resolved against one model at one tp (``tensor_parallel/plan.py`` resolves it), which
every mechanism reads."""

from __future__ import annotations

from torch import nn

from . import gpt2, llama, vit
from .body import body_policy
from .derive import derive_policy
from .model_policy import ModelPolicy

POLICIES: dict[str, ModelPolicy] = {p.model_type: p for p in (gpt2.POLICY, llama.POLICY, vit.POLICY)}

__all__ = ["POLICIES", "derive_policy", "resolve_policy"]


def resolve_policy(model: nn.Module, policy: ModelPolicy | None) -> ModelPolicy:
    """The given policy, else ours for ``config.model_type``, else one derived from transformers' plan,
    else the body found from the module structure (body.py): every model gets one, so data
    parallelism never depends on an architecture's policy."""
    if policy is not None:
        return policy
    model_type = getattr(getattr(model, "config", None), "model_type", None)
    if model_type in POLICIES:
        return POLICIES[model_type]
    derived = derive_policy(model)
    if derived is not None:
        return derived
    return body_policy(model)
