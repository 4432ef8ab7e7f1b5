"""Which parameters one rank of each pipeline stage holds, and how many elements of each: the tp
plan's shards (applied to a meta model, as ``parallelize`` applies them), ep's block of E/ep rows
of every fused experts tensor, a later stage's own copy of a weight tied across stages, and each
stage's copy of what every stage holds (``StagePlan.every_stage``: Gemma 4's per-layer embeddings)."""

from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import nn
from transformers import PretrainedConfig

from ..checkpoint.layout import meta_model
from ..pipeline.split import StagePlan, on_every_stage, stage_of_module
from ..tensor_parallel.apply import apply_tp_plan


class LocalSizes:
    """One model's sizes by (tp plan, ep): elements of each parameter on one tp rank (every tp rank
    holds the same sizes), the tp specs, and each parameter's rows there (dim 0, what dp_shard splits;
    1 for a scalar); under ep the experts' tp rules are gone from the plan and a rank holds 1/ep of
    each of the ``experts`` tensors (their dim 0). Kept: the tp-sharded meta model is built once per
    tp, and once more for ep > 1, whose plan is the same at every ep (ep takes the experts' rules out)."""

    def __init__(self, config: PretrainedConfig, *, dtype: torch.dtype, cls: type | None, experts: frozenset[str]) -> None:
        self.config, self.dtype, self.cls, self.experts = config, dtype, cls, experts
        self._shapes: dict[tuple[int, bool], tuple[dict[str, torch.Size], dict]] = {}
        self._sizes: dict[tuple[int, int], tuple[dict[str, int], dict, dict[str, int]]] = {}

    def __call__(self, plan, ep: int = 1) -> tuple[dict[str, int], dict, dict[str, int]]:
        if (plan.tp, ep) not in self._sizes:
            if (plan.tp, ep > 1) not in self._shapes:
                self._shapes[(plan.tp, ep > 1)] = _tp_shapes(self.config, dtype=self.dtype, plan=plan, cls=self.cls)
            self._sizes[(plan.tp, ep)] = _at_ep(*self._shapes[(plan.tp, ep > 1)], ep=ep, experts=self.experts)
        return self._sizes[(plan.tp, ep)]


def _tp_shapes(config: PretrainedConfig, *, dtype: torch.dtype, plan, cls: type | None) -> tuple[dict[str, torch.Size], dict]:
    sharded = meta_model(config, cls=cls).to(dtype)
    specs, _ = apply_tp_plan(sharded, plan, tp_rank=0, group=None)  # meta: shapes only, no communication
    return {n: p.shape for n, p in sharded.named_parameters()}, specs


def _at_ep(shapes: dict[str, torch.Size], specs: dict, *, ep: int,
           experts: frozenset[str]) -> tuple[dict[str, int], dict, dict[str, int]]:
    rows = {n: (s[0] // ep if n in experts else s[0]) if len(s) else 1 for n, s in shapes.items()}
    return {n: s.numel() // ep if n in experts else s.numel() for n, s in shapes.items()}, specs, rows


@dataclass(frozen=True)
class StageParams:
    held: tuple[tuple[tuple[str, int], ...], ...]  # per stage: (name, elements) in registration order
    embedding: tuple[int, ...]  # per stage: elements of embedding tables (no matmul FLOPs)
    tied: tuple[dict[str, int], ...]  # per stage: its copy of a weight tied across stages -> elements
    every: tuple[dict[str, int], ...] = ()  # per stage: its copy of what every stage holds -> elements (pp > 1)


def stage_params(model: nn.Module, numels: dict[str, int], *, stage_plan: StagePlan,
                 stage_of: Callable[[str], int]) -> StageParams:
    """``numels`` (``local_sizes``) placed on the stages of ``stage_plan``; ``model`` the meta model."""
    pp = stage_plan.stages
    local = {name: (stage_of(name.rpartition(".")[0]), numel) for name, numel in numels.items()}
    held: list[list[tuple[str, int]]] = [[] for _ in range(pp)]
    embedding = [0] * pp
    embeddings = {n for n, m in model.named_modules() if isinstance(m, torch.nn.Embedding)}
    every: list[dict[str, int]] = [{} for _ in range(pp)]
    for name, (stage, numel) in local.items():
        shared = pp > 1 and on_every_stage(stage_plan, name.rpartition(".")[0])
        for s in range(pp) if shared else (stage,):
            held[s].append((name, numel))
            if shared:
                every[s][name] = numel
            if name.rpartition(".")[0] in embeddings:
                embedding[s] += numel
    tied: list[dict[str, int]] = [{} for _ in range(pp)]
    for tie in stage_plan.ties:  # the follower stage holds its own copy of the owner's weight
        owner_stage, numel = local[tie.owner]
        follower_stage = stage_of(tie.follower.rpartition(".")[0])
        if follower_stage != owner_stage:
            held[follower_stage].append((tie.follower, numel))
            tied[owner_stage][tie.owner] = tied[follower_stage][tie.follower] = numel
    return StageParams(held=tuple(map(tuple, held)), embedding=tuple(embedding), tied=tuple(tied), every=tuple(every))


@functools.lru_cache(maxsize=256)  # asked for every parameter and tp rule of every mesh the planner prices
def stage_lookup(stage_plan: StagePlan) -> Callable[[str], int]:
    """A module's stage under ``stage_plan`` (the root's: the last; a module on every stage: the first)."""
    @functools.cache
    def stage_of(name: str) -> int:
        found = stage_of_module(stage_plan, name)
        return stage_plan.stages - 1 if name == "" else (0 if found is None else found)
    return stage_of
