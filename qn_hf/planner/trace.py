"""One microbatch through the unsharded model on the ``meta`` device, recording what the planner
needs without computing anything: the input and output sizes of every module the tp plan touches
(what its collectives carry), the hidden state passed between stages, and the bytes the microbatch
keeps for its backward, attributed to the module that allocated them.

What a microbatch keeps is measured, not listed: every storage an op allocates during the forward
is recorded (weakly) with the module running at the time, the outputs are dropped once the
forward is over while their autograd graph is kept, and what is still alive is what backward will
need. The same measure covers every way of keeping a tensor: autograd's saved tensors, torch's
checkpoint holding a block's inputs (``recompute="full"``), selective recomputation's cache of
matrix products (``recompute="selective"``, set up as ``qn_hf/memory/recompute.py`` does), and a tensor
two ops keep counts once.

Attention and MoE experts' grouped matmuls run as the kernels training runs (``kernels.py``). (A
model configured for eager attention does keep its attention matrices, in training and here.)

The forward is Hugging Face's own, so the shapes are the model's real ones (GQA, packed q|k|v,
ViT's class token ...), for 70B-parameter configs in about a second. With sequence parallelism
the trace runs the model as one tp rank does, its collectives stood in for (``sequence.py``); with
context parallelism on one cp rank's tokens, ring attention stood in for (``context.py``); with
expert parallelism one rank's token dispatch stood in for (``experts.py``).
"""

from __future__ import annotations

import contextlib
import functools
import gc
from collections import defaultdict
from dataclasses import dataclass, replace

import torch
from torch import nn
from torch.multiprocessing.reductions import StorageWeakRef
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten
from torch.utils.checkpoint import checkpoint
from transformers.cache_utils import Cache
from transformers.modeling_layers import GradientCheckpointingLayer
from transformers.pytorch_utils import Conv1D

from ..expert_parallel.apply import experts_modules
from ..tensor_parallel.plan import TpPlan
from ..memory.recompute import checkpoint_options
from ..tensor_parallel.sequence_parallel import regathers
from .context import RingCall, RingStandIn
from .experts import ExpertCall, ExpertsStandIn, moe_regions
from .kernels import TrainingKernels
from .sequence import SeqCollective, SequenceStandIns, StageEdges
from ..tensor_parallel.styles import COLUMN_STYLES, WHOLE_STYLES, Style


@dataclass(frozen=True)
class ModuleIO:
    calls: int
    in_numel: int  # first tensor argument, summed over calls
    out_numel: int  # output tensor (or first of a tuple), summed over calls


@dataclass(frozen=True)
class Trace:
    io: dict[str, ModuleIO]  # every tp-plan rule module, tp entry and linear layer, by name in the top model
    boundary_numel: int  # elements of the hidden state one block hands to the next
    kept: dict[str, tuple[int, int]]  # module -> (bytes kept whole on every tp rank, bytes split across tp)
    logits_rows: int  # rows of the output logits (tokens of a causal LM, images of a classifier)
    tokens: int  # positions per microbatch the blocks process (on one cp rank)
    # Row-parallel layers inside a block whose forward all-reduce a recomputation of the block runs
    # again: torch's checkpoint stops recomputing once the block's last saved tensor is back, so a
    # row layer with nothing saved after it in its block (the MLP's, before the residual add) is not
    # rerun. Empty for a trace with recomputation on (its blocks' saves are the checkpoint's).
    rerun: frozenset[str]
    # Sequence parallelism's tp collectives, one microbatch's, in the order they ran (empty without).
    sequence: tuple[SeqCollective, ...] = ()
    # Ring attention's calls under context parallelism, one microbatch's, in order (empty without).
    ring: tuple[RingCall, ...] = ()
    # Every fused experts call, one microbatch's, in order (empty for a dense model).
    experts: tuple[ExpertCall, ...] = ()
    # Linear layers whose input is the very tensor a sibling (same parent module) took before them:
    # q, k and v of one norm output, gate and up. What keeps their inputs (zb_h1's W stash) keeps it once.
    repeated_inputs: frozenset[str] = frozenset()


