"""Where routed tokens go, as the time model reads it: the busiest ep rank's share.

Under expert parallelism every MoE layer's all-to-all waits for the ep rank whose experts received
the most (token, expert) pairs, so a step's experts run at the busiest rank's load, not the mean.
``apply_expert_parallel`` gives ep rank r the contiguous block of experts r*E/ep .. (r+1)*E/ep - 1.

- Given the router's loads (``expert_loads``: rows of the pairs each expert received, one row per
  MoE layer and batch, e.g. counted on batches of the user's data by ``measure_expert_loads``), the
  busiest rank's share of each row's pairs times ep, averaged over the rows (each layer of each
  microbatch waits for its own busiest rank).
- Without them, at uniform routing: the ranks' counts of ``pairs`` are multinomial, and the
  expected largest is the mean plus the expected largest of ep standard normals (Blom's
  approximation) times their spread (``uniform_busiest``). A router that is not uniform loads its busiest rank more: on
  this project's tiny Qwen3-MoE without a load-balancing loss the busier of two ep ranks got 1.19x
  the mean over 50 training steps (docs/experts.md), against uniform routing's 1.01 at that batch.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from statistics import NormalDist

import torch
from torch import nn

from .apply import experts_modules

ROUTING_UNIFORM = ("routing: uniform (the busiest ep rank's load as a uniform router's; pass expert_loads, "
                   "counted on your data by qn_hf.planner.measure_expert_loads, to price your router's)")


def check_loads(loads: Sequence[Sequence[float]], experts: int) -> tuple[tuple[float, ...], ...]:
    """``loads`` as a tuple of rows (one per MoE layer and batch) of ``experts`` non-negative counts
    with a positive sum; ``ValueError`` naming what is wrong otherwise."""
    rows = tuple(tuple(float(x) for x in row) for row in loads)
    if not rows or experts < 1:
        raise ValueError(f"expert_loads: {len(rows)} layer(s) for a model with {experts} routed experts per layer; "
                         "pass one row per MoE layer and batch (measure_expert_loads counts them), or leave it out")
    for i, row in enumerate(rows):
        if len(row) != experts or any(not math.isfinite(x) or x < 0 for x in row) or sum(row) <= 0:
            raise ValueError(f"expert_loads[{i}] = {list(row)[:8]}{'...' if len(row) > 8 else ''}: each row must hold "
                             f"{experts} non-negative counts (one per expert) with a positive sum")
    return rows


def busiest_share(loads: Sequence[Sequence[float]], ep: int) -> float:
    """The busiest of ``ep`` ranks' pairs over the mean, averaged over the rows (module docstring)."""
    if ep == 1:
        return 1.0
    shares = []
    for row in loads:
        per_rank = len(row) // ep
        shares.append(max(sum(row[r * per_rank:(r + 1) * per_rank]) for r in range(ep)) * ep / sum(row))
    return sum(shares) / len(shares)


def uniform_busiest(pairs: float, ep: int) -> float:
    """The busiest of ``ep`` ranks' expected pairs over the mean at uniform routing of ``pairs``."""
    if ep == 1 or pairs <= 0:
        return 1.0
    largest = NormalDist().inv_cdf((ep - 0.375) / (ep + 0.25))  # Blom: the expected largest of ep normals
    # each rank's count: variance pairs (1/ep)(1 - 1/ep), correlated -1/(ep-1) with the others' (they
    # sum to pairs), so the largest lies sqrt(ep/(ep-1)) further out than independent counts' would
    return 1.0 + largest * math.sqrt(ep / pairs)


@torch.no_grad()
def measure_expert_loads(model: nn.Module, batches: Sequence[Mapping[str, torch.Tensor]] | Mapping[str, torch.Tensor],
                         ) -> tuple[tuple[int, ...], ...]:
    """For each of ``batches`` (one batch, or several, of the model's inputs, each as many sequences
    as an ep group routes at once: a step's microbatch over the dp ranks) and each MoE layer, the
    (token, expert) pairs each routed expert receives while ``model`` (a plain Hugging Face model,
    before ``parallelize``) runs forward on it: one row per batch and layer, counted by a forward
    pre-hook on each fused experts module. Per batch, not summed: a step waits for each batch's
    busiest rank, and a sum over batches evens out what each of them does not. For
    ``auto_config(..., expert_loads=...)``."""
    modules = list(experts_modules(model).values())
    if not modules:
        raise ValueError(f"{type(model).__name__} has no fused routed-experts modules to count loads of")
    rows: list[tuple[int, ...]] = []
    counts: list[torch.Tensor | None] = [None] * len(modules)
    handles = []
    for i, module in enumerate(modules):

        def count(_module, args, i=i, experts=int(module.num_experts)):  # args: hidden states, top-k ids, weights
            seen = torch.bincount(args[1].reshape(-1).cpu(), minlength=experts)
            counts[i] = seen if counts[i] is None else counts[i] + seen

        handles.append(module.register_forward_pre_hook(count))
    try:
        for batch in [batches] if isinstance(batches, Mapping) else batches:
            counts[:] = [None] * len(modules)
            model(**batch)
            rows += [tuple(int(x) for x in c.tolist()) for c in counts if c is not None]
    finally:
        for h in handles:
            h.remove()
    return tuple(rows)
