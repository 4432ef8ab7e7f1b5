"""A step's loss, in one home: each microbatch's share of the global mean (the head's own loss, or a
``loss_fn``'s), what the mean is over, its sums over the mesh, and the gradients' buckets started as their
last backward ends. ``ParallelModel.train_step``, ``eval_step`` and ``count_items`` call it.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass

import torch

from ..comm import flat_all_reduce_
from ..config.options import LossKind, ProblemType
from ..context_parallel.apply import LOCAL_VALID, whole_sequence_logits
from ..data_parallel.grad_sync import GradSync
from ..data_parallel.precision import LossScaler
from ..expert_parallel.router_loss import RouterLogits, adds_router_loss
from ..pipeline.split import params_by_final_pass
from ..tensor_parallel.sequence_hooks import SequenceParallelSwitch
from .batch import batch_signature, check_same_batch
from .loss import local_count, loss_scales, nan_without_targets, problem_type, scaled, summed_loss, term_weights
from .runner import StepContext, forward_inputs, prepare, run_schedule, trusted

LossFn = Callable[[object, Mapping[str, torch.Tensor]], torch.Tensor]


@dataclass(frozen=True)
class LocalLoss:
    """A step's loss before its sums over the mesh: this rank's share, and what it is a mean over."""

    total: torch.Tensor
    count: torch.Tensor
    builtin: bool


class StepLoss:
    """The loss of a ``ParallelModel``'s steps over ``context``: ``grads`` start as their parameters' last backward
    ends, fp16's ``scaler`` scales what backward starts from, and under sequence parallelism (``sp_switch`` on)
    the router's term sums its statistics over the tp ranks' slices."""

    def __init__(self, context: StepContext, *, grads: GradSync, scaler: LossScaler | None,
                 deferred: frozenset[str], sp_switch: SequenceParallelSwitch | None) -> None:
        self.context, self.grads, self.scaler, self.sp_switch = context, grads, scaler, sp_switch
        # the dtype the step's loss is summed and reported in: float32, or float64 for a float64 model's (float32
        # rounds it)
        self.dtype = torch.promote_types(next((p.dtype for p in context.module.parameters() if p.is_floating_point()),
                                              torch.float32), torch.float32)
        # (chunk, Op.BWD | Op.WGT) -> the parameters final after its last backward or W pass: their buckets may start
        self.final_params = params_by_final_pass(context.module, context.stage.plan, chunks=context.stage.chunks,
                                                 deferred=deferred)
        self.batch_checked = False  # the first step checks every replica's batch contents on the device

    def run(self, batch: Mapping[str, torch.Tensor], loss_fn: LossFn | None, *, backward: bool, sync: bool,
            check_every_batch: bool, agree_contents: bool, num_items: torch.Tensor | float | None = None,
            loss_keys: Sequence[str] = ()) -> LocalLoss:
        """Every microbatch through the schedule, backward too with ``backward`` (the buckets armed with ``sync``):
        this rank's share of the loss. ``check_every_batch``: the device check of the replicas' batches every
        step, not only the first; ``agree_contents``: the hosts agree on the batch's contents, not shapes only."""
        ctx = self.context
        plan, dims, groups, device = ctx.plan, ctx.placement.dims, ctx.placement.groups, ctx.placement.device
        builtin, cp = loss_fn is None, dims.cp
        kind = plan.loss if builtin else None  # the head's loss (policies/task.py), or a loss_fn's rows
        prepared = prepare(ctx, batch, loss=plan.loss, builtin=builtin, num_items=num_items, loss_keys=loss_keys,
                           contents=agree_contents)
        routers = (RouterLogits(ctx.module, pp=dims.pp, microbatches=ctx.config.microbatches, replicas=groups.replicas,
                                sequence=groups.tp if self.sp_switch is not None and self.sp_switch.on else None)
                   if builtin and adds_router_loss(ctx.module) else None)  # checks the term can be equal
        if dims.world_size > dims.dp and (check_every_batch or not self.batch_checked):
            check_same_batch(batch_signature(prepared.batch, device=device), replica=ctx.placement.coords.dp,
                             replicas=dims.dp)
            self.batch_checked = True
        problem = self.problem(prepared.batch) if kind is LossKind.CLASSIFICATION else None
        # What the loss is a mean over (one count per term), summed over dp (one tiny all-reduce) unless
        # the caller gave the accumulation's count; each microbatch's share of it (loss.loss_scales)
        if num_items is None:
            count = self.count([prepared.batch], kind=kind, problem=problem)
        else:
            count = torch.as_tensor(num_items, dtype=torch.float64).to(device, non_blocking=True).reshape(-1)
        scales = loss_scales(count, rows=prepared.rows, builtin=builtin, weights=term_weights(kind))
        micro, whole = prepared.micro, prepared.whole  # a loss_fn sees whole sequences (whole_sequence_logits)
        total = torch.zeros((), dtype=self.dtype, device=device)

        def forward(chunk: int, mb: int, received: torch.Tensor | None) -> torch.Tensor:
            """One microbatch through one of this stage's chunks: the activation to send, or on the
            last chunk the microbatch's share of the global loss (what backward starts from)."""
            nonlocal total
            last = ctx.stage.is_last_chunk(chunk)
            inputs = forward_inputs(ctx, prepared, mb, builtin=builtin, last=last, dropped=loss_keys)
            chunked = ctx.loss_chunks if last and builtin else None  # the loss a chunk at a time (loss_chunks.py)
            with (routers or contextlib.nullcontext(), trusted(ctx, prepared),  # router_loss.py, host_masks.py
                  chunked.recording() if chunked else contextlib.nullcontext() as recorded):
                outputs = ctx.stage.forward(inputs, received, chunk=chunk, **plan.policy.forward_kwargs,
                                            **(routers.forward_kwargs if routers else {}))
            if not last:
                return outputs
            if builtin:
                sums = (chunked.summed(recorded, outputs, micro[mb], head=plan.head, vocab=ctx.vocab, group=groups.tp)
                        if chunked else
                        summed_loss(outputs, micro[mb], kind=kind, head=plan.head, problem=problem, group=groups.tp,
                                    vocab=ctx.vocab))
                loss = scaled(sums, scales[mb]).sum()
            else:
                # the same loss of the whole sequences on every cp rank, 1/cp of it each (context_parallel/apply.py)
                if cp > 1:
                    loss = loss_fn(whole_sequence_logits(self._with_full_logits(outputs), layout=ctx.cp_layout,
                                                         group=groups.cp), whole[mb]) / cp
                else:
                    loss = loss_fn(self._with_full_logits(outputs), micro[mb])
                loss = scaled(loss, scales[mb][0])
            if routers:  # transformers' load-balancing term, this rank's share (router_loss.py)
                loss = loss + routers.loss(micro[mb].get(LOCAL_VALID, micro[mb].get("attention_mask")))
            total += loss.detach().to(total.dtype)
            # float16: backward starts from the scaled loss (GradSync unscales the gradients)
            return loss * self.scaler.scale if self.scaler is not None and backward else loss

        if backward:
            self.grads.disarm()
        arm = (lambda chunk, kind: self.grads.arm(self.final_params.get((chunk, kind), []))) \
            if backward and sync else None
        run_schedule(ctx, prepared, forward, backward=backward, on_final=arm)
        return LocalLoss(total=total, count=count, builtin=builtin)

    def reduced(self, local: LocalLoss) -> torch.Tensor:
        """The step's loss on every rank: the last stage holds it, so a sum over pp hands it to every
        stage, then over dp and cp (each cp rank holds the loss of its own tokens)."""
        groups = self.context.placement.groups
        for group in (groups.pp, groups.replicas):
            flat_all_reduce_([local.total], group=group)
        # the plain model's mean over no target is NaN (DeBERTa's own rules give 0 there)
        if local.builtin and not self.context.plan.head.own_problem_types:
            return nan_without_targets(local.total, local.count)
        return local.total

    def count_items(self, batches: Sequence[Mapping[str, torch.Tensor]], loss_fn: LossFn | None) -> torch.Tensor:
        """What one step on all of ``batches`` would average its loss over, summed over dp (``count``)."""
        kind = self.context.plan.loss if loss_fn is None else None
        problem = self.problem(batches[0]) if kind is LossKind.CLASSIFICATION and batches else None
        return self.count(batches, kind=kind, problem=problem)

    def problem(self, batch: Mapping[str, torch.Tensor]) -> ProblemType:
        """A classifier's problem type for this batch, decided as transformers' forward decides it, and
        recorded in the config as that forward records it (a saved config then says it too)."""
        config = self.context.stage.config
        head = self.context.plan.head
        problem = problem_type(config, batch["labels"], problem_types=head.problem_types, own=head.own_problem_types)
        if head.problem_types and not head.own_problem_types and getattr(config, "problem_type", None) is None:
            config.problem_type = problem.value
        return problem

    def count(self, batches: Sequence[Mapping[str, torch.Tensor]], *, kind: LossKind | None,
              problem: ProblemType | None) -> torch.Tensor:
        """What ``batches`` hold on this dp rank to average the loss over (one count per term of ``kind``'s
        loss; rows for a ``loss_fn``, ``kind=None``), summed over dp: a ``[K]`` device tensor."""
        placement = self.context.placement
        count = sum(local_count(b, kind=kind, head=self.context.plan.head, problem=problem, device=placement.device)
                    for b in batches)
        if kind is not LossKind.OWN:  # the model's own loss is its one forward's mean: nothing to sum
            flat_all_reduce_([count], group=placement.groups.dp)
        return count

    def _with_full_logits(self, outputs):
        if self.context.vocab is not None and getattr(outputs, "logits", None) is not None:
            outputs.logits = self.context.full_logits(outputs.logits)
        return outputs
