"""Expert parallelism for experts that see every token once per expert (Llama 4's ``Llama4TextExperts``).

Llama 4's MoE block does not hand its experts the routers' choices: it repeats every token once per
expert, scaled by that expert's routing score (zero where the expert was not chosen), and calls
``experts(rows [E*T, H])``, whose forward views the rows as ``[E, T, H]`` (as many blocks as its
stacked weights ``gate_up_proj [E, H, 2I]``, ``down_proj [E, I, H]`` have experts) and multiplies
block by block. There is no registry to put a dispatch in (``use_experts_implementation`` is not on
it), so the module's forward stays and two hooks move its rows, as autograd functions:

1. with tp > 1 the tp ranks hold the same tokens: each keeps its ``row_split`` share of the T
   tokens (of every expert block), so every token travels once;
2. the block of each expert goes to the member of the ep group that holds it (an all-to-all; a
   member's token count differs from another's when batches do, so the counts are exchanged first:
   the call's one host read);
3. the module runs its ``E/ep`` local experts on the tokens of every member, ``[E/ep, sum T, H]``;
4. the results go back by the reverse all-to-all, in expert order, and (tp > 1) the tp shares are
   gathered again.

This moves E copies of every token (the block's own layout), where the fused form moves K; it is
what computing the same function with the experts on other ranks costs. Gradients are those of the
fused form: each expert's weights see the tokens of its whole ep group, summed over the ranks that
hold the same block (``Groups.experts``).
"""

from __future__ import annotations

import inspect

import torch
import torch.nn.functional as F
from torch import nn

from ..comm import group_size
from ..compat import decorated_experts
from .dispatch import ExpertRoute
from .token_exchange import all_to_all_rows, exchange_counts, gather_rows, row_split, split_rows


def is_stacked_experts(module: nn.Module) -> bool:
    """A module of ``num_experts`` experts stacked along dim 0 of every parameter, called with the
    rows of every expert (one tensor argument), outside transformers' experts registry."""
    count = getattr(module, "num_experts", None)
    params = list(module.parameters(recurse=False))
    if decorated_experts(module) or not isinstance(count, int) or not params:
        return False
    if not all(p.dim() == 3 and p.shape[0] == count for p in params):
        return False
    arguments = [p for p in inspect.signature(type(module).forward).parameters.values() if p.name != "self"]
    return len(arguments) == 1 and arguments[0].kind is inspect.Parameter.POSITIONAL_OR_KEYWORD


def stacked_expert_hooks(module: nn.Module, *, route: ExpertRoute) -> None:
    """Move the module's rows to the holders of their experts before it runs and back after (module
    docstring); the module holds ``route.local`` experts already."""
    # per call in flight: member counts, tokens, all, shared, the rows sent (with the all-gather dispatch's padding)
    pending: list[tuple[list[int], int, int, bool, int]] = []

    def before(_module: nn.Module, args: tuple):
        (rows,) = args
        hidden = rows.shape[-1]
        whole = rows.shape[0] // route.experts
        blocks = rows.view(route.experts, whole, hidden)
        shared = not (route.tokens_split is not None and route.tokens_split())
        if shared:  # the tp ranks' tokens are the same: each sends its share
            blocks = split_rows(blocks.transpose(0, 1), group=route.tp).transpose(0, 1)
        tokens = blocks.shape[1]
        if route.gathering is not None and route.gathering():
            # every member's count is known from the shapes (the step's batches agree): no read; a tp share
            # one row short pads to the first's (rows of zeros, whose outputs are dropped on return)
            most = max(row_split(whole, group_size(route.tp))) if shared else tokens
            blocks = F.pad(blocks, (0, 0, 0, most - tokens))
            counts, sent = [most] * route.ep, most
        else:
            mine = torch.full((route.ep, 1), tokens, dtype=torch.long, device=rows.device)
            counts, sent = exchange_counts(mine, group=route.group).view(-1).tolist(), tokens  # the call's one read
        received = all_to_all_rows(blocks.reshape(-1, hidden), out_rows=[route.local * n for n in counts],
                                   in_rows=[route.local * sent] * route.ep, group=route.group)
        per_member = received.split([route.local * n for n in counts])
        local = torch.cat([part.view(route.local, n, hidden) for part, n in zip(per_member, counts)], dim=1)
        pending.append((counts, tokens, whole, shared, sent))
        return (local.reshape(-1, hidden),)

    def after(_module: nn.Module, _args: tuple, out: torch.Tensor) -> torch.Tensor:
        counts, tokens, whole, shared, sent = pending.pop()
        hidden = out.shape[-1]
        per_member = out.view(route.local, sum(counts), hidden).split(counts, dim=1)
        send = torch.cat([part.reshape(-1, hidden) for part in per_member])
        back = all_to_all_rows(send, out_rows=[route.local * sent] * route.ep,
                               in_rows=[route.local * n for n in counts], group=route.group)
        blocks = back.view(route.experts, sent, hidden)[:, :tokens]
        if shared:
            blocks = gather_rows(blocks.transpose(0, 1), rows=whole, group=route.tp).transpose(0, 1)
        return blocks.reshape(-1, hidden)

    module.register_forward_pre_hook(before)
    module.register_forward_hook(after)
