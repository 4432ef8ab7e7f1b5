"""One MoE experts call under expert parallelism: tokens travel to the rank holding their expert,
run there, and come back weighted.

The experts module keeps its Hugging Face forward: this function is registered in transformers'
experts registry (``ExpertsInterface``) and called with the module, the hidden states ``[T, H]``,
the routers' choices ``top_k_index [T, K]`` and their weights ``top_k_weights [T, K]``. The router,
shared experts and residual stay in the untouched block forward around it. Per call:

1. with tp > 1 the tp ranks hold the same tokens: each keeps its ``row_split`` share (the gradients
   of the shared inputs are gathered back in backward) so every token travels once. Under sequence
   parallelism they hold different tokens already (their slices of the sequence): nothing is
   shared out, and step 5 is skipped (the block's output stays this rank's slice);
2. the (token, choice) pairs are sorted by expert; per-expert counts go to every member of the ep
   group with one all-to-all, then the tokens with a second (uneven splits);
3. the received rows run through this rank's experts with the module's own implementation
   (eager or grouped_mm), as top-1 with unit weights;
4. the results return by the reverse all-to-all, are put back in pair order, multiplied by the
   routing weights and summed over the K choices, as transformers' grouped_mm path does;
5. with tp > 1 the tp ranks' shares are gathered again.

Every member of the ep group makes the same calls in the same order (one per MoE layer and
microbatch, the same layers on every rank of a stage), and a rank that receives no rows still
runs its experts on none, so the collectives of backward pair up too.

With ``expert_dispatch="all_gather"`` (``config.options.Dispatch``), inside a training or evaluation
step (``route.gathering``: the step's agreement has made every rank's batch the same shape, so every
member's token count is this rank's), steps 2-4 are instead:

2. every member's tokens, choices and routing weights are gathered (equal blocks: a tp share shorter
   than the first is padded with tokens routed nowhere);
3. this rank's experts run on every gathered token with the model's own implementation, the choices
   of experts held elsewhere given transformers' expert-parallel sentinel (one past the local experts,
   weight 0), which its ``grouped_mm`` and ``batched_mm`` leave out of the output;
4. the partial outputs (each token's weighted sum over this rank's experts) are summed over the
   members back to the rank the token came from.

No size is read on the host; each rank sends and receives ep times its tokens, and the experts'
call holds ep times the pairs. Outside a step (``generate``, a plain forward call) the ranks' batches
need not be alike, and the all-to-all runs.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch.distributed import ProcessGroup

from ..comm import group_rank, group_size
from .token_exchange import (
    all_to_all_rows,
    exchange_counts,
    gather_blocks,
    gather_rows,
    row_split,
    split_rows,
    sum_blocks,
)


@dataclass(frozen=True)
class ExpertRoute:
    """Where the experts of one model live: ``experts`` in all, ``ep`` contiguous blocks of
    ``experts // ep`` over the members of ``group``; ``tp`` shares the tokens of a tp group."""

    experts: int
    ep: int
    group: ProcessGroup
    tp: ProcessGroup
    # whether the tp ranks already hold different tokens (sequence parallelism on: the block runs on
    # this rank's slice of the sequence); None or False: they hold the same tokens and share them out
    tokens_split: Callable[[], bool] | None = None
    # whether this call gathers every member's tokens (expert_dispatch="all_gather", inside a step whose
    # batches agree in shape: ``GatherSwitch``); None: the all-to-all always
    gathering: Callable[[], bool] | None = None

    @property
    def local(self) -> int:
        return self.experts // self.ep


# why the all-gather dispatch needs every rank's batch alike, and the fixes (the step's agreement names it)
SAME_SHAPES = ("expert_dispatch='all_gather' sizes every MoE call's exchange from this rank's own tokens, so every "
               "data-parallel replica's batch must have the same shapes each step; pad every batch to one length "
               "(e.g. the tokenizer's padding='max_length') or use expert_dispatch='all_to_all'")


class GatherSwitch:
    """``expert_dispatch="all_gather"``'s window: on while a step runs its schedule (forward, backward
    and recomputation alike: ``step/runner.run_schedule``), after the step's agreement has made every
    rank's batch the same shape; off elsewhere (``generate``, a plain forward call), where the
    all-to-all runs."""

    def __init__(self) -> None:
        self.on = False

    def gathering(self) -> bool:
        return self.on

    @contextlib.contextmanager
    def within_step(self) -> Iterator[None]:
        before, self.on = self.on, True
        try:
            yield
        finally:
            self.on = before


