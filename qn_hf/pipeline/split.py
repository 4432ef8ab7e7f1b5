"""Cutting a model into pipeline stages at the policy's cut points.

Every stage runs the Hugging Face base model's own forward, so whatever a block needs besides the
hidden state (causal mask, rotary embeddings, position ids) is rebuilt by HF's code on each stage.
What differs per stage is which modules are real:

* the blocks: each stage keeps its contiguous range (under their original indices, so parameter
  names stay the HF names) and drops the rest;
* the entry (token/patch embedding): real on the first stage; elsewhere an ``Injector`` that returns
  the activation received from the previous stage;
* first-only and last-only modules: real on their stage, a parameter-free stand-in elsewhere;
* the task head (``lm_head``, ``classifier``): on the last stage only; earlier stages call the base
  model and send its ``last_hidden_state``.

``build_stage_plan`` validates everything and communicates nothing; ``apply_stage`` edits one rank's
model in place.
"""

from __future__ import annotations


from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import nn

from ..names import base_model_and_prefix
from ..plan import ModelPolicy
from .stage_config import slice_layer_lists


class StandIn(nn.Module):
    """A module that lives on another stage, replaced here; holds no parameters."""


class PassThrough(StandIn):
    """Returns its first argument (a norm or dropout that runs on another stage)."""

    def forward(self, x, *args, **kwargs):
        return x


class Zeros(StandIn):
    """An embedding that contributes nothing here (GPT-2's ``wpe`` is added once, on stage 0)."""

    def __init__(self, *, dim: int, dtype: torch.dtype) -> None:
        super().__init__()
        self.dim, self.dtype = dim, dtype

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return torch.zeros(*ids.shape, self.dim, dtype=self.dtype, device=ids.device)


class Injector(StandIn):
    """Stands for the entry module on later stages: returns the activation set in ``pending``."""

    def __init__(self) -> None:
        super().__init__()
        self.pending: torch.Tensor | None = None

    def forward(self, *args, **kwargs) -> torch.Tensor:
        if self.pending is None:
            raise RuntimeError("the pipeline entry was called without a received activation (or twice in one forward)")
        out, self.pending = self.pending, None
        return out


def _mirror_reads(injector: Injector, entry: nn.Module, reads: Sequence[str]) -> None:
    """Give the injector the attributes the base forward reads from the entry (e.g. a weight's
    dtype), as empty non-persistent buffers on empty submodules: nothing is saved or trained."""
    for path in reads:
        *mods, attr = path.split(".")
        src, dst = entry, injector
        for m in mods:
            src = getattr(src, m)
            if not hasattr(dst, m):
                dst.add_module(m, nn.Module())
            dst = getattr(dst, m)
        value = getattr(src, attr)
        if isinstance(value, torch.Tensor):
            dst.register_buffer(attr, torch.empty(0, dtype=value.dtype, device=value.device), persistent=False)
        else:
            setattr(dst, attr, value)


@dataclass(frozen=True)
class PipelineTie:
    """One parameter shared by a module on the first stage and one on the last (GPT-2's wte and
    lm_head). Each stage holds its own copy; their gradients are summed every step."""

    owner: str  # the HF name that is saved (first stage)
    follower: str  # the other name (last stage)


@dataclass(frozen=True)
class StagePlan:
    stages: int
    layer_ranges: tuple[tuple[int, int], ...]  # [start, stop) of the blocks on each stage
    layers: str  # ModuleList path from the top model
    entry: str | None  # paths from the top model
    first_only: tuple[tuple[str, str], ...]  # (module, stand-in)
    last_only: tuple[tuple[str, str], ...]
    heads: tuple[str, ...]
    entry_reads: tuple[str, ...]
    ties: tuple[PipelineTie, ...]

    def stage_of_layer(self, index: int) -> int:
        return next(s for s, (a, b) in enumerate(self.layer_ranges) if a <= index < b)


