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
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch.distributed import ProcessGroup

from .token_exchange import all_to_all_rows, exchange_counts, gather_rows, split_rows


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

    @property
    def local(self) -> int:
        return self.experts // self.ep


def expert_parallel_forward(route: ExpertRoute, local_forward: Callable) -> Callable:
    """The registry function for one model: ``local_forward(module, rows, ids, weights)`` is the
    model's own experts implementation (eager or grouped_mm; it sees the module's local experts only)."""

    def forward(module, hidden_states: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor):
        if route.tokens_split is not None and route.tokens_split():  # a slice of the sequence: distinct already
            return _exchange(module, route, local_forward, hidden_states, top_k_index, top_k_weights)
        rows = hidden_states.shape[0]
        hidden = split_rows(hidden_states, group=route.tp)
        index = split_rows(top_k_index, group=route.tp)
        weights = split_rows(top_k_weights, group=route.tp)
        out = _exchange(module, route, local_forward, hidden, index, weights)
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


def _expert_counts(sorted_ids: torch.Tensor, experts: int) -> torch.Tensor:
    """Pairs per expert from the sorted expert ids, on the device: the bounds of each expert's run.
    ``torch.bincount`` would read the largest id back to the host to size its output."""
    bounds = torch.searchsorted(sorted_ids, torch.arange(experts + 1, dtype=sorted_ids.dtype, device=sorted_ids.device))
    return bounds.diff()
