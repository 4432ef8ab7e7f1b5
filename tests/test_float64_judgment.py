"""The check's float64 judgment (qn_hf.check.run): where a parallel float32 step is not within the tolerances of the
plain one, both run again in float64, where rounding is 2**29 times finer; equal there (within the tolerances scaled
by that ratio and by the model's own amplification of rounding) is float32's rounding alone, apart there is a
parallel step that computes something else."""

from __future__ import annotations

import copy

import pytest
from transformers import CONFIG_MAPPING

from qn_hf.check.inputs import dummy_batch, probe_loss
from qn_hf.check.run import _reference, _state, amplification, build
from qn_hf.check.shrink import shrink_config
from tests import any_model_cases


def _amplification(model_type: str, cls: str) -> float:
    config = shrink_config(CONFIG_MAPPING[model_type]())
    plain = build(config, seed=0, name=cls)
    exact = copy.deepcopy(plain).double()
    batches = [{k: v for k, v in dummy_batch(plain, rows=4, seed=1 + s).items() if k != "labels"} for s in range(2)]
    wide = [{k: v.double() if v.is_floating_point() else v for k, v in b.items()} for b in batches]
    plain_losses, _ = _reference(plain, batches, builtin=False, probe=probe_loss)
    exact_losses, _ = _reference(exact, wide, builtin=False, probe=probe_loss)
    return amplification(plain=_state(plain), exact=_state(exact), plain_losses=plain_losses, exact_losses=exact_losses)


def test_a_models_amplification_of_rounding_is_its_float32_distance_from_float64():
    assert _amplification("bert", "BertModel") == 1.0  # reproducible in float32: the float64 tolerances are 2**-29 x 16 x
    # LeViT after an lr=1 step (running variances of 1e6): its own float32 step is thousands of tolerances away
    assert _amplification("levit", "LevitModel") > 1e3


@pytest.mark.core
def test_float32_rounding_alone_is_equal_in_float64_and_another_computation_is_not(worlds):
    # SeedOss's classifier at dp=2: the plain model's own step over the two halves of the batch is 2e-4 from its
    # whole-batch step in float32 (the embedding of the pooled eos token), 1e-15 in float64
    equal = worlds.run(2, any_model_cases.judged_step, model_type="seed_oss", cls="SeedOssForSequenceClassification",
                       dp=2)[0]
    assert equal["verdict"] == "equal" and equal["reason"].startswith("in float64 (float32 rounding alone)"), equal
    # the same step with one weight moved by 1e-3 before it: apart in float32 and in float64 alike
    shifted = worlds.run(2, any_model_cases.judged_step, model_type="seed_oss", cls="SeedOssForSequenceClassification",
                         dp=2, shift=1e-3)[0]
    assert shifted["verdict"] == "different" and "in float64 too" in shifted["reason"], shifted
