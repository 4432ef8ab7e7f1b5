"""Context parallelism: the sequence split over cp ranks, attention through transformers' interface.

``train_step`` takes this dp rank's whole sequences, as at cp=1. Each microbatch is cut along the
sequence (``shard_microbatch``): rank ``r`` of the cp group keeps the tokens of its two pieces
(``ring_attention.PieceLayout``), their global ``position_ids`` (RoPE and learned positions see the
true positions) and their targets, shifted on the whole sequence first (a piece's last token
predicts the first token of the next piece, which another rank holds). Every module but attention
acts token by token, so the model's own forward runs unchanged on the slice.

Attention goes through transformers' attention interface: ``apply_context_parallel`` registers a
ring-attention function under a name of this model's own and selects it with
``set_attn_implementation``, so no forward is replaced. What the function needs about the whole
sequence travels as the ``attention_mask``: a prepared 4-D tensor ``[b, 1, 2, sequence]`` of
(document index, may be attended to) per token, which transformers passes through to the attention
function untouched (a 4-D mask is taken as already built). When no sequence of the batch packs
several documents or has padding, the tensor is ``[b, 1, 1, sequence]`` instead and the ring builds
no masks: its size, not its values, tells every layer's attention call, so none of them reads device
data. Whether that is so, and each token's document, are decided once per step from the batch as
the caller hands it over (``ring_documents``), before it moves to the device: a batch on the host
costs the device nothing, one already on the device a single read per step (not one per microbatch
or layer). Documents follow transformers' own rule: without an attention mask, a ``position_ids``
step other than +1 starts a new packed sequence; with one, its zeros are padding.
"""

from __future__ import annotations

import contextlib
import itertools
import math
from collections.abc import Iterator, Mapping

import torch
from torch import nn
from torch.distributed import ProcessGroup
from transformers import AttentionInterface
from transformers.masking_utils import find_packed_sequence_indices

from ..comm import all_gather_tensors
from ..compat import reduce_scatter_single
from ..config.options import LossKind
from ..devices import on_device
from ..policies.amendments import CP_REFUSALS
from ..policies.layer_fields import any_layer, layer_values
from ..policies.tp_plan import TpPlan
from .ring_attention import PieceLayout, needs_mask, ring_attention

# transformers' layer kinds (config.layer_types) whose attention the ring computes exactly: full
# causal, and causal within the sliding window the layer passes to the attention function.
RING_LAYER_TYPES = ("full_attention", "sliding_attention")
# Why cp does not apply to a model whose layer kinds say it mixes positions another way (the zoo
# table counts such types apart from refusals).
POSITION_MIXING = "mix positions outside attention or in chunks"
# Batch keys a context-parallel step knows how to cut along the sequence.
CP_KEYS = ("input_ids", "labels", "attention_mask", "position_ids")
# The key of a cp rank's microbatch that marks its real tokens [rows, tokens]: read by the router
# loss, never given to the model.
LOCAL_VALID = "local_valid"
# Keys of a (cp rank's) microbatch that feed the loss, not the model.
LOSS_KEYS = ("labels", "targets", LOCAL_VALID)
_names = itertools.count()


def masks_reason(model: nn.Module) -> str | None:
    """Why this model's attention masks may be other than ring attention's (causal, within the sliding
    window a layer passes to the attention function, by document and padding), or None: the first of
    cp's refusals, and what ``host_masks.py`` relies on too."""
    if model.config.model_type in CP_REFUSALS:
        return CP_REFUSALS[model.config.model_type]
    config = model.config.get_text_config()
    # Ring attention covers attention, full or in a sliding window; a block that mixes positions any
    # other way (state-space or convolution layers of hybrid models) would see only this rank's tokens.
    # Chunked attention (softmax within fixed blocks of positions, which the ring does not compute)
    # is checked first: it is the reason cp cannot apply, whatever else the model's attention lacks
    chunked = sorted({v for v in layer_values(config, "attention_chunk_size") if v})  # per layer where it may vary
    if chunked:
        return f"attention_chunk_size={chunked[0]} (chunked attention) is not supported by ring attention"
    kinds = sorted(set(getattr(config, "layer_types", None) or ()) - set(RING_LAYER_TYPES))
    if kinds:
        return f"layers of kind {kinds} (config.layer_types) {POSITION_MIXING}; ring attention covers {RING_LAYER_TYPES}"
    if not getattr(type(model), "_supports_attention_backend", False):
        return (f"{type(model).__name__} does not run its attention through transformers' attention "
                f"interface, so qn_hf cannot put ring attention in")
    return None


def non_causal_attention(module_name: str, module: nn.Module) -> str | None:
    """Why ``module`` is an attention ring attention does not compute (it is not causal), or None."""
    if hasattr(module, "is_causal") and hasattr(module, "scaling") and not module.is_causal:
        return f"{module_name} is not causal; ring attention here is causal only"
    return None