def example_inputs(model: nn.Module, *, micro_batch_size: int, seq_len: int) -> dict[str, torch.Tensor]:
    """Meta tensors shaped like one microbatch of the model's main input."""
    config = model.config
    if getattr(model, "main_input_name", "input_ids") == "pixel_values":
        size = config.image_size
        return {"pixel_values": torch.empty(micro_batch_size, config.num_channels, size, size, device="meta")}
    return {"input_ids": torch.empty(micro_batch_size, seq_len, dtype=torch.long, device="meta")}


def _tensors(value) -> list[torch.Tensor]:
    return [t for t in tree_flatten(value)[0] if isinstance(t, torch.Tensor) and t.layout == torch.strided]


class _Allocations(TorchDispatchMode):
    """Every storage an op allocates while active, with the module that was running, held weakly.
    A storage first met as an op's input existed before (a weight, the input ids) and never counts."""

    def __init__(self, owner) -> None:
        super().__init__()
        self._owner = owner  # -> a key for the allocations made now
        self._known: dict[int, StorageWeakRef] = {}
        self._allocated: list[tuple[StorageWeakRef, int, object]] = []

    def _first_sight(self, t: torch.Tensor) -> StorageWeakRef | None:
        ref = StorageWeakRef(t.untyped_storage())
        known = self._known.get(ref.cdata)
        if known is not None and not known.expired():
            return None
        self._known[ref.cdata] = ref  # a new storage (possibly at a freed one's address)
        return ref

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        for t in _tensors((args, kwargs)):
            self._first_sight(t)
        out = func(*args, **kwargs)
        for t in _tensors(out):
            ref = self._first_sight(t)
            if ref is not None:
                self._allocated.append((ref, t.untyped_storage().nbytes(), self._owner()))
        return out

    def alive(self) -> dict[object, int]:
        """Bytes still alive, by the owner key they were allocated under."""
        out: dict[object, int] = defaultdict(int)
        for ref, nbytes, owner in self._allocated:
            if not ref.expired():
                out[owner] += nbytes
        return out


def _checkpoint_blocks(model: nn.Module, *, layers: str, recompute: str | None) -> list[nn.Module]:
    """Turn on transformers' per-block checkpointing as ``apply_recompute`` does (without random
    streams: nothing on ``meta`` is random, and their states are host memory); the blocks set."""
    if recompute is None:
        return []
    blocks = [b for b in model.get_submodule(layers) if isinstance(b, GradientCheckpointingLayer)]
    for block in blocks:
        block.gradient_checkpointing = True
        block._gradient_checkpointing_func = functools.partial(checkpoint, preserve_rng_state=False,
                                                               **checkpoint_options(recompute))
    return blocks


