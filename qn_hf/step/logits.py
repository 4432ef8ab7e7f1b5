"""``pm.logits``: the model's whole logits (or a reduction of them) at any mesh, without a loss.

``pm.logits(batch)`` takes this dp rank's batch as ``train_step`` does (no labels needed) and returns
what the plain model's ``outputs.logits`` holds for the same rows: the whole vocabulary (gathered over
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

from ..config.sequence import sequence_split
from ..context_parallel.apply import CP_KEYS, LOSS_KEYS, gather_sequence_positions, ring_documents, shard_microbatches
from ..devices import to_device
from ..pipeline.runtime import batch_shape_key
from ..pipeline.schedule import schedule_actions
from ..pipeline.wire import broadcast_announced
from .agreement import agree_on_batch
from .batch import check_step_batch, microbatch_rows, split_microbatches

# (a microbatch's whole logits, that microbatch of the batch) -> what ``ParallelModel.logits`` keeps of them
LogitsFn = Callable[[torch.Tensor, Mapping[str, torch.Tensor]], torch.Tensor]


def collect_logits(pm, batch: Mapping[str, torch.Tensor], *, reduce: LogitsFn | None, broadcast: bool) -> torch.Tensor | None:
    """``ParallelModel.logits`` (see there): a forward-only pass of the schedule whose last chunk keeps each
    microbatch's whole logits (or what ``reduce`` makes of them) instead of a loss."""
    cp = pm.dims.cp
    split = sequence_split(cp=cp, tp=pm.dims.tp, sequence_parallel=pm.plan.sequence_parallel)
    # the train step's checks without a loss, agreed by every rank before any collective (agreement.py)
    size = agree_on_batch(lambda: check_step_batch(
        batch, model=pm.module, loss=None, builtin=False, cp=cp, cp_keys=CP_KEYS, split=split,
        microbatches=pm.microbatches, config=pm.config), batch, replica=pm.coords.dp, replicas=pm.dims.dp,
        group=pm.groups.host)
    documents = ring_documents(batch) if cp > 1 else None  # read before the batch moves (context_parallel/apply.py)
    whole = split_microbatches(to_device(batch, pm.device), microbatches=pm.microbatches)
    if cp > 1:  # the labels are not needed (shard_microbatch shifts the ids when there are none)
        micro = shard_microbatches(whole, documents, layout=pm.cp_layout, rank=pm.coords.cp)
    else:
        micro = whole
    collected: dict[int, torch.Tensor] = {}

    def forward(chunk: int, mb: int, received: torch.Tensor | None) -> torch.Tensor:
        inputs = {k: v for k, v in micro[mb].items() if k not in LOSS_KEYS}
        outputs = pm.stage.forward(inputs, received, chunk=chunk, **pm.plan.policy.forward_kwargs)
        if not pm.stage.is_last_chunk(chunk):
            return outputs
        logits = pm.full_logits(outputs.logits)
        if cp > 1:
            logits = gather_sequence_positions(logits, layout=pm.cp_layout, group=pm.groups.cp)
        collected[mb] = logits if reduce is None else reduce(logits, whole[mb])
        return logits.new_zeros(())

    schedule = schedule_actions(stages=pm.stage.stages, microbatches=pm.microbatches, schedule=pm.schedule,
                                virtual_stages=pm.stage.plan.virtual, backward=False)
    rows = microbatch_rows(size, microbatches=pm.microbatches)
    pm.executor.run(schedule, forward, rows=rows, shape_key=batch_shape_key(micro[0], rows=rows))
    result = torch.cat([collected[mb] for mb in sorted(collected)]) if collected else None
    if pm.stage.stages == 1:
        return result
    if not broadcast:
        return result if pm.stage.is_last else None
    return broadcast_announced(result if pm.stage.is_last else None, src=pm.stage.stages - 1,
                               group=pm.groups.pp, device=pm.device)
