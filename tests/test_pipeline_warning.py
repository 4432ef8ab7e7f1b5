"""Fewer microbatches than stages leave most of every step idle: rank 0 says so, once."""

from __future__ import annotations

import warnings

import qn_hf
from tests.cases import mesh_for
from tests.models import load


def case_parallelize_warnings(*, model_dir: str, microbatches: int) -> list[str]:
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        qn_hf.parallelize(load("gpt2", model_dir), pp=2, microbatches=microbatches, mesh=mesh_for(1, 1, 2))
    return [str(w.message) for w in caught if "microbatches" in str(w.message)]


def test_too_few_microbatches_warn_once_on_rank_0(worlds, model_dirs):
    few = worlds.run(2, case_parallelize_warnings, model_dir=model_dirs["gpt2"], microbatches=1)
    assert len(few[0]) == 1 and few[1] == [], few
    assert few[0][0].startswith("microbatches=1 < pp=2: each stage idles 50% of a step"), few[0]
    enough = worlds.run(2, case_parallelize_warnings, model_dir=model_dirs["gpt2"],
                        microbatches=4)
    assert enough == [[], []]
