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
the trace runs the model as one tp rank does, its collectives stood in for
(``tensor_parallel/sequence_costs.py``); with context parallelism on one cp rank's tokens, ring attention stood in
for (``context_parallel/costs.py``); with expert parallelism one rank's token dispatch stood in for
(``expert_parallel/costs.py``): each dimension's stand-ins live in its own folder.

The forward is recorded for every module (``record_microbatch`` -> ``Recording``) and read under a
tp plan afterwards (``Recording.trace``): which bytes are split over tp is the plan's to say, so
one forward serves every tp whose plan changes no stand-in (no sequence parallelism, ep=1).
"""

from __future__ import annotations

import contextlib
import functools
import gc
from collections import defaultdict
from dataclasses import dataclass, field, replace

import torch
from torch import nn
from torch.multiprocessing.reductions import StorageWeakRef
from transformers.cache_utils import Cache
from transformers.modeling_layers import GradientCheckpointingLayer
from transformers.pytorch_utils import Conv1D

from ..checkpoint.layout import meta_model
from ..context_parallel.costs import RingCall, RingStandIn
from ..data_parallel.precision import apply_mixed_precision
from ..expert_parallel.apply import experts_modules, sharded_experts
from ..expert_parallel.costs import ExpertCall, ExpertsStandIn, moe_regions
from ..memory.recompute import checkpoint_options
from ..policies.styles import COLUMN_STYLES, WHOLE_STYLES, Style
from ..policies.task import main_input_name
from ..policies.tp_plan import TpPlan
from ..tensor_parallel.sequence_costs import SeqCollective, SequenceStandIns, StageEdges
from ..tensor_parallel.sequence_parallel import regathers
from .allocations import Allocations, tensors
from .kernels import TrainingKernels
from .offloaded import OffloadNotes, per_rank


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
    # what offload="activations" moves (the blocks' checkpointed inputs), one tp rank's: block saving them ->
    # (bytes the host holds, bytes the device lets go: offloaded.py)
    offloaded: dict[str, tuple[float, float]]
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
    # module -> (ops of the forward there that wrote memory (views do not count), bytes those other than
    # matmuls and attention wrote whole on every tp rank, and split across tp): cost.py's op terms
    ops: dict[str, tuple[int, int, int]] = field(default_factory=dict)


def example_inputs(model: nn.Module, *, micro_batch_size: int, seq_len: int) -> dict[str, torch.Tensor]:
    """Meta tensors shaped like one microbatch of the model's main input."""
    config = model.config
    if main_input_name(model) == "pixel_values":
        size = config.image_size
        return {"pixel_values": torch.empty(micro_batch_size, config.num_channels, size, size, device="meta")}
    inputs = {"input_ids": torch.empty(micro_batch_size, seq_len, dtype=torch.long, device="meta")}
    if getattr(config, "is_encoder_decoder", False):
        # the decoder's tokens as the step makes them from labels: as many as the encoder's, for one cost
        inputs["decoder_input_ids"] = torch.empty(micro_batch_size, seq_len, dtype=torch.long, device="meta")
    return inputs


def _checkpoint_blocks(model: nn.Module, *, layers: str, recompute: str | None, notes: OffloadNotes) -> list[nn.Module]:
    """Turn on transformers' per-block checkpointing as ``apply_recompute`` does (no random streams: nothing on
    ``meta`` is random), what offload would move noted in ``notes``; the blocks set."""
    blocks = [(f"{layers}.{i}", b) for i, b in enumerate(model.get_submodule(layers) if recompute else ())
              if isinstance(b, GradientCheckpointingLayer)]
    for name, block in blocks:
        block.gradient_checkpointing = True
        block._gradient_checkpointing_func = functools.partial(notes.checkpointed, block=name,
                                                               options=checkpoint_options(recompute))
    return [b for _, b in blocks]


@contextlib.contextmanager
def _older_objects_frozen():
    """While inside, collections (the forward's own and the trace's ``gc.collect``) look at the
    objects made inside only: every older one (torch's, transformers', the meta models': about a
    million) is frozen, which makes a trace several times faster. What the forward made is freed
    the same: an older object holding it is one that was alive at the time, so it is the model or
    the trace's own state, which a collection would not free either. A freeze someone else made
    is left as it is."""
    if gc.get_freeze_count():
        yield
        return
    gc.freeze()
    try:
        yield
    finally:
        gc.unfreeze()


