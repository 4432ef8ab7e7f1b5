"""A mesh's compute for one microbatch (``MeshWork``): each stage's FLOPs by kind, from the stage cut,
the parameters each rank of a stage holds and the traced forward's tokens and routing. ``Planner``
builds an estimate's compute figures from it, and a search prices a least step time from it alone
(``cost.step_floor``) before it estimates a mesh's memory, traffic and schedule.

FLOPs, per token of the microbatch (each cp rank runs 1/cp of the tokens): 6 per matmul parameter a
rank holds (embedding lookups none; routed experts their active share, K/E, or K*ep/(E*tp) under ep),
attention 12 x layers x hidden x positions for the whole model, its share by the blocks a rank runs
over tp; zb_h1's deferred weight gradients (W) 2 per element of the deferred linears' weights."""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import nn
from transformers import PretrainedConfig

from ..checkpoint.layout import meta_model
from ..config.parallel_config import ParallelConfig
from ..expert_parallel.routing_costs import busiest_share, uniform_busiest
from ..pipeline.split import StagePlan
from ..pipeline.weight_grad import WeightGradQueue, make_deferrable
from .params import StageParams
from .results import MeshWork, StageWork
from .trace import Recording, Trace


def mesh_work(parallel: ParallelConfig, *, model: nn.Module, config: PretrainedConfig, base: Trace | Recording,
              placed: StageParams, stage_plan: StagePlan, deferred: frozenset[str], experts: frozenset[str],
              micro_batch_size: int, total_params: int, routed: int,
              expert_loads: Sequence[Sequence[float]] | None, dtype: str) -> MeshWork:
    """``parallel``'s compute: ``base`` the forward without recomputation, traced or recorded (what is
    read of it, its tokens, one cp rank's, and its experts' routing, is the same), ``placed`` the stages' parameters at its tp and ep, ``deferred`` the linears zb_h1
    defers (empty otherwise), ``experts`` the routed experts' parameter names, ``routed`` their
    elements in the whole model; ``expert_loads`` the router's (expert_parallel/routing_costs.py; None: uniform)."""
    dims = parallel.dims
    tp, cp, ep = dims.tp, dims.cp, dims.ep
    layers = stage_plan.layer_ranges[-1][1]  # the blocks a token runs through (a looped module's iterations)
    if stage_plan.seq2seq is not None:  # the encoder's blocks run too (``layers`` is the decoder's)
        layers += len(model.get_submodule(stage_plan.seq2seq.encoder_layers))
    tokens = base.tokens * cp  # the whole microbatch's
    positions = tokens // micro_batch_size  # per example: seq_len, or patches + class token
    attention_per_token = 12 * layers * config.hidden_size * positions  # forward + backward
    # a token runs through K of each MoE layer's E routed experts
    active = base.experts[0].top_k / base.experts[0].experts if base.experts else 1.0
    expert_flop_share = active * (ep / tp if ep > 1 else 1)
    if expert_loads is not None:
        imbalance = busiest_share(expert_loads, ep)
    else:  # the pairs an ep group routes per layer: each tp rank of its dp rows sends 1/tp of its tokens
        imbalance = uniform_busiest(base.tokens * base.experts[0].top_k * ep / tp if base.experts else 0, ep)
    stages = []
    for s in range(stage_plan.stages):
        held = placed.held[s]
        ranges = tuple(stage_plan.layer_ranges[c] for c in stage_plan.chunks_of(s))
        expert_params = sum(n for name, n in held if name in experts)
        params = sum(n for _, n in held)
        # 6 FLOPs per matmul parameter and token (embedding lookups none, routed experts their active share)
        matmul = params - placed.embedding[s] - expert_params * (1 - expert_flop_share)
        blocks = sum(b - a for a, b in ranges)
        attention = attention_per_token * blocks / layers / tp * tokens
        # W: each deferred weight's gradient, 2 FLOPs per element and token
        weight = 2 * sum(n for name, n in held if name.rpartition(".")[0] in deferred and name.endswith(".weight")) * tokens
        stages.append(StageWork(chunks=ranges, stacks=_stacks(stage_plan, stage_plan.chunks_of(s)), params=params, embedding_params=placed.embedding[s],
                                expert_params=expert_params, flops_per_microbatch=6 * matmul * tokens + attention,
                                weight_grad_flops_per_microbatch=weight, attention_flops_per_microbatch=attention,
                                expert_flops_per_microbatch=6 * expert_params * expert_flop_share * tokens))
    return MeshWork(parallel=parallel, stages=tuple(stages), tokens_per_microbatch=tokens, seq_len=positions,
                    layers=layers, attention_flops_per_token=attention_per_token,
                    flops_per_token=6 * (total_params - routed * (1 - active)) + attention_per_token,
                    expert_flop_share=expert_flop_share, expert_imbalance=imbalance,
                    hidden_size=config.hidden_size, dtype=dtype)


def deferred_linears(config: PretrainedConfig, *, cls: type | None, dtype: torch.dtype,
                     heads: tuple[str, ...]) -> frozenset[str]:
    """The linear modules whose weight gradients zb_h1 defers to W: those ``parallelize`` hands to
    ``make_deferrable`` (on a meta model of its own, whose layers it swaps)."""
    model = meta_model(config, cls=cls).to(dtype)
    return frozenset(n.rpartition(".")[0] for n in make_deferrable(model, queue=WeightGradQueue(), skip=heads))


def _stacks(stage_plan: StagePlan, chunks: Sequence[int]) -> tuple[str, ...]:
    """The block list each chunk's ``chunks`` range counts in: an encoder-decoder's restart at the decoder."""
    seq2seq = stage_plan.seq2seq
    if seq2seq is None:
        return ()
    return tuple(seq2seq.encoder_layers if c < seq2seq.encoder_chunks else seq2seq.decoder_layers for c in chunks)
