"""The bytes one microbatch keeps on each pipeline chunk, from a meta trace (``trace.py``); with one
chunk per rank (``virtual_stages=1``) a chunk is a stage.

Per chunk: what the trace measured alive for the modules in it (split over tp where the plan
splits it; what HF's forward rebuilds on every chunk, such as rotary tables and position ids,
counts on every chunk), plus on a later chunk the activation it received (held until its gradient
is sent back), what a vocab-parallel embedding keeps (its ids shifted into the shard, their mask),
and on the last chunk what a causal LM's loss keeps: its float32 softmax over this rank's
vocabulary columns and int64 targets per row when they are made inside the microbatch's forward.
They are at cp=1 (the step shifts the labels there) and with a vocab-parallel head (which shifts
them into its shard, with two boolean masks); under cp the step shifts them with its other
inputs before the forward, and a step's inputs, like the batch itself, are not counted.

``weight_stash``: under zb_h1 a microbatch's B leaves, until its W, each deferred linear's input and
output gradient (``qn_hf.pipeline.weight_grad``), at their tp shard: a column layer's output gradient and a
row layer's input are split; an input a sibling layer took too is kept once.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable

from torch import nn

from ..config.options import LossKind
from ..pipeline.split import StagePlan, chunk_of_module
from ..policies.styles import COLUMN_STYLES, ROW_STYLES, Style
from ..policies.tp_plan import TpPlan
from ..step.loss_chunks import chunk_sizes
from .trace import Trace


def chunk_activations(model: nn.Module, *, kept: dict[str, tuple[int, int]], base: Trace, plan: TpPlan,
                      stage_plan: StagePlan, act_elem: int, cp: int, loss_chunks: int = 0) -> list[int]:
    """Bytes one microbatch keeps on each chunk (``stage_plan.chunks`` of them, in chunk order);
    ``kept`` is the trace's (in the compute dtype and recompute mode), ``base`` gives the shapes;
    ``model`` the unsharded (meta) model. ``loss_chunks`` (``loss_chunk_tokens``: how many, 0 without): the head
    and what the task forward does after it (its own ops: a soft-capping's tanh) keep nothing, nor does the loss
    but its targets (step/loss_chunks.py)."""
    tp, chunks = plan.tp, stage_plan.chunks
    out = by_chunk(kept, stage_plan=stage_plan, tp=tp, skip=lambda owner: loss_chunks and _tail(owner, stage_plan))
    for c in range(1, chunks):
        out[c] += base.boundary_numel * act_elem
    for name, style in plan.rules if tp > 1 else ():  # int64 ids shifted into the shard, a bool mask
        if style == Style.VOCAB_EMBEDDING and name in base.io:
            out[chunk_of_module(stage_plan, name) or 0] += base.io[name].in_numel * (8 + 1)
    if plan.loss is LossKind.CAUSAL_LM and loss_chunks:  # the targets the chunks take views of (made at cp=1)
        out[chunks - 1] += base.logits_rows * (8 if cp == 1 else 0)
    elif plan.loss is LossKind.CAUSAL_LM:
        padded = padded_vocab(plan, model)
        targets = 8 if cp == 1 or padded else 0
        out[chunks - 1] += base.logits_rows * (_columns(plan, model) * 4 + targets + (2 if padded else 0))
    return [int(x) for x in out]


def _tail(owner: str, stage_plan: StagePlan) -> bool:
    """Whether ``owner``'s bytes are the head's or what the task forward does after it (its own ops: ``""``)."""
    return owner == "" or owner in stage_plan.heads


def _columns(plan: TpPlan, model: nn.Module) -> int:
    """The vocabulary columns of the logits a rank holds (its shard's under a vocab-parallel head)."""
    padded = padded_vocab(plan, model)
    return padded // plan.tp if padded else vocab(model)


def loss_transient(model: nn.Module, *, kept: dict[str, tuple[int, int]], base: Trace, plan: TpPlan,
                   stage_plan: StagePlan, chunk_tokens: int | None, rows: int, act_elem: int) -> int:
    """Bytes a causal LM's loss holds for a moment in its backward on the last chunk beyond what the microbatch
    keeps (``chunk_activations``): the float32 gradients of its log-softmax and of its logits over this rank's
    vocabulary columns, two tensors of the logits' size (log-softmax's backward reads one and writes the
    other). Under ``loss_chunk_tokens`` (``chunk_tokens``; ``rows`` a microbatch) its largest chunk's, with what
    the chunk's recomputation remakes of its forward first (its log-softmax, what the head's tail keeps: the trace's
    figure for the whole logits, per position), and the sums autograd keeps over the chunks' backwards: the head's
    weight gradient and the hidden states' (``act_elem`` bytes an element). 0 for another loss."""
    if plan.loss is not LossKind.CAUSAL_LM or not base.logits_rows:
        return 0
    columns = _columns(plan, model)
    if chunk_tokens is None:
        return base.logits_rows * columns * 4 * 2
    tail = sum(whole + split / plan.tp for owner, (whole, split) in kept.items() if _tail(owner, stage_plan))
    largest = rows * max(chunk_sizes(rows=rows, positions=base.logits_rows // rows, tokens=chunk_tokens))
    sums = (columns + base.logits_rows) * model.get_output_embeddings().weight.shape[1] * act_elem
    return int(largest * (tail / base.logits_rows + 3 * columns * 4) + sums)


def by_chunk(kept: dict[str, tuple[int, int]], *, stage_plan: StagePlan, tp: int,
             skip: Callable[[str], bool] = lambda owner: False) -> list[float]:
    """A trace's bytes by owner (``Trace.kept``, ``Trace.offloaded``: whole, split over tp) summed per chunk, but
    the owners ``skip`` says; what no chunk owns (HF's forward runs it on every chunk) counts on each."""
    chunks = stage_plan.chunks
    out = [0.0] * chunks
    for owner, (whole, split) in kept.items():
        if skip(owner):
            continue
        found = chunks - 1 if owner == "" else chunk_of_module(stage_plan, owner)
        for c in range(chunks) if found is None else (found,):
            out[c] += whole + split / tp
    return out


def on_host(activations: list[int], *, offloaded: dict[str, tuple[float, float]] | None, stage_plan: StagePlan,
            sequence_parallel: bool) -> tuple[list[int], list[int]]:
    """``activations`` (per chunk) less what ``offload="activations"`` lets go of on the device, and what it holds
    on the host, per chunk (``Trace.offloaded``: by the block saving it; None without it). A later chunk's first
    block saves the activation the chunk received, a leaf the offload leaves (the chunk holds it to send its
    gradient back), unless sequence parallelism gathers and splits it there first."""
    def received(block: str) -> bool:
        stack, _, index = block.rpartition(".")
        chunk = chunk_of_module(stage_plan, block)
        return (not sequence_parallel and bool(chunk) and int(index) > 0
                and chunk_of_module(stage_plan, f"{stack}.{int(index) - 1}") != chunk)

    moved = {block: n for block, n in (offloaded or {}).items() if not received(block)}
    host = by_chunk({block: (h, 0) for block, (h, _) in moved.items()}, stage_plan=stage_plan, tp=1)
    freed = by_chunk({block: (d, 0) for block, (_, d) in moved.items()}, stage_plan=stage_plan, tp=1)
    return [int(a - f) for a, f in zip(activations, freed)], [int(h) for h in host]


def kept_collectives(*, base: Trace, plan: TpPlan, stage_plan: StagePlan, act_elem: int) -> list[int]:
    """Bytes of the tp collectives' outputs inside the blocks that selective recomputation keeps, per chunk
    (recompute.py): each row layer's all-reduced output (whole), or under sequence parallelism its
    reduce-scattered slice and each tp entry's gathered input (the whole sequence)."""
    out = [0.0] * stage_plan.chunks
    if plan.tp == 1:
        return [0] * stage_plan.chunks
    inside = lambda name: name.startswith(stage_plan.layers + ".")  # noqa: E731
    for name, style in plan.rules:
        if style == Style.ROWWISE and name in base.io and inside(name):
            share = plan.tp if plan.sequence_parallel else 1
            out[chunk_of_module(stage_plan, name) or 0] += base.io[name].out_numel / share * act_elem
    for entry in plan.tp_entries if plan.sequence_parallel else ():
        if entry in base.io and inside(entry):
            out[chunk_of_module(stage_plan, entry) or 0] += base.io[entry].in_numel * plan.tp * act_elem
    return [int(x) for x in out]


def weight_stash(deferred: Iterable[str], *, base: Trace, plan: TpPlan, stage_plan: StagePlan,
                 act_elem: int) -> list[int]:
    """Bytes of zb_h1's W stash one microbatch keeps on each chunk from its B to its W; ``deferred``:
    the linear modules whose weight gradients W computes."""
    styles = dict(plan.rules)
    out = [0.0] * stage_plan.chunks
    for name in deferred:
        if name not in base.io:  # never called in the forward: nothing to keep
            continue
        io, style = base.io[name], styles.get(name)
        x = 0 if name in base.repeated_inputs else io.in_numel / (plan.tp if style in ROW_STYLES else 1)
        grad = io.out_numel / (plan.tp if style in COLUMN_STYLES else 1)
        out[chunk_of_module(stage_plan, name) or 0] += (x + grad) * act_elem
    return [int(x) for x in out]


def vocab(model: nn.Module) -> int:
    head = model.get_output_embeddings()
    return head.weight.shape[0] if head is not None else 0


def padded_vocab(plan: TpPlan, model: nn.Module) -> int:
    """The vocabulary padded to a multiple of tp when the head is vocab-parallel, else 0."""
    for name, style in plan.rules:
        if style == Style.VOCAB_COLWISE:
            rows = model.get_submodule(name).weight.shape[0]  # the unsharded model's vocabulary
            return -(-rows // plan.tp) * plan.tp  # padded to a multiple of tp, as the shards are
    return 0