def trace_microbatch(model: nn.Module, plan: TpPlan, *, layers: str, inputs: dict[str, torch.Tensor],
                     recompute: str | None = None, edges: StageEdges | None = None, cp: int = 1,
                     ep: int = 1) -> Trace:
    """Trace one microbatch through ``model`` (in training mode, its blocks checkpointed for the
    forward when ``recompute`` is set; the model is left as it was). ``edges``: the stage cut of a
    sequence-parallel ``plan``, where each stage splits and gathers the sequence. ``cp`` > 1:
    ``inputs`` are one cp rank's (``context.cp_inputs``) and attention is ring attention's stand-in.
    ``ep`` > 1: the experts' dispatch is expert parallelism's stand-in (one rank's, over ``plan.tp``)."""
    styles = dict(plan.rules)
    # Exact nn.Linear and Conv1D are what zb_h1 can defer (``weight_grad.make_deferrable``): the
    # estimate sizes its stash from their inputs and outputs.
    linears = {n for n, m in model.named_modules() if type(m) in (nn.Linear, Conv1D)}
    watched = set(styles) | set(plan.tp_entries) | linears
    seen_inputs: dict[str, list[StorageWeakRef]] = defaultdict(list)  # parent module -> its linears' inputs
    repeated: set[str] = set()
    rowwise = {name for name, style in styles.items() if style == Style.ROWWISE}
    io: dict[str, list[int]] = defaultdict(lambda: [0, 0, 0])
    stack: list[str] = []
    boundary = [0]
    handles = []
    block_names = {f"{layers}.{i}" for i in range(len(model.get_submodule(layers)))}
    # Order of events inside each block: saves and row layers' outputs, for ``Trace.rerun``.
    tick = [0]
    last_save: dict[str, int] = {}
    row_done: dict[str, tuple[str, int]] = {}
    sequence: list[tuple[SeqCollective, str | None, int]] = []  # with the block it ran in, and when
    ring: list[tuple[RingCall, str | None, int]] = []
    experts: list[list] = []  # [call, block, tick of its all-to-alls, tick of its tp gather]

    def block_of(names: list[str]) -> str | None:
        return next((n for n in reversed(names) if n in block_names), None)

    def pre(name: str):
        def hook(module, args, kwargs):
            stack.append(name)
            if name in watched:
                first = args[0] if args else next(v for v in kwargs.values() if isinstance(v, torch.Tensor))
                io[name][0] += 1
                io[name][1] += first.numel()
                if name in linears:
                    ref, parent = StorageWeakRef(first.untyped_storage()), name.rpartition(".")[0]
                    if any(r.cdata == ref.cdata and not r.expired() for r in seen_inputs[parent]):
                        repeated.add(name)
                    else:
                        seen_inputs[parent].append(ref)
            if name in block_names:  # a cache would keep every block's keys and values (see below)
                kwargs = {k: None if isinstance(v, Cache) else v for k, v in kwargs.items()}
                return (tuple(None if isinstance(a, Cache) else a for a in args),
                        {**kwargs, **({"use_cache": False} if "use_cache" in kwargs else {})})
            return None
        return hook

    def post(name: str):
        def hook(module, args, kwargs, output):
            stack.pop()
            out = output[0] if isinstance(output, (tuple, list)) else getattr(output, "last_hidden_state", output)
            if name in watched and isinstance(out, torch.Tensor):
                io[name][2] += out.numel()
            if name in block_names and isinstance(out, torch.Tensor):
                boundary[0] = out.numel()
            if name in rowwise and (block := block_of(stack)) is not None:
                tick[0] += 1
                row_done[name] = (block, tick[0])
        return hook

    def note(collective: SeqCollective) -> None:
        tick[0] += 1
        sequence.append((collective, block_of(stack) if collective.in_block_forward else None, tick[0]))

    def note_ring(call: RingCall) -> None:
        tick[0] += 1
        ring.append((replace(call, module=stack[-1] if stack else ""), block_of(stack), tick[0]))

    def note_experts(call: ExpertCall, gather: bool) -> None:
        tick[0] += 1
        if gather:
            experts[-1][3] = tick[0]
        else:
            experts.append([replace(call, module=stack[-1] if stack else ""), block_of(stack), tick[0], tick[0]])

    def pack(t: torch.Tensor) -> torch.Tensor:
        if (block := block_of(stack)) is not None:
            tick[0] += 1
            last_save[block] = tick[0]
        return t

    for name, module in model.named_modules():
        handles.append(module.register_forward_pre_hook(pre(name), with_kwargs=True))
        handles.append(module.register_forward_hook(post(name), with_kwargs=True))
    blocks = _checkpoint_blocks(model, layers=layers, recompute=recompute)
    # Registered after the trace's hooks, so that the module running is on ``stack`` for them too.
    standins = None
    if edges is not None:  # regathering as parallelize sets it: without recomputation
        standins = SequenceStandIns(model, plan, edges, note=note, regather=regathers(recompute), on_save=pack)
    ring_standin = RingStandIn(model, cp=cp, note=note_ring) if cp > 1 else contextlib.nullcontext()
    # under sequence parallelism a tp rank routes its own slice: nothing is shared out over tp (dispatch.py)
    moe = (ExpertsStandIn(model, ep=ep, tp=1 if plan.sequence_parallel else plan.tp, note=note_experts)
           if experts_modules(model) else None)

    def split_now() -> bool | None:  # allocations are split over tp: None when the module's rule says
        return standins.region if standins else (False if moe is not None and moe.inside else None)

    # Owner: (module, split_now()); the ep stand-in's tensors already have one tp rank's size.
    allocations = _Allocations(lambda: (stack[-1] if stack else "", split_now()))
    was_training = model.training
    model.train()
    try:
        # Inside checkpointed blocks the checkpoint's own hooks take the saves: only watch without.
        saves = torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t) if not blocks else contextlib.nullcontext()
        with (TrainingKernels(), ring_standin, moe or contextlib.nullcontext(), allocations, saves,
              standins or contextlib.nullcontext()):
            # With use_cache on, transformers skips a packed-sequence check that reads tensor values
            # (impossible on meta); the blocks get no cache (``pre``), so they run as in training.
            kwargs = {**plan.policy.forward_kwargs, **({"use_cache": True} if "use_cache" in plan.policy.forward_kwargs else {})}
            out = model(**inputs, **kwargs)
    finally:
        for h in handles:
            h.remove()
        for block in blocks:
            block.gradient_checkpointing = False
        model.train(was_training)
    logits = getattr(out, "logits", None)
    rows = logits.shape[:-1].numel() if logits is not None else 0
    # Keep the graph (what backward needs), drop the outputs themselves (logits nobody saved).
    graph = [t.grad_fn for t in _tensors(out.to_tuple() if hasattr(out, "to_tuple") else out)]
    del out, logits
    gc.collect()  # an output caught in a reference cycle would stay alive and count
    kept: dict[str, list[int]] = defaultdict(lambda: [0, 0])
    whole = moe_regions(model, plan) if ep > 1 else frozenset()
    for (owner, region), nbytes in allocations.alive().items():
        kept[owner][1 if _split_across_tp(owner, styles, plan, region=region, whole=whole) else 0] += nbytes
    del graph
    if standins is not None:
        standins.release()
        boundary[0] = standins.whole_numel  # blocks' outputs are slices; the stages hand on the whole
    tokens = boundary[0] // model.config.hidden_size if boundary[0] else 0
    rerun = frozenset(n for n, (block, t) in row_done.items() if last_save.get(block, 0) > t)
    reruns = tuple(replace(c, rerun=block is not None and last_save.get(block, 0) > t) for c, block, t in sequence)
    rings = tuple(replace(c, rerun=block is not None and last_save.get(block, 0) > t) for c, block, t in ring)
    moes = tuple(replace(c, rerun=block is not None and last_save.get(block, 0) > t,
                         gather_rerun=block is not None and last_save.get(block, 0) > g) for c, block, t, g in experts)
    return Trace(io={k: ModuleIO(*v) for k, v in io.items()}, boundary_numel=boundary[0],
                 kept={k: (v[0], v[1]) for k, v in kept.items()}, logits_rows=rows, tokens=tokens, rerun=rerun,
                 sequence=reruns, ring=rings, experts=moes, repeated_inputs=frozenset(repeated))


def _split_across_tp(name: str, styles: dict[str, Style], plan: TpPlan, *, region: bool | None,
                     whole: frozenset[str]) -> bool:
    """Whether what ``name`` allocates is sharded under tp: a column layer's output and anything
    computed inside a tp entry or region (attention heads, the MLP's activation, a whole-kept module
    there such as Qwen3's per-head norms, which see this rank's heads) are; a row layer's
    all-reduced output, replicated regions inside an entry (GPT-2's residual dropout), norms,
    residuals, embeddings and, under ep, the ``whole`` regions holding experts are not. With
    sequence parallelism, or inside the ep stand-in (``region`` not None), the trace's tensors
    already have one rank's size outside the tp regions, and inside one hold every head."""
    def under(root: str) -> bool:
        return name == root or name.startswith(root + ".")

    style = styles.get(name)
    if style is not None and style not in WHOLE_STYLES:  # replicate: as where it sits
        return style in COLUMN_STYLES or style == Style.VOCAB_COLWISE
    if region is not None:
        return region
    if any(under(r) for r in plan.shared_rng_regions):
        return False
    return any(under(r) for r in plan.tp_entries + plan.tp_rng_regions if r not in whole)
