"""Checkpoints written by an earlier qn_hf still load: ``tests/data/checkpoint_v1`` was saved at
(dp, tp, pp) = (1, 2, 2) before the checkpoint code was reorganised (see ``make_checkpoint_v1.py``
beside it). Loaded at other meshes it gives exactly the saved weights, its optimizer state resumes
the run (the next step equals the one the saving run took), and ``qn-hf-convert`` reads it."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file
from transformers import GPT2Config, GPT2LMHeadModel

import qn_hf
from qn_hf import convert
from tests.cases import mesh_for
from tests.models import dp_slice, make_batch

DATA = Path(__file__).parent / "data" / "checkpoint_v1"
CKPT = str(DATA / "checkpoint")


def _weights(directory: str) -> dict[str, torch.Tensor]:
    return {n: p.detach() for n, p in GPT2LMHeadModel.from_pretrained(directory).named_parameters()}


def case_resume(*, dp: int, tp: int, pp: int, out: str) -> dict:
    torch.manual_seed(99)  # other initial weights than the saved ones: everything must come from the checkpoint
    model = GPT2LMHeadModel(GPT2Config.from_pretrained(str(DATA / "hf")))
    pm = qn_hf.parallelize(model, dp=dp, tp=tp, pp=pp, microbatches=2, mesh=mesh_for(dp, tp, pp), seed=0)
    opt = torch.optim.AdamW(pm.parameters(), lr=1e-3, weight_decay=0.01)
    meta = pm.load_checkpoint(CKPT, optimizer=opt)
    pm.save_pretrained(out + "-loaded")
    pm.train_step(dp_slice(make_batch("gpt2", size=4, seed=8), dp=dp, dp_rank=pm.coords["dp"]))
    opt.step()
    pm.save_pretrained(out + "-step2")
    return {"step": meta["step"], "mesh": meta["mesh"]}


@pytest.mark.parametrize(("dp", "tp", "pp"), [(1, 1, 1), (2, 2, 1), (1, 1, 2)])
def test_v1_checkpoint_loads_and_resumes(worlds, tmp_path, dp, tp, pp):
    out = str(tmp_path / "run")
    metas = worlds.run(dp * tp * pp, case_resume, dp=dp, tp=tp, pp=pp, out=out)
    assert all(m == {"step": 1, "mesh": {"dp": 1, "tp": 2, "pp": 2}} for m in metas), metas
    saved, loaded = _weights(str(DATA / "hf")), _weights(out + "-loaded")
    for name, value in saved.items():
        assert torch.equal(loaded[name], value), name
    expected, resumed = _weights(str(DATA / "hf-step2")), _weights(out + "-step2")
    worst = max(((resumed[n] - v).abs().max().item(), n) for n, v in expected.items())
    assert worst[0] < 2e-5, worst
    assert any(not torch.equal(expected[n], saved[n]) for n in saved)  # the step moved the weights


def test_v1_checkpoint_converts(tmp_path):
    with pytest.warns(UserWarning, match="written before qn_hf sealed its indexes"):  # its index cannot be verified
        assert convert.main(["to-hf", CKPT, str(tmp_path / "hf")]) == 0
    written = load_file(str(tmp_path / "hf" / "model.safetensors"))
    saved = _weights(str(DATA / "hf"))
    assert set(written) == {n for n in saved if n != "lm_head.weight"}  # tied: saved once, as HF saves it
    for name, value in written.items():
        assert torch.equal(value, saved[name]), name
    assert convert.main(["reshard", CKPT, str(tmp_path / "tp1"), "--tp", "1", "--pp", "1"]) == 0
    assert convert.main(["to-hf", str(tmp_path / "tp1"), str(tmp_path / "hf1")]) == 0
    # The saved config names no architecture, so the layout is the base model's: names without "transformer."
    for name, value in load_file(str(tmp_path / "hf1" / "model.safetensors")).items():
        assert torch.equal(value, saved.get(name, saved.get("transformer." + name))), name
