"""Per-block ``torch.compile`` (inductor): each block of this stage compiled in place, equal to eager.

``apply_compile`` compiles every block of the stage's ``layers`` list in place, as torchtitan compiles each
TransformerBlock (``nn.Module.compile``): the module object, its parameter names, its hooks and everything
qn_hf set on it stay, so checkpoints, optimizers, the pipeline stage and the dp buckets see the same model;
only the block's call runs compiled code. The model's forward outside the blocks (embeddings, masks, rotary
tables, head, loss), the pipeline schedule and the dp gradient buckets (post-accumulate-grad hooks, which
autograd fires after the compiled backward) stay eager.

What a compiled block traces into its graphs, forward and backward:

* the tp collectives of its layers and tp entries: comm.py's autograd Functions run torch's functional
  collectives, which inductor lowers to collectives on buffers it owns (reused where it proves them dead);
* its hooks: sequence parallelism's gathers at the tp entries and its split and gather at a chunk's first
  and last block (functional collectives too), ZeRO-1's per-module waits for the weight gathers (nothing
  to wait for by then: ``train_step`` waits for them all before the forward). The entries'
  regathering (keeping only the slice of their input for backward, through saved-tensor hooks keyed on
  storages) cannot be traced: under ``compile`` the entries keep the gathered input, as under recomputation;
* peft's adapter layers on the blocks' linear layers (LoRA is tested).

What splits a block's graph (a graph break: the pieces compile separately, what is between them runs
eagerly), and nothing else does (tests/test_compile.py counts the breaks and the graphs):

* the random-stream hooks (rng.py) that enter and leave a tp region swap the device generator's state,
  which dynamo does not trace. They exist only at tp > 1, and only on the regions that may draw in
  training (``rng.region_draws``: dropout above 0 in them); without dropout a block compiles as one graph
  at any tp. With them a block compiles as the part before the region, the region, and the rest; dropout
  inside each piece draws from the stream its hooks set, as in eager (from inductor's generator, seeded
  from that stream: the masks are not eager's bit for bit);
* ring attention (cp > 1): its point-to-point transfers and online softmax over the blocks it receives
  run in an autograd Function dynamo cannot trace; the function qn_hf registers in transformers' attention
  interface is ``torch.compiler.disable``d, so it runs eagerly between the block's compiled pieces;
* the experts' call of a mixture-of-experts block, ep's dispatch or the model's own implementation at
  ep=1 (``expert_parallel.apply.eager_experts``): each expert's rows are known only at run time, which
  would recompile a graph at every new count, so the call runs eagerly, the router and the rest compiled;
* ZB-H1's deferring projections (pipeline/weight_grad.py): a hook on an autograd node and a backward
  that queues its inputs for a later one; each runs eagerly, with the plain kernels.

Sharded data parallelism (dp_shard): FSDP2's ``fully_shard`` goes on each compiled block afterwards, as
torchtitan applies it. Its forward and backward hooks sit on the block, and dynamo leaves FSDP's hooks
out of the graph (``torch._dynamo.config.skip_fsdp_hooks``): they run eagerly around the block's compiled
code, all-gathering its weights before and reduce-scattering its gradients after, and the graph sees the
gathered weights as plain parameters (no graph break beyond the random streams', nothing recompiled).

Recomputation: torch's checkpoint turns dynamo off for everything it calls, so a block whose forward
transformers checkpoints keeps its checkpoint (recompute.py's, with the random streams rewound) eager, around
a compiled forward, which the recomputation runs again whole (in evaluation nothing is checkpointed and
such a block runs eagerly): under ``compile`` ``"selective"`` recomputes like ``"full"`` (its policy names
operators that the compiled code does not call, inductor's kernels do the work), collectives included.
Blocks without dropout carry no random streams' hooks (rng.py); whether dynamo then traces the checkpoint
and applies the policy inside the graph has not been measured.

Refused (``check_compile``, raised before any collective): expert parallelism over experts stacked on dim 0
(Llama 4), whose dispatch hooks no compiled test covers.
"""

from __future__ import annotations

import functools
from collections.abc import Callable

import torch
from torch import nn

from ..config.composition import check_composition
from ..config.features import Feature
from ..config.schedule import as_schedule
from ..expert_parallel.apply import eager_experts
from ..expert_parallel.stacked import is_stacked_experts
from ..pipeline.standins import StandIn


def check_compile(model: nn.Module, *, compile: bool, schedule: str, cp: int, ep: int, layers: str | None) -> None:
    """``compile`` is a bool, and what it is combined with can be compiled per block (``layers``: the
    stage plan's list of blocks)."""
    if not isinstance(compile, bool):
        raise ValueError(f"compile={compile!r} must be True or False")
    if not compile:
        return
    if layers is None:
        raise ValueError(f"compile=True: {type(model).__name__} has no list of blocks qn_hf found to compile one by "
                         f"one; use compile=False")
    used = {Feature.COMPILE, Feature.for_schedule(as_schedule(schedule))}
    used |= {f for f, n in ((Feature.CP, cp), (Feature.EP, ep)) if n > 1}
    check_composition(used, {"cp": cp, "ep": ep, "schedule": as_schedule(schedule)})
    stacked = [name for name, module in model.named_modules() if is_stacked_experts(module)] if ep > 1 else []
    if stacked:
        raise ValueError(f"compile=True with ep={ep} and experts stacked on dim 0 ({stacked[0]}, Llama 4's form): "
                         f"their dispatch hooks are not compiled in any test; use compile=False, or ep=1")


def stage_blocks(model: nn.Module, *, layers: str) -> list[nn.Module]:
    """The blocks of ``layers`` held on this stage (another stage's are stand-ins)."""
    return [block for block in model.get_submodule(layers) if not isinstance(block, StandIn)]


def apply_compile(model: nn.Module, *, layers: str) -> int:
    """Compile every block of ``layers`` held on this stage in place (inductor); return how many.
    Compilation happens at each block's first call. Run it after ``apply_recompute``."""
    blocks = stage_blocks(model, layers=layers)
    eager_experts(model)
    for block in blocks:
        checkpoint_fn = getattr(block, "_gradient_checkpointing_func", None)
        if getattr(block, "gradient_checkpointing", False) and checkpoint_fn is not None:
            # torch's checkpoint turns dynamo off for everything it calls: in a compiled block call it
            # would run the whole block eagerly. The checkpoint stays eager, around a compiled forward.
            block._gradient_checkpointing_func = functools.partial(_checkpoint_compiled, checkpoint_fn)
        else:
            block.compile()
    return len(blocks)


def _checkpoint_compiled(checkpoint_fn: Callable, function: Callable, *args):
    """``checkpoint_fn`` (recompute.py's) of the compiled ``function`` (transformers' block forward, its
    keyword arguments bound). The compiled code is cached on the forward's code: one per block class."""
    return checkpoint_fn(torch.compile(function), *args)


def is_compiled(model: nn.Module, *, layers: str) -> bool:
    """Whether ``apply_compile`` compiled this stage's blocks."""
    def compiled(block: nn.Module) -> bool:
        fn = getattr(block, "_gradient_checkpointing_func", None)
        wrapped = isinstance(fn, functools.partial) and fn.func is _checkpoint_compiled
        return wrapped or getattr(block, "_compiled_call_impl", None) is not None

    blocks = stage_blocks(model, layers=layers)
    return bool(blocks) and all(compiled(block) for block in blocks)
