"""After parallelize, a pipeline rank holds only its stage's modules; the rest are freed."""

from __future__ import annotations

import gc
import weakref

import torch

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


def case_save_replaces_other_layout(*, gpt2_dir: str, out_dir: str) -> list[str]:
    import os

    import torch.distributed as dist
    from safetensors.torch import save_file

    if dist.get_rank() == 0:
        os.makedirs(out_dir, exist_ok=True)
        save_file({"stale": torch.zeros(1)}, os.path.join(out_dir, "model.safetensors"))  # an earlier pp=1 save
    dist.barrier()
    pm = qn_hf.parallelize(load("gpt2", gpt2_dir), pp=2, mesh=mesh_for(1, 1, 2))
    pm.save_pretrained(out_dir)
    return sorted(os.listdir(out_dir))


def test_save_replaces_a_stale_layout(worlds, model_dirs, tmp_path):
    files = worlds.run(2, "tests.test_pipeline_split:case_save_replaces_other_layout", gpt2_dir=model_dirs["gpt2"],
                       out_dir=str(tmp_path / "out"))[0]
    assert "model.safetensors" not in files
    assert {"model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors", "model.safetensors.index.json"} <= set(files)
    reloaded = load("gpt2", str(tmp_path / "out"))
    reference = load("gpt2", model_dirs["gpt2"])
    assert all(torch.equal(a, b) for a, b in zip(reloaded.state_dict().values(), reference.state_dict().values()))
