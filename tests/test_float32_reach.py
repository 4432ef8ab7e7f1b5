"""The check's float64 judgment (qn_hf.check.run.within_float32_reach): where the plain float32 model is itself
beyond the tolerances from its float64 step (an ill-conditioned model), a parallel run as close to the float64
step as the plain one is equal, one farther away is not; a well-conditioned model is never judged this way."""

from __future__ import annotations

import copy

import pytest
import torch
from transformers import CONFIG_MAPPING

from qn_hf.check.inputs import dummy_batch, probe_loss
from qn_hf.check.run import FLOAT32_REACH, build, within_float32_reach
from qn_hf.check.shrink import shrink_config


def _plain_run(model_type: str, cls: str):
    config = shrink_config(CONFIG_MAPPING[model_type]())
    model = build(config, seed=0, name=cls)
    initial = copy.deepcopy(model)
    batches = [{k: v for k, v in dummy_batch(model, rows=4, seed=1 + s).items() if k != "labels"} for s in range(2)]
    optimizer = torch.optim.SGD(model.parameters(), lr=1.0)
    losses = []
    for batch in batches:
        optimizer.zero_grad()
        loss = probe_loss(model(**batch), batch)
        loss.backward()
        optimizer.step()
        losses.append(loss.item())
    return initial, model, batches, losses


def _state(model):
    return {n: p.detach().clone() for n, p in model.state_dict().items() if p.is_floating_point()}


@pytest.mark.parametrize(("model_type", "cls"), [("levit", "LevitModel")])
def test_an_ill_conditioned_model_is_judged_by_its_float64_step(model_type, cls):
    initial, plain, batches, losses = _plain_run(model_type, cls)
    judge = dict(batches=batches, builtin=False, plain=plain, plain_losses=losses)
    same = within_float32_reach(copy.deepcopy(initial), losses=losses, export=_state(plain), **judge)
    assert same and same.startswith("within float32's reach")
    # a run farther from the float64 step than FLOAT32_REACH times the plain one's gap is not rescued
    far = _state(plain)
    exact = copy.deepcopy(initial)
    assert within_float32_reach(exact, losses=losses, export=far, **judge) is not None
    name = next(n for n in far if n.endswith("weight"))
    far[name] = far[name] + 10 * FLOAT32_REACH * (far[name].abs().max() + 1)
    assert within_float32_reach(copy.deepcopy(initial), losses=losses, export=far, **judge) is None
    assert within_float32_reach(copy.deepcopy(initial), losses=[x * 1.5 for x in losses], export=_state(plain),
                                **judge) is None


def test_a_well_conditioned_model_is_never_judged_by_float64():
    initial, plain, batches, losses = _plain_run("bert", "BertModel")
    assert within_float32_reach(copy.deepcopy(initial), batches=batches, builtin=False, plain=plain,
                                plain_losses=losses, losses=losses, export=_state(plain)) is None
