"""``TpPlan``: a policy resolved against one model at one tp, the plan every mechanism reads (tensor_parallel
builds it, ``build_tp_plan``; sequence, context and expert parallelism, the step, the planner and the checks read
it), so it lives here, below them all."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, replace

from ..config.options import LossKind
from .fused import HeadAxis
from .heads import HeadLayout
from .model_policy import ModelPolicy
from .positions import PositionLimits
from .styles import PARAM_STYLES, Style
from .task import TaskHead


@dataclass(frozen=True)
class TpPlan:
    """A policy resolved against one model at one tp: concrete module names, no patterns."""

    policy: ModelPolicy
    tp: int
    layout: HeadLayout
    rules: tuple[tuple[str, Style], ...]  # (module name from the top model, or parameter name for param_*, style)
    patches: tuple[tuple[str, str, int], ...]  # (module name, attribute path, new value)
    grad_sum: tuple[str, ...]  # replicated parameters whose gradients are summed over tp
    tp_entries: tuple[str, ...]
    tp_rng_regions: tuple[str, ...]
    shared_rng_regions: tuple[str, ...]
    head: TaskHead  # the task model's head and the loss its forward computes (policies/task.py)
    positions: PositionLimits  # the longest sequences the model's absolute position tables serve (positions.py)
    base_prefix: str
    mla_rope_dim: int | None = None  # the rotary tail of MLA's kv_a projection (style mla_kv_a)
    sequence_parallel: bool = False  # activations between tp regions split over the sequence (sequence_parallel.py)
    # shared regions whose input is whole on every tp rank even under sequence parallelism (a column
    # LoRA target's dropout on the input its tp entry gathered): they keep the shared stream there
    whole_input_rng_regions: tuple[str, ...] = ()
    # under sequence parallelism, experts modules (style experts) in MoE blocks that run on this rank's
    # slice: they gather every rank's rows and reduce-scatter their partial output (hooks.py)
    sequence_experts: tuple[str, ...] = ()
    # under sequence parallelism, block children that run on the whole sequence exactly as under plain
    # tp (they mix positions and are no tp entry): gathered on the way in, this rank's slice taken out
    whole_regions: tuple[str, ...] = ()
    # attention modules taking inputs built for every head, and where (hooks.head_input_hooks)
    head_inputs: tuple[tuple[str, tuple[tuple[str, HeadAxis], ...]], ...] = ()

    @property
    def loss(self) -> LossKind | None:
        """The built-in loss: the head's, or the policy's override; None for a model without a loss."""
        return self.policy.loss or self.head.kind

    def only(self, keep: Callable[[str], bool]) -> TpPlan:
        """The plan restricted to the modules ``keep`` accepts (those of this pipeline stage)."""
        return replace(
            self,
            rules=tuple(r for r in self.rules if keep(rule_module(*r))),
            grad_sum=tuple(n for n in self.grad_sum if keep(n.rpartition(".")[0])),
            patches=tuple(p for p in self.patches if keep(p[0])),
            tp_entries=tuple(n for n in self.tp_entries if keep(n)),
            tp_rng_regions=tuple(n for n in self.tp_rng_regions if keep(n)),
            shared_rng_regions=tuple(n for n in self.shared_rng_regions if keep(n)),
            whole_input_rng_regions=tuple(n for n in self.whole_input_rng_regions if keep(n)),
            sequence_experts=tuple(n for n in self.sequence_experts if keep(n)),
            whole_regions=tuple(n for n in self.whole_regions if keep(n)),
            head_inputs=tuple(h for h in self.head_inputs if keep(h[0])),
        )


def rule_module(name: str, style: Style) -> str:
    """The module a rule acts on: itself, or for a parameter style the parameter's owner."""
    return name.rpartition(".")[0] if style in PARAM_STYLES else name