def split_layers(*, num_layers: int, stages: int, layers_per_stage: Sequence[int] | None = None) -> tuple[tuple[int, int], ...]:
    """Contiguous block ranges per stage: as even as possible (earlier stages take the remainder),
    or exactly ``layers_per_stage``."""
    if stages > num_layers:
        raise ValueError(f"pp={stages} is larger than the number of blocks ({num_layers}); use pp <= {num_layers}")
    if layers_per_stage is None:
        sizes = [num_layers // stages + (1 if s < num_layers % stages else 0) for s in range(stages)]
    else:
        sizes = list(layers_per_stage)
        if len(sizes) != stages or any(not isinstance(n, int) or n < 1 for n in sizes) or sum(sizes) != num_layers:
            raise ValueError(
                f"layers_per_stage={sizes} must give each of the pp={stages} stages at least one block and sum to "
                f"the {num_layers} blocks"
            )
    bounds, start = [], 0
    for n in sizes:
        bounds.append((start, start + n))
        start += n
    return tuple(bounds)


def _join(prefix: str, name: str) -> str:
    return f"{prefix}.{name}" if prefix else name


def build_stage_plan(
    model: nn.Module, policy: ModelPolicy, *, stages: int, layers_per_stage: Sequence[int] | None = None
) -> StagePlan:
    """Validate the cut for ``stages`` stages (pure: reads the model, communicates nothing)."""
    base, prefix = base_model_and_prefix(model)
    layers = base.get_submodule(policy.layers)
    if not isinstance(layers, nn.ModuleList):
        raise ValueError(f"policy {policy.model_type}: layers {policy.layers!r} is not a ModuleList")
    ranges = split_layers(num_layers=len(layers), stages=stages, layers_per_stage=layers_per_stage)
    if stages > 1 and policy.pp_entry is None:
        why = (f"transformers declares no base_model_pp_plan for {policy.model_type!r}, so there are no known cut points"
               if policy.transformers_plan else f"policy {policy.model_type} has no pp_entry")
        raise ValueError(f"pp={stages}: {why}; use pp=1 (data and tensor parallelism still apply) or pass "
                         f"policy=ModelPolicy(..., pp_entry=...)")

    def present(names: Sequence[str]) -> list[str]:
        # A stand-in target must exist, except an optional submodule the model leaves as None
        # (ViTModel without a pooler).
        found = []
        for name in names:
            parent, _, child = name.rpartition(".")
            holder = base.get_submodule(parent) if parent else base
            if not hasattr(holder, child):
                raise ValueError(f"policy {policy.model_type}: pipeline module {name!r} does not exist")
            if getattr(holder, child) is not None:
                found.append(name)
        return found

    entry = policy.pp_entry
    if entry is not None:
        present([entry])
        for path in policy.pp_entry_reads:
            obj = base.get_submodule(entry)
            for part in path.split("."):
                if not hasattr(obj, part):
                    raise ValueError(f"policy {policy.model_type}: {_join(entry, path)} (in pp_entry_reads) does not exist")
                obj = getattr(obj, part)
    first = [(n, policy.pp_first[n]) for n in present(list(policy.pp_first))]
    last = [(n, policy.pp_last[n]) for n in present(list(policy.pp_last))]
    heads = [] if base is model else [n for n, _ in model.named_children() if model.get_submodule(n) is not base]

    plan = StagePlan(
        stages=stages,
        layer_ranges=ranges,
        layers=_join(prefix, policy.layers),
        entry=_join(prefix, entry) if entry else None,
        first_only=tuple((_join(prefix, n), s) for n, s in first),
        last_only=tuple((_join(prefix, n), s) for n, s in last),
        heads=tuple(heads),
        entry_reads=policy.pp_entry_reads,
        ties=(),
    )
    if stages > 1:
        _check_assignment(model, plan, policy)
    return StagePlan(**{**plan.__dict__, "ties": _cross_stage_ties(model, plan)})


def stage_of_module(plan: StagePlan, name: str) -> int | None:
    """The stage a module (by its path in the top model) lives on; None: every stage."""
    def under(root: str) -> bool:
        return name == root or name.startswith(root + ".")

    if plan.entry and under(plan.entry) or any(under(n) for n, _ in plan.first_only):
        return 0
    if any(under(n) for n, _ in plan.last_only) or any(under(h) for h in plan.heads):
        return plan.stages - 1
    if under(plan.layers) and name != plan.layers:
        return plan.stage_of_layer(int(name[len(plan.layers) + 1 :].split(".")[0]))
    return None


def _check_assignment(model: nn.Module, plan: StagePlan, policy: ModelPolicy) -> None:
    """Parameters outside any stage's modules would be copied onto every stage; refuse them."""
    for name, _ in model.named_parameters():
        module = name.rpartition(".")[0]
        if stage_of_module(plan, module) is None:
            source = (f"transformers' base_model_pp_plan for {policy.model_type!r} does not place it (only the "
                      f"embedding, the blocks and what follows them); " if policy.transformers_plan else "")
            raise ValueError(f"parameter {name} belongs to no pipeline stage: {source}name its module in the "
                             f"policy's pp_first or pp_last, or use pp=1")


def _cross_stage_ties(model: nn.Module, plan: StagePlan) -> tuple[PipelineTie, ...]:
    if plan.stages == 1:
        return ()  # one stage holds every copy
    by_id: dict[int, list[str]] = {}
    for name, param in model.named_parameters(remove_duplicate=False):
        by_id.setdefault(id(param), []).append(name)
    ties = []
    for names in by_id.values():
        if len(names) < 2:
            continue
        stages = {stage_of_module(plan, n.rpartition(".")[0]) for n in names}
        if len(stages) == 1:
            continue
        if len(names) != 2 or stages != {0, plan.stages - 1}:
            raise ValueError(f"tied parameters {names} span stages {sorted(stages)}; only first-last ties are supported")
        owner, follower = sorted(names, key=lambda n: stage_of_module(plan, n.rpartition(".")[0]))
        ties.append(PipelineTie(owner=owner, follower=follower))
    return tuple(ties)


def _replace(model: nn.Module, name: str, new: nn.Module) -> None:
    parent, _, child = name.rpartition(".")
    setattr(model.get_submodule(parent) if parent else model, child, new)


def _standin(kind: str, module: nn.Module) -> StandIn:
    if kind == "zeros":
        if not isinstance(module, nn.Embedding):
            raise ValueError(f"the 'zeros' stand-in replaces an nn.Embedding, not {type(module).__name__}")
        return Zeros(dim=module.embedding_dim, dtype=module.weight.dtype)
    return PassThrough()


@dataclass
class StageModules:
    """What one rank's model became: its stage and, past the first, the injector to feed."""

    stage: int
    stages: int
    injector: Injector | None
    config: object  # the whole model's config, as given: exports and checkpoints write this one

    @property
    def is_first(self) -> bool:
        return self.stage == 0

    @property
    def is_last(self) -> bool:
        return self.stage == self.stages - 1


def apply_stage(model: nn.Module, plan: StagePlan, *, stage: int) -> StageModules:
    """Keep only ``stage``'s modules in ``model`` (in place); the others are freed."""
    config = model.config
    if plan.stages == 1:
        return StageModules(stage=0, stages=1, injector=None, config=config)
    layers = model.get_submodule(plan.layers)
    start, stop = plan.layer_ranges[stage]
    kept = nn.ModuleList()
    for i in range(start, stop):
        kept.add_module(str(i), layers[i])  # original index: parameter names stay the HF names
    _replace(model, plan.layers, kept)
    parent = plan.layers.rpartition(".")[0]
    slice_layer_lists(model.get_submodule(parent) if parent else model, start=start, stop=stop, total=len(layers))

    injector = None
    if stage > 0:
        injector = Injector()
        _mirror_reads(injector, model.get_submodule(plan.entry), plan.entry_reads)
        _replace(model, plan.entry, injector)
        for name, kind in plan.first_only:
            _replace(model, name, _standin(kind, model.get_submodule(name)))
    if stage < plan.stages - 1:
        for name, kind in plan.last_only:
            _replace(model, name, _standin(kind, model.get_submodule(name)))
        for head in plan.heads:
            _replace(model, head, PassThrough())
    return StageModules(stage=stage, stages=plan.stages, injector=injector, config=config)
