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


def test_the_floor_of_a_model_with_batch_statistics_is_its_step_over_its_rows_reversed():
    # BatchNorm's statistics are the whole batch's in any order of its rows: the same step in float64, its sums in
    # another order (a model's halves would normalize by their own statistics instead)
    config = shrink_config(CONFIG_MAPPING["resnet"](embedding_size=16, hidden_sizes=[16, 32], depths=[1, 1],
                                                    layer_type="basic"))
    batches = [{k: v.double() for k, v in dummy_batch(build(config, seed=0, name="ResNetModel"), rows=4,
                                                      seed=1 + s).items() if k != "labels"} for s in range(2)]
    runs = [_reference(build(config, seed=0, name="ResNetModel").double(), batches, builtin=False, probe=probe_loss,
                       reverse=reverse)[0] for reverse in (False, True)]
    assert all(abs(a - b) <= 1e-12 * abs(a) for a, b in zip(*runs)), runs
    halves = _reference(build(config, seed=0, name="ResNetModel").double(), batches, builtin=False, probe=probe_loss,
                        parts=2)[0]
    assert abs(halves[0] - runs[0][0]) > 1e-6 * abs(runs[0][0]), (halves, runs)  # its halves' statistics differ


@pytest.mark.long
def test_a_float32_island_beside_batch_statistics_is_judged_by_the_rows_reversed(worlds):
    # PP-OCRv5's recognizer takes a float32 softmax whatever the dtype, beside its BatchNorm: in float64 the plain
    # step with its rows reversed is 4e-5 from the plain step, as qn_hf's dp=2 step is
    verdict = worlds.run(2, any_model_cases.judged_step, model_type="pp_ocrv5_server_rec", cls="PPOCRV5ServerRecModel",
                         dp=2, timeout=480)[0]
    assert verdict["verdict"] == "equal" and verdict["reason"].startswith("in float64"), verdict
