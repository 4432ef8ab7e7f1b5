"""The one step runner: ``train_step``, ``eval_step`` and ``logits`` all go through ``prepare`` and
``run_schedule`` over a ``StepContext``, the small frozen value of what a step reads of a parallel
model (fixed by ``parallelize``).

``prepare`` is every step's prologue, in the order its collectives must come on every rank: the
batch's checks, agreed over the host group before anything else communicates (``agreement.py``);
the packed documents read on the host (context parallelism); the batch on the device without a host
wait; the microbatches (whole sequences); and under cp this rank's pieces of them. ``run_schedule``
runs this stage's actions of the schedule, calling the step's own ``forward`` for each microbatch and
chunk: what the steps differ in (a loss and its scale, a router term, or logits kept) stays theirs.
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass

import torch
from torch import nn

from ..comm import gather_from_group
from ..config.options import LossKind
from ..config.parallel_config import ParallelConfig
from ..context_parallel.apply import CP_KEYS, LOSS_KEYS, ring_documents, shard_microbatches
from ..context_parallel.host_masks import HostMasks, masks_needed, step_masks
from ..context_parallel.ring_attention import PieceLayout
from ..devices import to_device
from ..expert_parallel.dispatch import SAME_SHAPES, GatherSwitch
from ..memory.offload import ActivationOffload
from ..pipeline.runtime import StageExecutor, batch_shape_key
from ..pipeline.schedule import Op, schedule_actions
from ..pipeline.stage import StageModules
from ..placement import ShardPlacement
from ..policies.task import loss_arguments
from ..policies.tp_plan import TpPlan
from ..tensor_parallel.apply import VocabShard
from .agreement import agree_on_batch
from .batch import check_step_batch, microbatch_rows, split_microbatches
from .loss_chunks import LossChunks
from .packed import row_layout

# (chunk, microbatch, the activation received or None) -> the activation to send, or on the last chunk
# what backward starts from (a loss; a zero for forward-only passes)
Forward = Callable[[int, int, "torch.Tensor | None"], torch.Tensor]


@dataclass(frozen=True)
class StepContext:
    """What every step reads: the model, how it was parallelized, where this rank sits, its plan and
    stage, the executor of the schedule, the vocabulary shard and the cp layout of the sequences."""

    module: nn.Module
    config: ParallelConfig
    placement: ShardPlacement
    plan: TpPlan
    stage: StageModules
    executor: StageExecutor
    vocab: VocabShard | None
    cp_layout: PieceLayout  # which pieces of each sequence the cp ranks hold
    host_masks: HostMasks | None = None  # at cp=1, masks decided from the host batch (context_parallel/host_masks.py)
    # expert_dispatch="all_gather": on while the schedule runs, the step's batches agreed in shape (dispatch.py)
    gather_switch: GatherSwitch | None = None
    offload: ActivationOffload | None = None  # offload="activations": the blocks' saved inputs on the host

    @functools.cached_property
    def loss_chunks(self) -> LossChunks | None:
        """``loss_chunk_tokens``: the causal-LM loss a chunk of tokens at a time (loss_chunks.py), or None."""
        tokens = self.config.loss_chunk_tokens
        return None if tokens is None else LossChunks(self.stage.model, tokens=tokens)

    def full_logits(self, logits: torch.Tensor) -> torch.Tensor:
        """All vocabulary columns from vocab-sharded logits (autograd-aware; padding removed)."""
        if self.vocab is None:
            return logits
        return gather_from_group(logits, group=self.placement.groups.tp)[..., : self.vocab.size]


@dataclass(frozen=True)
class Prepared:
    """A checked batch, on the device and cut for the schedule."""

    batch: dict[str, torch.Tensor]  # this rank's batch on the device
    rows: list[int]  # each microbatch's rows (the sizes tensor_split gave them)
    whole: list[dict[str, torch.Tensor]]  # the microbatches with whole sequences (what a loss_fn sees)
    micro: list[dict[str, torch.Tensor]]  # what this rank computes on (under cp: its pieces of each sequence)
    # the attention mask each microbatch's model is given where the host batch pads nothing (host_masks.py), or None
    masks: list[torch.Tensor] | None = None


def prepare(ctx: StepContext, batch: Mapping[str, torch.Tensor], *, loss: LossKind | None, builtin: bool,
            num_items: torch.Tensor | float | None = None, loss_keys: Sequence[str] = (),
            contents: bool = True) -> Prepared:
    """Every step's prologue (module docstring); raises on every rank alike before any collective. ``contents``:
    the ranks of a replica agree on their batch's host contents too (agreement.py)."""
    if ctx.loss_chunks is not None and loss is not None:  # pm.logits computes no loss
        ctx.loss_chunks.check_builtin(builtin)
    dims, coords, groups = ctx.placement.dims, ctx.placement.coords, ctx.placement.groups
    microbatches = ctx.config.microbatches
    size = agree_on_batch(lambda: check_step_batch(
        batch, model=ctx.module, loss=loss, builtin=builtin, cp=dims.cp, cp_keys=CP_KEYS,
        split=ctx.config.sequence_split, microbatches=microbatches, config=ctx.stage.config, num_items=num_items,
        head=ctx.plan.head, dp=dims.dp, loss_keys=tuple(loss_keys), positions=ctx.plan.positions,
        decoder_stages=_decoder_stages(ctx.stage.plan), dp_shard=dims.dp_shard),
        batch, replica=coords.dp, replicas=dims.dp, group=groups.host, contents=contents,
        same_shapes=SAME_SHAPES if ctx.gather_switch else None)
    documents = ring_documents(batch) if dims.cp > 1 else None  # read on the host before the batch moves
    # the same read at cp=1 (host_masks.py), of what the model is given
    unread = ctx.host_masks is not None and not masks_needed(batch, dropped=loss_keys)
    layout = row_layout(batch, ctx.stage.config)  # checked above; read on the host before the batch moves
    on_device = to_device(batch, ctx.placement.device)
    whole = split_microbatches(on_device, microbatches=microbatches, layout=layout)
    micro = shard_microbatches(whole, documents, layout=ctx.cp_layout, rank=coords.cp) if dims.cp > 1 else whole
    return Prepared(batch=on_device, rows=microbatch_rows(size, microbatches=microbatches), whole=whole, micro=micro,
                    masks=step_masks(micro, dropped=loss_keys) if unread else None)


