"""The bytes one microbatch keeps on each pipeline stage, from a meta trace (``trace.py``).

Per stage: what the trace measured alive for the modules on it (split over tp where the plan
splits it; what HF's forward rebuilds on every stage, such as rotary tables and position ids,
counts on every stage), plus on a later stage the activation it received (held until its gradient
is sent back), what a vocab-parallel embedding keeps (its ids shifted into the shard, their mask),
and on the last stage what a causal LM's loss keeps: its float32 softmax over this rank's
vocabulary columns and int64 targets per row when they are made inside the microbatch's forward.
They are at cp=1 (the step shifts the labels there) and with a vocab-parallel head (which shifts
them into its shard, with two boolean masks); under cp the step shifts them with its other
inputs before the forward, and a step's inputs, like the batch itself, are not counted.
"""

from __future__ import annotations

from torch import nn

from ..pipeline.split import StagePlan, stage_of_module
from ..plan import TpPlan
from .trace import Trace


def stage_activations(model: nn.Module, *, kept: dict[str, tuple[int, int]], base: Trace, plan: TpPlan,
                      stage_plan: StagePlan, act_elem: int, cp: int) -> list[int]:
    """Bytes one microbatch keeps on each stage; ``kept`` is the trace's (in the compute dtype and
    recompute mode), ``base`` gives the shapes; ``model`` the unsharded (meta) model."""
    tp, pp = plan.tp, stage_plan.stages
    out = [0.0] * pp
    for owner, (whole, split) in kept.items():
        found = pp - 1 if owner == "" else stage_of_module(stage_plan, owner)
        for s in range(pp) if found is None else (found,):  # None: HF's forward runs it on every stage
            out[s] += whole + split / tp
    for s in range(1, pp):
        out[s] += base.boundary_numel * act_elem
    for name, style in plan.rules if tp > 1 else ():  # int64 ids shifted into the shard, a bool mask
        if style == "vocab_embedding" and name in base.io:
            out[stage_of_module(stage_plan, name) or 0] += base.io[name].in_numel * (8 + 1)
    if plan.loss == "causal_lm":
        padded = padded_vocab(plan, model)
        columns = padded // tp if padded else vocab(model)
        targets = 8 if cp == 1 or padded else 0
        out[pp - 1] += base.logits_rows * (columns * 4 + targets + (2 if padded else 0))
    return [int(x) for x in out]


def vocab(model: nn.Module) -> int:
    head = model.get_output_embeddings()
    return head.weight.shape[0] if head is not None else 0


def padded_vocab(plan: TpPlan, model: nn.Module) -> int:
    """The vocabulary padded to a multiple of tp when the head is vocab-parallel, else 0."""
    for name, style in plan.rules:
        if style == "vocab_colwise":
            rows = model.get_submodule(name).weight.shape[0]  # the unsharded model's vocabulary
            return -(-rows // plan.tp) * plan.tp  # padded to a multiple of tp, as the shards are
    return 0
