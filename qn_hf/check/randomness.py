"""Randomness in a model's training forward, which no split of the batch over ranks draws as one process
does: where it is a module's own sampling the check runs that module as in evaluation; where the model
draws otherwise, no step can be compared and the check says so (``draws_random``)."""

from __future__ import annotations

import functools
import random
from collections.abc import Callable

import numpy
import torch
from torch import nn

from ..policies.body import no_cache
from ..policies.entries import forward_source

# Modules (by class name) that draw random numbers in training besides dropout: PhiMoE's router samples its
# experts (sparsemixer). No split of the batch (dp, cp, ep) or of the layers (pp) draws the numbers one process
# draws, any more than dropout masks, so the check runs them as in evaluation on both sides (their deterministic
# top-k), as it runs dropout at 0.
SAMPLES_IN_TRAINING = ("PhimoeTopKRouter", "GroupViTAssignAttention")  # router jitter; Gumbel-softmax grouping


def sample_as_in_evaluation(model: nn.Module) -> None:
    """Run the modules of ``model`` that sample in training (``SAMPLES_IN_TRAINING``, and any whose forward
    draws Gumbel noise: wav2vec 2.0's and its kin's codebook quantizers) as in evaluation, where they take
    the argmax: each is set to evaluation before each call (``train()`` sets it back)."""
    for module in model.modules():
        if type(module).__name__ in SAMPLES_IN_TRAINING or _gumbel(type(module)):
            module.register_forward_pre_hook(_evaluating)


def _evaluating(module: nn.Module, *_) -> None:
    module.training = False


@functools.cache
def _gumbel(cls: type) -> bool:
    return "gumbel_softmax(" in forward_source(cls)


def draws_random(model: nn.Module, batch: dict, *, loss: Callable | None) -> bool:
    """Whether ``model``'s training forward gives another loss (its own, or ``loss`` of its outputs) on ``batch``
    under another random state (torch's, Python's and NumPy's: UniSpeech's pretraining draws Bernoulli
    replacements of its own). Local: run alike on every rank."""
    model.train()
    results = []
    for state in (1, 2):
        torch.manual_seed(state)
        random.seed(state)
        numpy.random.seed(state)
        with torch.no_grad():
            outputs = model(**batch, **no_cache(model))
        results.append(outputs.loss if loss is None else loss(outputs, batch))
    return not torch.equal(*results)
