"""``ParallelConfig`` is the one value that travels: ``parallelize(model, config)`` builds exactly what
the same keywords build, and a keyword beside a config is refused before any process group exists."""

from __future__ import annotations

import dataclasses

import pytest
import torch

import qn_hf
from qn_hf.config.options import Precision
from qn_hf.config.parallel_config import ParallelConfig
from tests.cases import mesh_for
from tests.models import load, make_batch
from tests.test_plan import tiny


def test_the_keyword_constructor_is_the_one_home_of_the_checks():
    config = ParallelConfig(dp=2, tp=2, microbatches=4, mixed_precision="bf16", recompute="full")
    assert config == ParallelConfig.from_keywords(**config.keywords())
    assert config.dims.world_size == 4 and config.mixed_precision is Precision.BF16
    assert dataclasses.replace(config, microbatches=2).microbatches == 2  # replace goes through the same checks
    with pytest.raises(ValueError, match="microbatches=0 must be a positive integer"):
        dataclasses.replace(config, microbatches=0)
    with pytest.raises(ValueError, match=r"give the degrees once, as dims or as keywords"):
        ParallelConfig(dims=config.dims, tp=2)
    assert set(ParallelConfig.keyword_names()) == set(config.keywords())


def test_keywords_beside_a_config_are_refused_before_any_process_group():
    config = ParallelConfig(tp=2)
    with pytest.raises(ValueError, match=r"parallelize\(model, config, microbatches, tp=...\): the config already"):
        qn_hf.parallelize(tiny("gpt2"), config, tp=2, microbatches=2)
    with pytest.raises(ValueError, match=r"config=\{'tp': 2\} must be a qn_hf.ParallelConfig"):
        qn_hf.parallelize(tiny("gpt2"), {"tp": 2})
    assert not torch.distributed.is_initialized()


def case_config_equals_keywords(*, model_dir: str) -> dict:
    batch = make_batch("llama", size=4, seed=3)
    losses, weights = [], []
    for build in (lambda m: qn_hf.parallelize(m, tp=2, microbatches=2, schedule="gpipe", mesh=mesh_for(1, 2)),
                  lambda m: qn_hf.parallelize(m, ParallelConfig(tp=2, microbatches=2, schedule="gpipe"),
                                              mesh=mesh_for(1, 2))):
        pm = build(load("llama", model_dir))
        opt = torch.optim.SGD(pm.parameters(), lr=0.1)
        losses.append(pm.train_step(batch).item())
        opt.step()
        weights.append({n: p.detach().clone() for n, p in pm.named_parameters()})
        config = pm.parallel_config
    same = all(torch.equal(weights[0][n], weights[1][n]) for n in weights[0])
    return {"losses": losses, "same weights": same, "config": config == ParallelConfig(tp=2, microbatches=2,
                                                                                       schedule="gpipe")}


def test_a_config_trains_as_its_keywords_do(worlds, model_dirs):
    for r in worlds.run(2, case_config_equals_keywords, model_dir=model_dirs["llama"]):
        assert r["losses"][0] == r["losses"][1] and r["same weights"] and r["config"], r