def check_context_parallel(model: nn.Module, *, cp: int, plan: TpPlan) -> None:
    """Refuse (before any communication) what ring attention cannot compute exactly."""
    if cp == 1:
        return
    name = f"cp={cp} ({model.config.model_type})"
    reason = masks_reason(model)
    if reason is not None:
        raise ValueError(f"{name}: {reason}; use cp=1")
    config = model.config.get_text_config()
    if plan.loss is not LossKind.CAUSAL_LM:
        raise ValueError(f"{name}: context parallelism needs a causal LM with its built-in loss (the loss counts targets "
                         f"across the cp ranks); use cp=1")
    for key in ("attention_dropout", "attn_pdrop"):
        dropouts = [v for v in layer_values(config, key, 0.0) if v]
        if dropouts:
            raise ValueError(f"{name}: {key}={max(dropouts)}: ring attention has no attention "
                             f"dropout; set config.{key} = 0.0 or use cp=1")
    if any_layer(config, "attn_temperature_tuning", False) and not all(getattr(config, "no_rope_layers", None) or [1]):
        # Llama 4: the layers without RoPE scale their queries by a function of the position that the
        # attention computes as arange(length of its input), the local pieces' length under cp: wrong
        # from position floor_scale on, so no short test would show it
        raise ValueError(f"{name}: attn_temperature_tuning=True scales the queries of the layers without RoPE by "
                         f"positions the attention counts itself over the tokens it holds, which under cp are "
                         f"not the sequence's; set config.attn_temperature_tuning = False or use cp=1")
    for module_name, module in model.named_modules():
        if isinstance(module, (nn.Conv1d, nn.Conv2d)):
            raise ValueError(f"{name}: {module_name} ({type(module).__name__}) may mix positions outside attention; use cp=1")
        reason = non_causal_attention(module_name, module)
        if reason is not None:
            raise ValueError(f"{name}: {reason}; use cp=1")


class AttentionSwitch:
    """An attention implementation of qn_hf's (``name``: ring attention under cp, host-decided masks at
    cp=1, ``host_masks.py``) on (training, evaluation, logits) or off (``generate``). Every cp rank holds
    the whole model (cp splits sequences, not weights), so with the switch off each cp rank runs the
    model's own attention implementation (``previous``) on whole sequences, as the tp ranks of a
    replica each run the generation loop: a decoding step's one token cannot be split into 2*cp
    pieces."""

    def __init__(self, model: nn.Module, *, name: str, previous: str) -> None:
        self.model, self.name, self.previous = model, name, previous
        self.on = True

    @contextlib.contextmanager
    def off(self) -> Iterator[None]:
        self.on = False
        self.model.set_attn_implementation(self.previous)
        try:
            yield
        finally:
            self.on = True
            self.model.set_attn_implementation(self.name)


def apply_context_parallel(model: nn.Module, *, group: ProcessGroup, layout: PieceLayout) -> AttentionSwitch:
    """Register ring attention over ``group`` for this model and select it; return its switch."""

    def attention(module: nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                  attention_mask: torch.Tensor | None, scaling: float | None = None, dropout: float = 0.0,
                  sliding_window: int | None = None, **kwargs):
        if attention_mask is None or attention_mask.dim() != 4 or attention_mask.shape[2] not in (1, 2):
            raise ValueError("cp > 1: the model was called without qn_hf's context-parallel batch; use "
                             "pm.train_step or pm.eval_step")
        if dropout:
            raise ValueError(f"cp > 1: attention dropout {dropout} is not supported by ring attention")
        masked = attention_mask.shape[2] == 2  # (documents, valid); else one document, nothing padded
        valid = attention_mask[:, 0, -1]
        # the layer's own window (transformers passes None on full-attention layers), Gemma 2's logit
        # softcapping and gpt-oss's attention sinks (``s_aux``), all computed by the ring exactly
        out = ring_attention(query, key, value, documents=attention_mask[:, 0, 0] if masked else torch.zeros_like(valid),
                             valid=valid, layout=layout, group=group, masked=masked,
                             scaling=scaling or 1.0 / math.sqrt(query.shape[-1]), window=sliding_window,
                             softcap=kwargs.get("softcap"), sinks=kwargs.get("s_aux"))
        return out.transpose(1, 2).contiguous(), None

    # transformers' registry is global; the name is this model's own, so models never share state
    name = f"qn_hf_ring_{next(_names)}"
    previous = model.config._attn_implementation
    # eager inside a compiled block (a graph break either side): the ring's point-to-point transfers and
    # its online softmax over the received blocks run as in eager mode, the block's other code compiled
    AttentionInterface.register(name, torch.compiler.disable(attention))
    model.set_attn_implementation(name)
    return AttentionSwitch(model, name=name, previous=previous)


