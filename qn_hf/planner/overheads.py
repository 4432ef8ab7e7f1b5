"""qn_hf's own host work per step and per exchange, measured on tiny models (``calibrate.py``).

The kernel and collective figures price a step's compute and transfers; what a real step adds
around them is its machinery: the batch agreement and the loss's reductions once a step, and per
exchange the autograd functions, hooks and bookkeeping of each mechanism (the pipeline's executor
per transfer, FSDP2's hooks and its gathers' copies in and out, the tp, cp and ep functions). On
this project's VM a 4-layer Llama of hidden 32 measured 16.7 ms a step at dp=2 where its kernels
and transfers priced 6.3, and 46 against 13 ms at tp=2: small models are mostly this work.

Measured by running them: each mechanism at degree 2 (dp over the rest of the world) on a tiny
model (``step_seconds``: ``tiny_steps.tiny_step_seconds`` builds and times them), against what the time
model predicts for it from the calibration's other figures. The residual of plain dp is
the step's overhead; each mechanism's residual beyond it, over the calls the estimate counts for
its group, is that group's overhead per call (an MoE's ep against the same MoE at plain dp).
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.distributed as dist

from ..config.dims import AXES, Axis, AxisSpec
from .calibration import Calibration

STEP = "step"
GLOBAL_BATCH, SEQ = 8, 16  # a step's sequences and their tokens (the runner slices each dp rank's)
DENSE = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=4, num_attention_heads=2, num_key_value_heads=2,
             vocab_size=64, max_position_embeddings=32, tie_word_embeddings=False, architectures=["LlamaForCausalLM"])
MOE = dict(hidden_size=32, intermediate_size=64, moe_intermediate_size=32, num_experts=4, num_experts_per_tok=2,
           num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=2, head_dim=16, vocab_size=64,
           max_position_embeddings=32, tie_word_embeddings=False, architectures=["Qwen3MoeForCausalLM"])


def _mechanism(spec: AxisSpec, world: int) -> tuple[str, dict[str, int]]:
    """The model and the degrees one dimension's host work is measured at: its own at 2 (experts on the MoE
    model), dp over the rest of the world (all of it for a dimension carved out of the mesh's ranks, as ep and
    dp_shard are), a pipeline with microbatches to schedule."""
    kind = "moe" if spec.axis is Axis.EP else "dense"
    degrees = {spec.axis.value: 2, Axis.DP.value: world if spec.mesh is None else world // 2}
    return kind, degrees | ({"microbatches": 4} if spec.axis is Axis.PP else {})


def _config(kind: str):
    from transformers import LlamaConfig, Qwen3MoeConfig

    return LlamaConfig(**DENSE) if kind == "dense" else Qwen3MoeConfig(**MOE)


# (the model's config, the configuration, the device) -> the median seconds of a step (the planner's own:
# tiny_steps.tiny_step_seconds; a caller may time steps otherwise)
StepSeconds = Callable[[object, object, torch.device], float]


def measure_overheads(cal: Calibration, device: torch.device, *, step_seconds: StepSeconds) -> dict[str, float]:
    """Seconds of host work once a step (``STEP``) and per call of each group (module docstring),
    never below zero; the same on every rank (``step_seconds`` returns the slowest rank's). At an
    odd world size only the step's is measured."""
    from qn_hf.config.parallel_config import ParallelConfig

    from .cost import Hardware, step_time
    from .estimate import Planner

    world = dist.get_world_size()
    hw = Hardware(gpu_memory=cal.memory_bytes, gpus_per_node=cal.ranks_per_node)

    def residual(kind: str, **degrees) -> tuple[float, object]:
        micro_batch_size = GLOBAL_BATCH // degrees.get("dp", 1) // degrees.get("microbatches", 1)
        parallel = ParallelConfig(**degrees)
        est = Planner(_config(kind), seq_len=SEQ, micro_batch_size=micro_batch_size).estimate(parallel)
        return step_seconds(_config(kind), parallel, device) - step_time(est, hw, cal).seconds, est

    base = {"dense": residual("dense", dp=world)[0]}
    out = {STEP: max(base["dense"], 0.0)}
    if world % 2:
        return out
    for spec in AXES:  # each dimension's mechanism at degree 2 on a tiny model
        if spec.axis is Axis.DP:
            continue
        group = spec.axis
        kind, degrees = _mechanism(spec, world)
        if kind not in base:
            base[kind] = residual(kind, dp=world)[0]
        extra, est = residual(kind, **degrees)
        calls = max(s.comm[group].calls if group in s.comm else 0 for s in est.stages)
        out[group.value] = max(extra - base[kind], 0.0) / calls if calls else 0.0
    return out
