"""``pm.logits``: the model's whole logits (or a reduction of them) at any mesh, without a loss.

``pm.logits(batch)`` takes this dp rank's batch as ``train_step`` does (no labels needed) and returns
what the plain model's ``outputs.logits`` holds for the same rows (a span head's start and end
logits stacked on a last dimension of two): the whole vocabulary (gathered over
tp, padding cut), the whole sequence (gathered over cp, in token order), every microbatch concatenated
along dim 0. Logits of a whole batch over a large vocabulary are big, so ``reduce(logits, microbatch)``
may cut each microbatch's down on the last stage (``logits.argmax(-1)``, the log-probabilities of the
labels, ...); it receives the microbatch as given (whole sequences). With ``broadcast`` (the default)
every rank of the replica returns the result, sent from the last pipeline stage with one broadcast (its
shape and dtype announced by a header); without, the last stage's ranks return it and the others None.

The schedule runs forward only, as ``eval_step``'s does, in evaluation mode.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping

import torch

from ..context_parallel.apply import gather_sequence_positions
from ..pipeline.wire import broadcast_announced
from .runner import StepContext, forward_inputs, prepare, run_schedule, trusted

# (a microbatch's whole logits, that microbatch of the batch) -> what ``ParallelModel.logits`` keeps of them
LogitsFn = Callable[[torch.Tensor, Mapping[str, torch.Tensor]], torch.Tensor]


def head_logits(outputs) -> torch.Tensor:
    """The head's logits in ``outputs``: ``logits``, or a span head's start and end logits stacked on a
    last dimension of two (``[..., 0]`` the starts'), which is what such a head predicts."""
    logits = getattr(outputs, "logits", None)
    if logits is None and getattr(outputs, "start_logits", None) is not None:
        return torch.stack([outputs.start_logits, outputs.end_logits], dim=-1)
    if logits is None:
        raise ValueError(f"the model's output ({type(outputs).__name__}) holds no logits: pm.logits returns a head's "
                         f"logits; call the plain model, or pass loss_fn to train_step for its other outputs")
    return logits


def collect_logits(ctx: StepContext, batch: Mapping[str, torch.Tensor], *, reduce: LogitsFn | None,
                   broadcast: bool) -> torch.Tensor | None:
    """``ParallelModel.logits`` (see there): a forward-only pass of the schedule whose last chunk keeps each
    microbatch's whole logits (or what ``reduce`` makes of them) instead of a loss. No labels are needed:
    under cp, ``shard_microbatches`` shifts the ids when there are none."""
    prepared = prepare(ctx, batch, loss=None, builtin=False)
    stage, groups, cp = ctx.stage, ctx.placement.groups, ctx.placement.dims.cp
    collected: dict[int, torch.Tensor] = {}

    def forward(chunk: int, mb: int, received: torch.Tensor | None) -> torch.Tensor:
        inputs = forward_inputs(ctx, prepared, mb, builtin=False)
        with trusted(ctx, prepared):  # masks built unread where they hide nothing (host_masks.py)
            outputs = stage.forward(inputs, received, chunk=chunk, **ctx.plan.policy.forward_kwargs)
        if not stage.is_last_chunk(chunk):
            return outputs
        logits = ctx.full_logits(head_logits(outputs))
        if cp > 1:
            logits = gather_sequence_positions(logits, layout=ctx.cp_layout, group=groups.cp)
        collected[mb] = logits if reduce is None else reduce(logits, prepared.whole[mb])
        return logits.new_zeros(())

    run_schedule(ctx, prepared, forward, backward=False)
    result = torch.cat([collected[mb] for mb in sorted(collected)]) if collected else None
    if stage.stages == 1:
        return result
    if not broadcast:
        return result if stage.is_last else None
    return broadcast_announced(result if stage.is_last else None, src=stage.stages - 1, group=groups.pp,
                               device=ctx.placement.device)