def _decoder_stages(plan) -> int:
    """How many chunks run an encoder-decoder pipeline's decoder (0 without one)."""
    return len(plan.layer_ranges) - plan.seq2seq.encoder_chunks if plan.seq2seq is not None else 0


def forward_inputs(ctx: StepContext, prepared: Prepared, mb: int, *, builtin: bool,
                   last: bool = True, dropped: Sequence[str] = ()) -> dict[str, object]:
    """What a chunk's forward is given of microbatch ``mb``: all but what only the loss reads (the head's
    label keys, cp's targets and valid marks); an encoder-decoder LM's decoder input made from the
    labels by the model's own method, as its forward would make it. The model's own loss
    (``LossKind.OWN``) is computed by the forward of the last chunk (``last``): it gets the labels
    there, and ``return_loss`` where the forward asks for it (a contrastive model's). ``dropped``: more keys
    only a ``loss_fn`` reads. The attention mask is the one decided on the host where there is one
    (``Prepared.masks``); the microbatch keeps its own for the loss."""
    head, micro = ctx.plan.head, prepared.micro[mb]
    own = builtin and ctx.plan.loss is LossKind.OWN and last
    dropped = {*LOSS_KEYS, *head.label_keys, *dropped} - ({"labels"} if own else set())
    inputs: dict[str, object] = {k: v for k, v in micro.items() if k not in dropped}
    if (head.decoder_from_labels and "labels" in micro and "decoder_input_ids" not in micro
            and "decoder_inputs_embeds" not in micro):
        ids = inputs["decoder_input_ids"] = ctx.module.prepare_decoder_input_ids_from_labels(labels=micro["labels"])
        if head.decoder_padding_mask and "decoder_attention_mask" not in micro:
            # as EncoderDecoderModel's forward masks the padding of what it makes (policies/task.py)
            inputs["decoder_attention_mask"] = (ids != ctx.module.config.pad_token_id).to(ids.dtype)
    if prepared.masks is not None:
        inputs["attention_mask"] = prepared.masks[mb]
    if own and "return_loss" in loss_arguments(ctx.module):
        inputs["return_loss"] = True
    return inputs


def run_schedule(ctx: StepContext, prepared: Prepared, forward: Forward, *, backward: bool,
                 on_final: Callable[[int, Op], None] | None = None) -> None:
    """This stage's actions of the schedule over ``prepared``'s microbatches. ``on_final(chunk, kind)``
    runs just before a chunk's last backward (``Op.BWD``) or weight pass (``Op.WGT``) of the step."""
    schedule = schedule_actions(stages=ctx.stage.stages, microbatches=ctx.config.microbatches,
                                schedule=ctx.config.schedule, virtual_stages=ctx.stage.plan.virtual,
                                backward=backward)
    # what fixes the activations' shapes between stages: the activation header is exchanged once per
    # such key (the first step of each batch shape), not every step
    if ctx.offload is not None:  # each microbatch's forward saves a chain of its own (offload.py)
        forward = ctx.offload.chained(forward)
    with ctx.gather_switch.within_step() if ctx.gather_switch else contextlib.nullcontext():
        ctx.executor.run(schedule, forward, rows=prepared.rows, on_final=on_final,
                         shape_key=batch_shape_key(prepared.micro[0], rows=prepared.rows))


def trusted(ctx: StepContext, prepared: Prepared) -> contextlib.AbstractContextManager:
    """Around each model forward of a step: transformers builds its masks without reading the padding mask
    where ``prepared``'s masks are known to hide nothing (host_masks.py); a loss or hook after it reads as usual."""
    return ctx.host_masks.trusting(prepared.masks is not None) if ctx.host_masks else contextlib.nullcontext()