@dataclass(frozen=True)
class Recording:
    """One microbatch's forward as recorded, before a tp plan says what of it is split: what
    ``Trace`` holds, for every module rather than the plan's, so that one forward serves every plan
    whose stand-ins do not change it (any tp, without sequence parallelism and at ep=1)."""

    io: dict[str, ModuleIO]  # every module called with a tensor
    alive: dict[tuple[str, bool | None], int]  # (owner module, split by a stand-in) -> bytes kept
    offloaded: dict[tuple[str, bool | None], tuple[int, int]]  # (block, split) -> offload's host and device bytes
    done: dict[str, tuple[str, int]]  # module inside a block -> (the block, when its output came)
    last_save: dict[str, int]  # block -> when it last saved a tensor for backward
    boundary_numel: int
    logits_rows: int
    tokens: int
    sequence: tuple[SeqCollective, ...]
    ring: tuple[RingCall, ...]
    experts: tuple[ExpertCall, ...]
    repeated_inputs: frozenset[str]
    linears: frozenset[str]  # the exact nn.Linear and Conv1D modules (zb_h1 can defer them)
    ops: dict[tuple[str, bool | None], tuple[int, int]] = field(default_factory=dict)  # owner -> (ops, bytes)

    def trace(self, plan: TpPlan, *, whole: frozenset[str] = frozenset()) -> Trace:
        """The trace under ``plan`` (``whole``: under ep, the regions holding experts, kept whole)."""
        styles = dict(plan.rules)
        watched = set(styles) | set(plan.tp_entries) | self.linears
        rowwise = {name for name, style in styles.items() if style == Style.ROWWISE}
        kept: dict[str, list[int]] = defaultdict(lambda: [0, 0])
        roots = _Roots(shared=frozenset(plan.shared_rng_regions),
                       split=frozenset(r for r in plan.tp_entries + plan.tp_rng_regions if r not in whole))
        for (owner, region), nbytes in self.alive.items():
            kept[owner][1 if _split_across_tp(owner, styles, roots, region=region) else 0] += nbytes
        rerun = frozenset(n for n, (block, t) in self.done.items()
                          if n in rowwise and self.last_save.get(block, 0) > t)
        ops: dict[str, list[int]] = defaultdict(lambda: [0, 0, 0])
        for (owner, region), (count, nbytes) in self.ops.items():
            ops[owner][0] += count
            ops[owner][2 if _split_across_tp(owner, styles, roots, region=region) else 1] += nbytes
        return Trace(io={k: v for k, v in self.io.items() if k in watched}, boundary_numel=self.boundary_numel,
                     kept={k: (v[0], v[1]) for k, v in kept.items()}, logits_rows=self.logits_rows,
                     offloaded=per_rank(self.offloaded, lambda block, region: _split_across_tp(
                         block, styles, roots, region=region), tp=plan.tp),
                     tokens=self.tokens, rerun=rerun, sequence=self.sequence, ring=self.ring,
                     experts=self.experts, repeated_inputs=self.repeated_inputs,
                     ops={k: (v[0], v[1], v[2]) for k, v in ops.items()})


def trace_microbatch(model: nn.Module, plan: TpPlan, *, layers: str, inputs: dict[str, torch.Tensor],
                     recompute: str | None = None, edges: StageEdges | None = None, cp: int = 1,
                     ep: int = 1) -> Trace:
    """Trace one microbatch through ``model`` (see ``record_microbatch``) under ``plan``."""
    recording = record_microbatch(model, plan, layers=layers, inputs=inputs, recompute=recompute, edges=edges,
                                  cp=cp, ep=ep)
    return recording.trace(plan, whole=moe_regions(model, plan) if ep > 1 else frozenset())