def expert_parallel_forward(route: ExpertRoute, local_forward: Callable) -> Callable:
    """The registry function for one model: ``local_forward(module, rows, ids, weights)`` is the
    model's own experts implementation (eager or grouped_mm; it sees the module's local experts only)."""

    def forward(module, hidden_states: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor):
        gather = route.gathering is not None and route.gathering()

        def exchange(hidden: torch.Tensor, index: torch.Tensor, weights: torch.Tensor, most: int) -> torch.Tensor:
            if gather:
                return _gather_exchange(module, route, local_forward, hidden, index, weights, most=most)
            return _exchange(module, route, local_forward, hidden, index, weights)

        rows = hidden_states.shape[0]
        if route.tokens_split is not None and route.tokens_split():  # a slice of the sequence: distinct already
            return exchange(hidden_states, top_k_index, top_k_weights, rows)
        shares = (split_rows(x, group=route.tp) for x in (hidden_states, top_k_index, top_k_weights))
        out = exchange(*shares, max(row_split(rows, group_size(route.tp))))  # the first tp rank's share: the largest
        return gather_rows(out, rows=rows, group=route.tp)

    return forward


def _exchange(module, route: ExpertRoute, local_forward: Callable, hidden: torch.Tensor, index: torch.Tensor,
              weights: torch.Tensor) -> torch.Tensor:
    tokens, k = index.shape
    pairs = index.reshape(-1)
    order = torch.argsort(pairs, stable=True)  # (token, choice) pairs grouped by expert, hence by owner
    counts = _expert_counts(pairs[order], route.experts).view(route.ep, route.local)
    received = exchange_counts(counts, group=route.group)  # [source member, local expert]
    # The call's one host sync: the uneven all-to-alls need their splits on the host, both read at once
    splits = torch.cat([counts.sum(1), received.sum(1)]).tolist()
    send_rows, recv_rows = splits[: route.ep], splits[route.ep :]
    rows = all_to_all_rows(hidden[order // k], out_rows=recv_rows, in_rows=send_rows, group=route.group)
    local_ids = torch.arange(route.local, device=pairs.device).repeat(route.ep).repeat_interleave(
        received.reshape(-1), output_size=sum(recv_rows))  # a known size: no sync to sum the repeats
    unit = torch.ones((rows.shape[0], 1), dtype=hidden.dtype, device=hidden.device)
    done = local_forward(module, rows, local_ids[:, None], unit)
    if rows.requires_grad and not done.requires_grad:  # no rows here: keep backward's all-to-alls paired
        done = done + rows.sum() * 0
    back = all_to_all_rows(done, out_rows=send_rows, in_rows=recv_rows, group=route.group)
    in_pair_order = back.index_select(0, torch.argsort(order))
    weighted = in_pair_order.view(tokens, k, hidden.shape[-1]) * weights[..., None]  # -1 fails on 0 tokens
    return weighted.sum(1).to(hidden.dtype)


def _gather_exchange(module, route: ExpertRoute, local_forward: Callable, hidden: torch.Tensor, index: torch.Tensor,
                     weights: torch.Tensor, *, most: int) -> torch.Tensor:
    """Steps 2-4 of the all-gather dispatch (module docstring); ``most``: the rows of every member's call
    (each pads to it), known from shapes alone since the step's batches agree."""
    tokens = hidden.shape[0]
    if tokens < most:  # a tp share one row short: rows routed to no expert (the sentinel), weight 0
        hidden = F.pad(hidden, (0, 0, 0, most - tokens))
        index = F.pad(index, (0, 0, 0, most - tokens), value=route.experts)
        weights = F.pad(weights, (0, 0, 0, most - tokens))
    every = gather_blocks(hidden, group=route.group)
    choices = gather_blocks(index, group=route.group) - group_rank(route.group) * route.local
    elsewhere = (choices < 0) | (choices >= route.local)
    # transformers' expert-parallel sentinel, one past the local experts: sorted last, left out of the
    # output by its grouped_mm and batched_mm (the module's _is_expert_parallel), weighted 0 for the router
    local_ids = choices.masked_fill(elsewhere, route.local)
    local_weights = gather_blocks(weights, group=route.group).masked_fill(elsewhere, 0.0)
    partial = local_forward(module, every, local_ids, local_weights)
    return sum_blocks(partial, group=route.group)[:tokens]


def _expert_counts(sorted_ids: torch.Tensor, experts: int) -> torch.Tensor:
    """Pairs per expert from the sorted expert ids, on the device: the bounds of each expert's run.
    ``torch.bincount`` would read the largest id back to the host to size its output."""
    bounds = torch.searchsorted(sorted_ids, torch.arange(experts + 1, dtype=sorted_ids.dtype, device=sorted_ids.device))
    return bounds.diff()
