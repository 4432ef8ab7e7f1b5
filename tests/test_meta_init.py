"""A model built on the meta device and filled from a checkpoint: each rank reads only its shard."""

from __future__ import annotations

import pytest
import torch
from transformers import AutoConfig

import qn_hf
from qn_hf import convert
from tests.cases import mesh_for
from tests.models import auto_class, load, make_batch


def case_meta(*, kind: str, model_dir: str, checkpoint: str, out: str, tp: int, pp: int) -> dict:
    config = AutoConfig.from_pretrained(model_dir)
    with torch.device("meta"):
        model = auto_class(kind).from_config(config)
    pm = qn_hf.parallelize(model, tp=tp, pp=pp, checkpoint=checkpoint, mesh=mesh_for(1, tp, pp))
    on_meta = [n for n, p in pm.named_parameters() if p.is_meta] + [n for n, b in pm.module.named_buffers() if b.is_meta]
    batch = make_batch(kind, size=2, seed=4)
    loss = pm.eval_step(batch).item()
    pm.save_pretrained(out)
    ref = load(kind, model_dir).eval()
    with torch.no_grad():
        ref_loss = ref(**batch).loss.item()
    return {"on_meta": on_meta, "loss": loss, "ref_loss": ref_loss}


@pytest.mark.parametrize(("kind", "tp", "pp", "source"), [
    ("llama", 2, 2, "hf"), ("gpt2", 2, 2, "hf"), ("vit", 2, 1, "hf"), ("llama", 1, 2, "qn_hf"),
])
def test_meta_model_from_checkpoint(worlds, model_dirs, tmp_path, kind, tp, pp, source):
    checkpoint = model_dirs[kind]
    if source == "qn_hf":  # a checkpoint at another mesh than the one loading it
        checkpoint = str(tmp_path / "ckpt")
        assert convert.main(["from-hf", model_dirs[kind], checkpoint, "--tp", "2", "--pp", "1"]) == 0
    out = str(tmp_path / "out")
    for r in worlds.run(tp * pp, case_meta, kind=kind, model_dir=model_dirs[kind],
                        checkpoint=checkpoint, out=out, tp=tp, pp=pp):
        assert r["on_meta"] == [], r
        assert abs(r["loss"] - r["ref_loss"]) <= 1e-5 * abs(r["ref_loss"]), r
    original, loaded = load(kind, model_dirs[kind]).state_dict(), load(kind, out).state_dict()
    assert all(torch.equal(original[k], loaded[k]) for k in original)