def record_microbatch(model: nn.Module, plan: TpPlan, *, layers: str, inputs: dict[str, torch.Tensor],
                      recompute: str | None = None, edges: StageEdges | None = None, cp: int = 1,
                      ep: int = 1, gather: bool = False) -> Recording:
    """Run one microbatch through ``model`` (in training mode, its blocks checkpointed for the
    forward when ``recompute`` is set; the model is left as it was). ``edges``: the stage cut of a
    sequence-parallel ``plan``, where each stage splits and gathers the sequence. ``cp`` > 1:
    ``inputs`` are one cp rank's (``context.cp_inputs``) and attention is ring attention's stand-in.
    ``ep`` > 1: the experts' dispatch is expert parallelism's stand-in (one rank's, over ``plan.tp``; the
    all-gather dispatch's with ``gather``).
    Only the stand-ins read ``plan`` (and its policy's forward arguments)."""
    # Exact nn.Linear and Conv1D are what zb_h1 can defer (``weight_grad.make_deferrable``): the
    # estimate sizes its stash from their inputs and outputs.
    linears = {n for n, m in model.named_modules() if type(m) in (nn.Linear, Conv1D)}
    seen_inputs: dict[str, list[StorageWeakRef]] = defaultdict(list)  # parent module -> its linears' inputs
    repeated: set[str] = set()
    io: dict[str, list[int]] = defaultdict(lambda: [0, 0, 0])
    stack: list[str] = []
    boundary = [0]
    handles = []
    block_names = {f"{layers}.{i}" for i in range(len(model.get_submodule(layers)))}
    # Order of events inside each block: saves and modules' outputs (of which the plan's row layers
    # make ``Trace.rerun``); only the order counts.
    tick = [0]
    last_save: dict[str, int] = {}
    done: dict[str, tuple[str, int]] = {}
    sequence: list[tuple[SeqCollective, str | None, int]] = []  # with the block it ran in, and when
    ring: list[tuple[RingCall, str | None, int]] = []
    experts: list[list] = []  # [call, block, tick of its all-to-alls, tick of its tp gather]

    def block_of(names: list[str]) -> str | None:
        return next((n for n in reversed(names) if n in block_names), None)

    def pre(name: str):
        def hook(module, args, kwargs):
            stack.append(name)
            first = args[0] if args else next((v for v in kwargs.values() if isinstance(v, torch.Tensor)), None)
            io[name][0] += 1
            if isinstance(first, torch.Tensor):
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
            if isinstance(out, torch.Tensor):
                io[name][2] += out.numel()
            if name in block_names and isinstance(out, torch.Tensor):
                boundary[0] = out.numel()
            if (block := block_of(stack)) is not None:
                tick[0] += 1
                done[name] = (block, tick[0])
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
    notes = OffloadNotes()
    blocks = _checkpoint_blocks(model, layers=layers, recompute=recompute, notes=notes)
    # Registered after the trace's hooks, so that the module running is on ``stack`` for them too.
    standins = None
    if edges is not None:  # regathering as parallelize sets it: without recomputation
        standins = SequenceStandIns(model, plan, edges, note=note, regather=regathers(recompute), on_save=pack)
    ring_standin = RingStandIn(model, cp=cp, note=note_ring) if cp > 1 else contextlib.nullcontext()
    # under sequence parallelism a tp rank routes its own slice: nothing is shared out over tp (dispatch.py)
    moe = (ExpertsStandIn(model, ep=ep, tp=1 if plan.sequence_parallel else plan.tp, note=note_experts, gather=gather)
           if experts_modules(model) else None)

    def split_now() -> bool | None:  # allocations are split over tp: None when the module's rule says
        return standins.region if standins else (False if moe is not None and moe.inside else None)

    # Owner: (module, split_now()); the ep stand-in's tensors already have one tp rank's size.
    allocations = Allocations(lambda: (stack[-1] if stack else "", split_now()))
    with _older_objects_frozen():
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
                try:
                    out = model(**inputs, **kwargs)
                except RuntimeError as e:
                    if "meta" not in str(e):
                        raise
                    # XLM asserts on lengths.max().item(): a value a traced tensor has none of
                    raise ValueError(f"the planner cannot trace {type(model).__name__}: its forward reads a "
                                     f"tensor's value ({str(e).splitlines()[0]}), which its meta tensors do not "
                                     "hold, so it cannot price it: parallelize at a mesh you choose and time "
                                     "its steps") from None
        finally:
            for h in handles:
                h.remove()
            for block in blocks:
                block.gradient_checkpointing = False
            model.train(was_training)
        logits = getattr(out, "logits", None)
        rows = logits.shape[:-1].numel() if logits is not None else 0
        # Keep the graph (what backward needs), drop the outputs themselves (logits nobody saved).
        graph = [t.grad_fn for t in tensors(out.to_tuple() if hasattr(out, "to_tuple") else out)]
        del out, logits
        gc.collect()  # an output caught in a reference cycle would stay alive and count
        alive, offloaded = dict(allocations.alive()), notes.by_block(allocations)
    del graph
    if standins is not None:
        standins.release()
        boundary[0] = standins.whole_numel  # blocks' outputs are slices; the stages hand on the whole
    tokens = boundary[0] // model.config.hidden_size if boundary[0] else 0
    reruns = tuple(replace(c, rerun=block is not None and last_save.get(block, 0) > t) for c, block, t in sequence)
    rings = tuple(replace(c, rerun=block is not None and last_save.get(block, 0) > t) for c, block, t in ring)
    moes = tuple(replace(c, rerun=block is not None and last_save.get(block, 0) > t,
                         gather_rerun=block is not None and last_save.get(block, 0) > g) for c, block, t, g in experts)
    return Recording(io={k: ModuleIO(*v) for k, v in io.items()}, alive=alive, offloaded=offloaded, done=done,
                     last_save=last_save,
                     boundary_numel=boundary[0], logits_rows=rows, tokens=tokens, sequence=reruns, ring=rings,
                     experts=moes, repeated_inputs=frozenset(repeated), linears=frozenset(linears),
                     ops={k: (v[0], v[1]) for k, v in allocations.ops.items()})