def documents_of(batch: Mapping[str, torch.Tensor]) -> torch.Tensor:
    """Each token's document, by transformers' own rule and function (packed sequences are looked for
    only without an attention mask)."""
    ids = batch["input_ids"]
    positions = batch.get("position_ids")
    packed = None if positions is None or "attention_mask" in batch else find_packed_sequence_indices(positions.expand_as(ids))
    return torch.zeros_like(ids) if packed is None else packed.long()


def ring_documents(batch: Mapping[str, torch.Tensor]) -> torch.Tensor | None:
    """Each token's document [rows, sequence] when any sequence of ``batch`` packs several documents
    or has padding (ring attention then masks), else None; read where the batch is (see the module
    docstring: call it before the batch moves to the device)."""
    documents = documents_of(batch)
    valid = batch.get("attention_mask", torch.ones_like(batch["input_ids"])).long()
    return documents if needs_mask(documents=documents, valid=valid) else None


def shard_microbatches(micro: list[Mapping[str, torch.Tensor]], documents: torch.Tensor | None, *, layout: PieceLayout,
                       rank: int) -> list[dict[str, torch.Tensor]]:
    """``shard_microbatch`` of each microbatch of a batch (``micro``: its ``split_microbatches`` on the
    device), with the batch's ``ring_documents`` moved there and cut alike."""
    if documents is None:
        parts = [None] * len(micro)
    else:
        parts = torch.tensor_split(on_device(documents, micro[0]["input_ids"].device), len(micro))
    return [shard_microbatch(m, layout=layout, rank=rank, documents=d) for m, d in zip(micro, parts)]


def shard_microbatch(micro: Mapping[str, torch.Tensor], *, layout: PieceLayout, rank: int,
                     documents: torch.Tensor | None) -> dict[str, torch.Tensor]:
    """This cp rank's model inputs, its ``targets`` (already shifted; from the input ids when the batch
    has no labels, for a ``loss_fn`` or logits, which do not read them) and which of its tokens are real
    (``LOCAL_VALID``: the attention mask becomes ring attention's layout) from a microbatch of whole
    sequences. ``documents``: the microbatch's rows of ``ring_documents`` (None: nothing to mask)."""
    ids = micro["input_ids"]
    length, device = ids.shape[1], ids.device
    keep = layout.positions(rank, length, device=device)  # built on the device: no copy from the host
    positions = micro.get("position_ids")
    positions = torch.arange(length, device=device).expand_as(ids) if positions is None else positions.expand_as(ids)
    valid = micro.get("attention_mask", torch.ones_like(ids)).long()
    meta = (valid[:, None] if documents is None else torch.stack([documents, valid], dim=1)).unsqueeze(1)  # [b, 1, 1|2, seq]
    return {"input_ids": ids[:, keep], "position_ids": positions[:, keep], "attention_mask": meta,
            "targets": LossKind.CAUSAL_LM.targets(micro.get("labels", ids))[:, keep], LOCAL_VALID: valid[:, keep]}


def gather_sequence_positions(x: torch.Tensor, *, layout: PieceLayout, group: ProcessGroup) -> torch.Tensor:
    """The whole sequence (dim 1, in order) from every cp rank's ``x`` of its ``layout`` pieces: one
    all-gather, then each rank's tokens put back at their positions (no autograd)."""
    size = layout.size
    parts = all_gather_tensors(x.contiguous(), group=group)
    length = x.shape[1] * size
    whole = x.new_empty((x.shape[0], length, *x.shape[2:]))
    for rank, part in enumerate(parts):
        whole[:, layout.positions(rank, length, device=x.device)] = part
    return whole


class _GatherPositions(torch.autograd.Function):
    """``gather_sequence_positions`` with a backward: every cp rank computes the same function of the
    whole sequences, so the gradient of this rank's positions is the sum of every rank's gradient
    there, one reduce-scatter of the whole gradient (laid out rank by rank)."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, layout: PieceLayout, group: ProcessGroup) -> torch.Tensor:
        ctx.layout, ctx.group = layout, group
        return gather_sequence_positions(x, layout=layout, group=group)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        length = grad.shape[1]
        parts = [grad[:, ctx.layout.positions(r, length, device=grad.device)] for r in range(ctx.layout.size)]
        out = torch.empty_like(parts[0])
        reduce_scatter_single(out, torch.cat(parts), group=ctx.group)
        return out, None, None


def whole_sequence_logits(outputs, *, layout: PieceLayout, group: ProcessGroup):
    """``outputs`` with the logits of whole sequences (in order) on every cp rank, for a ``loss_fn``:
    it then computes on every cp rank the loss it computes without cp, each rank taking 1/cp of it
    (the caller's division), and backward hands each rank the gradient of its own positions. Every
    rank holds the whole ``[rows, sequence, vocabulary]`` logits for the loss: the memory cp saves
    elsewhere is spent once here, which a per-token loss (the built-in one) does not need."""
    outputs.logits = _GatherPositions.apply(outputs.logits, layout, group)
    return outputs
