"""After parallelize, a pipeline rank holds only its stage's modules; the rest are freed."""

from __future__ import annotations

import gc
import weakref

import qn_hf
from tests.cases import mesh_for
from tests.models import load


def case_stage_contents(*, gpt2_dir: str) -> dict:
    model = load("gpt2", gpt2_dir)
    blocks = [weakref.ref(b) for b in model.transformer.h]
    pm = qn_hf.parallelize(model, pp=2, mesh=mesh_for(1, 1, 2))
    gc.collect()
    return {
        "stage": pm.coords["pp"],
        "names": sorted({".".join(n.split(".")[:3]) if ".h." in n else n.rsplit(".", 1)[0] for n, _ in pm.named_parameters()}),
        "blocks alive": [ref() is not None for ref in blocks],
    }


def test_each_stage_keeps_only_its_modules(worlds, model_dirs):
    first, last = worlds.run(2, "tests.test_pipeline_split:case_stage_contents", gpt2_dir=model_dirs["gpt2"])
    assert first["names"] == ["transformer.h.0", "transformer.h.1", "transformer.h.2", "transformer.wpe", "transformer.wte"]
    assert last["names"] == ["lm_head", "transformer.h.3", "transformer.h.4", "transformer.ln_f"]
    assert first["blocks alive"] == [True, True, True, False, False]
    assert last["blocks alive"] == [False, False, False, True, True]