@dataclass(frozen=True)
class _Roots:
    """A plan's regions by what they say of the bytes allocated under them: replicated (``shared``: a
    tp rng region kept whole) or split over tp (``split``: its entries and rng regions, less the ep
    regions kept whole)."""

    shared: frozenset[str]
    split: frozenset[str]


def _split_across_tp(name: str, styles: dict[str, Style], roots: _Roots, *, region: bool | None) -> bool:
    """Whether what ``name`` allocates is sharded under tp: a column layer's output and anything
    computed inside a tp entry or region (attention heads, the MLP's activation, a whole-kept module
    there such as Qwen3's per-head norms, which see this rank's heads) are; a row layer's
    all-reduced output, replicated regions inside an entry (GPT-2's residual dropout), norms,
    residuals, embeddings and, under ep, the regions holding experts are not. With
    sequence parallelism, or inside the ep stand-in (``region`` not None), the trace's tensors
    already have one rank's size outside the tp regions, and inside one hold every head."""
    style = styles.get(name)
    if style is not None and style not in WHOLE_STYLES:  # replicate: as where it sits
        return style in COLUMN_STYLES or style == Style.VOCAB_COLWISE
    if region is not None:
        return region
    # the regions ``name`` is under: itself and each module above it (by dotted prefix)
    parts = name.split(".")
    above = {".".join(parts[:i]) for i in range(1, len(parts) + 1)}
    if above & roots.shared:
        return False
    return bool(above & roots.split)


def recording_model(config, *, cls: type | None, dtype: torch.dtype, precision: torch.dtype | None,
                    loaded_experts: bool) -> nn.Module:
    """A meta model to record forwards on in the compute dtype: ``config``'s, loaded in ``dtype``, cast
    as ``parallelize``'s mixed ``precision`` casts it, its routed experts kept in ``dtype`` where
    ``loaded_experts`` (what FSDP leaves alone is not cast: sharded.py, so they compute in it)."""
    model = meta_model(config, cls=cls).to(dtype)
    if precision is not None:
        apply_mixed_precision(model, precision)
    for experts in sharded_experts(model).values() if loaded_experts else ():
        experts.to(dtype)
    return model
