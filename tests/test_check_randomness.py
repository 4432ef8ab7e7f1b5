"""The check's handling of randomness in a training forward (qn_hf/check/randomness.py): a module's own sampling
runs as in evaluation; a model that draws otherwise is told apart, not judged equal or different."""

from __future__ import annotations

import torch
from transformers import CONFIG_MAPPING
from transformers.modeling_outputs import ModelOutput

from qn_hf.check.inputs import dummy_batch, probe_loss
from qn_hf.check.randomness import draws_random
from qn_hf.check.run import build
from qn_hf.check.shrink import shrink_config


def test_a_gumbel_quantizer_runs_as_in_evaluation():
    # wav2vec 2.0's pretraining quantizer draws Gumbel noise in training: two ranks' halves of the batch drew other
    # noise than one process (dp=2 was 1e-3 apart); as in evaluation it takes the argmax, on every rank alike
    model = build(shrink_config(CONFIG_MAPPING["wav2vec2"]()), seed=0, name="Wav2Vec2ForPreTraining")
    batch = dummy_batch(model, rows=2)
    assert not draws_random(model, batch, loss=probe_loss)


class _Noisy(torch.nn.Module):
    def __init__(self, noise: bool) -> None:
        super().__init__()
        self.weight, self.noise = torch.nn.Parameter(torch.ones(3)), noise
        self.config = None

    def forward(self, x):
        return ModelOutput(loss=(self.weight * x).sum() + (torch.rand(()) if self.noise else 0.0))


def test_a_forward_that_draws_random_numbers_is_told_apart():
    batch = {"x": torch.ones(2, 3)}
    assert draws_random(_Noisy(noise=True), batch, loss=None)
    assert not draws_random(_Noisy(noise=False), batch, loss=None)
