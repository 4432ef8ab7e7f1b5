"""What one rank's model becomes as a pipeline stage, and how that stage runs a microbatch.

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

``apply_stage`` edits one rank's model in place (from a ``StagePlan``, see split.py) and returns
the ``StageModules`` whose ``forward`` runs a microbatch through whatever the stage kept.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

import torch
from torch import nn

from ..names import base_model_and_prefix
from .split import StagePlan
from .stage_config import slice_layer_lists
from .standins import Injector, PassThrough, mirror_reads, standin_for


@dataclass(kw_only=True)
class StageModules:
    """What one rank's model became: its stage, the modules it runs and, past the first, the
    injector that feeds it the received activation."""

    stage: int
    stages: int
    injector: Injector | None
    config: object  # the whole model's config, as given: exports and checkpoints write this one
    model: nn.Module  # the whole (cut) HF model: its head runs on the last stage
    base: nn.Module  # its HF base model: what earlier stages run
    plan: StagePlan

    @property
    def is_first(self) -> bool:
        return self.stage == 0

    @property
    def is_last(self) -> bool:
        return self.stage == self.stages - 1

    def forward(self, inputs: Mapping[str, torch.Tensor], received: torch.Tensor | None, **kwargs):
        """One microbatch through this stage. ``received`` (None on the first stage) enters through
        the injector. A non-last stage returns the activation to send (the base model's
        ``last_hidden_state``: no head runs before the last stage); the last stage returns the HF
        model's outputs, for the loss. ``kwargs`` go to the HF forward as they are."""
        if self.injector is not None:
            self.injector.pending = received
        if not self.is_last:
            return self.base(**inputs, **kwargs).last_hidden_state
        return self.model(**inputs, **kwargs)


def _replace(model: nn.Module, name: str, new: nn.Module) -> None:
    parent, _, child = name.rpartition(".")
    setattr(model.get_submodule(parent) if parent else model, child, new)


def apply_stage(model: nn.Module, plan: StagePlan, *, stage: int) -> StageModules:
    """Keep only ``stage``'s modules in ``model`` (in place); the others are freed."""
    config = model.config
    base = base_model_and_prefix(model)[0]
    if plan.stages == 1:
        return StageModules(stage=0, stages=1, injector=None, config=config, model=model, base=base, plan=plan)
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
        mirror_reads(injector, model.get_submodule(plan.entry), plan.entry_reads)
        _replace(model, plan.entry, injector)
        for name, kind in plan.first_only:
            _replace(model, name, standin_for(kind, model.get_submodule(name)))
    if stage < plan.stages - 1:
        for name, kind in plan.last_only:
            _replace(model, name, standin_for(kind, model.get_submodule(name)))
        for head in plan.heads:
            _replace(model, head, PassThrough())
    return StageModules(stage=stage, stages=plan.stages, injector=injector, config=config, model=model, base=base,
                        plan=plan)
