"""Sharded checkpoints: save at one mesh, resume at another, same weights as never stopping."""

from __future__ import annotations

import os

import pytest
import torch

import qn_hf
from qn_hf import convert
from qn_hf.checkpoint.format import checkpoint_dir, read_index
from tests.cases import mesh_for
from tests.models import dp_slice, load, make_batch

SAVED_AT = (2, 2, 2)
RESUME_AT = [(1, 1, 1), (1, 2, 1), (1, 1, 2), (4, 1, 1), (1, 4, 2)]
LR = 1e-3


def _optimizer(pm):
    return torch.optim.AdamW(pm.parameters(), lr=LR, weight_decay=0.01)


def _step(pm, opt, kind: str, seed: int) -> float:
    opt.zero_grad()
    batch = dp_slice(make_batch(kind, size=8, seed=seed, padded=kind != "vit"), dp=pm.dims.dp, dp_rank=pm.coords["dp"])
    loss = pm.train_step(batch)
    opt.step()
    return loss.item()


def case_train_save_continue(*, kind: str, model_dir: str, ckpt: str, out: str) -> float:
    dp, tp, pp = SAVED_AT
    pm = qn_hf.parallelize(load(kind, model_dir), dp=dp, tp=tp, pp=pp, microbatches=2, mesh=mesh_for(dp, tp, pp))
    opt = _optimizer(pm)
    _step(pm, opt, kind, seed=1)
    pm.save_checkpoint(ckpt, optimizer=opt, step=1)
    pm.save_pretrained(out + "-step1")  # what to-hf of the checkpoint must give
    loss = _step(pm, opt, kind, seed=2)
    pm.save_pretrained(out)
    return loss


def case_resume(*, kind: str, model_dir: str, ckpt: str, out: str, dp: int, tp: int, pp: int) -> dict:
    pm = qn_hf.parallelize(load(kind, model_dir), dp=dp, tp=tp, pp=pp, microbatches=2, mesh=mesh_for(dp, tp, pp))
    opt = _optimizer(pm)
    meta = pm.load_checkpoint(ckpt, optimizer=opt)
    loss = _step(pm, opt, kind, seed=2)
    pm.save_pretrained(out)
    return {"meta": meta, "loss": loss}


# the suite's time (issue 65): a classifier checkpoint moves between meshes in test_any_model (BERT), and
# ViT's is converted at tp=2 x pp=2 below
@pytest.mark.parametrize("kind", ["gpt2", "llama", pytest.param("vit", marks=pytest.mark.long)])
def test_resume_at_any_mesh(worlds, model_dirs, tmp_path, kind):
    ckpt, uninterrupted = str(tmp_path / "ckpt"), str(tmp_path / "uninterrupted")
    expected_loss = worlds.run(8, case_train_save_continue, kind=kind,
                               model_dir=model_dirs[kind], ckpt=ckpt, out=uninterrupted)[0]
    reference = dict(load(kind, uninterrupted).named_parameters())

    # to-hf: the sharded checkpoint becomes a HF directory equal to the gathered weights
    assert convert.main(["to-hf", ckpt, str(tmp_path / "to-hf")]) == 0
    exported, gathered = load(kind, str(tmp_path / "to-hf")), load(kind, uninterrupted + "-step1")
    assert all(torch.equal(a, b) for a, b in zip(exported.state_dict().values(), gathered.state_dict().values()))
    # reshard offline to (tp=4, pp=2); resuming from it must match too (optimizer state included)
    assert convert.main(["reshard", ckpt, str(tmp_path / "resharded"), "--tp", "4", "--pp", "2"]) == 0

    for dp, tp, pp, source in [(*mesh, ckpt) for mesh in RESUME_AT] + [(1, 4, 2, str(tmp_path / "resharded"))]:
        out = str(tmp_path / f"resumed-{dp}-{tp}-{pp}-{os.path.basename(source)}")
        results = worlds.run(dp * tp * pp, case_resume, kind=kind, model_dir=model_dirs[kind],
                             ckpt=source, out=out, dp=dp, tp=tp, pp=pp)
        assert results[0]["meta"]["step"] == 1
        assert abs(results[0]["loss"] - expected_loss) <= 1e-5 * abs(expected_loss), (dp, tp, pp)
        resumed = dict(load(kind, out).named_parameters())
        err = max((resumed[n] - p).abs().max().item() for n, p in reference.items())
        assert err < 2e-5, f"resumed at {(dp, tp, pp)}: max weight difference {err}"


def case_start_from_converted(*, kind: str, model_dir: str, ckpt: str, out: str) -> None:
    pm = qn_hf.parallelize(load(kind, model_dir), tp=2, pp=2, mesh=mesh_for(1, 2, 2))
    with torch.no_grad():
        for p in pm.parameters():
            p.zero_()  # whatever is in the model must come from the checkpoint
    assert pm.load_checkpoint(ckpt)["mesh"] == {"dp": 1, "tp": 2, "pp": 2}
    pm.save_pretrained(out)


@pytest.mark.parametrize("kind", ["gpt2", "llama", "vit"])
def test_from_hf_then_load_equals_the_hf_model(worlds, model_dirs, tmp_path, kind):
    ckpt, out = str(tmp_path / "ckpt"), str(tmp_path / "out")
    assert convert.main(["from-hf", model_dirs[kind], ckpt, "--tp", "2", "--pp", "2"]) == 0
    worlds.run(4, case_start_from_converted, kind=kind, model_dir=model_dirs[kind], ckpt=ckpt, out=out)
    original, loaded = load(kind, model_dirs[kind]).state_dict(), load(kind, out).state_dict()
    assert original.keys() == loaded.keys()
    assert all(torch.equal(original[k], loaded[k]) for k in original)


# (pp, virtual_stages) -> the schedule and microbatches that run it
def _pipeline(pp: int, virtual: int) -> dict:
    if virtual > 1:
        return {"pp": pp, "schedule": "interleaved_1f1b", "virtual_stages": virtual, "microbatches": 2}
    return {"pp": pp, "microbatches": 2}


def case_chunks_save(*, model_dir: str, ckpt: str, out: str, pp: int, virtual: int, steps: int) -> list[float]:
    """AdamW steps at pp x virtual chunks, a checkpoint after the first, then the rest."""
    pm = qn_hf.parallelize(load("gpt2_deep", model_dir), mesh=mesh_for(1, 1, pp), **_pipeline(pp, virtual))
    opt = _optimizer(pm)
    losses = [_step(pm, opt, "gpt2_deep", seed=1)]
    pm.save_checkpoint(ckpt, optimizer=opt, step=1)
    losses += [_step(pm, opt, "gpt2_deep", seed=2 + i) for i in range(steps - 1)]
    pm.save_pretrained(out)
    return losses


def case_chunks_resume(*, model_dir: str, ckpt: str, out: str, pp: int, virtual: int) -> dict:
    pm = qn_hf.parallelize(load("gpt2_deep", model_dir), mesh=mesh_for(1, 1, pp), **_pipeline(pp, virtual))
    opt = _optimizer(pm)
    meta = pm.load_checkpoint(ckpt, optimizer=opt)
    loss = _step(pm, opt, "gpt2_deep", seed=2)
    pm.save_pretrained(out)
    return {"meta": meta, "loss": loss}


def test_resume_across_virtual_stages(worlds, model_dirs, tmp_path):
    """Saved at pp=2 x 2 chunks (GPT-2, 8 blocks, tied embedding, AdamW): resumed at pp=4, pp=1 and
    pp=2 x 4 chunks, and from a pp=4 checkpoint at pp=2 x 2 chunks; each next step equals the
    uninterrupted run. The index records the chunks; an offline reshard lays files out for them."""
    model_dir, ckpt = model_dirs["gpt2_deep"], str(tmp_path / "ckpt")
    uninterrupted = str(tmp_path / "uninterrupted")
    expected = worlds.run(2, case_chunks_save, model_dir=model_dir, ckpt=ckpt,
                          out=uninterrupted, pp=2, virtual=2, steps=2)[0][1]
    reference = dict(load("gpt2_deep", uninterrupted).named_parameters())
    index = read_index(checkpoint_dir(ckpt))
    assert index["mesh"] == {"dp": 1, "tp": 1, "pp": 2, "virtual_stages": 2}
    plain = str(tmp_path / "ckpt-pp4")
    worlds.run(4, case_chunks_save, model_dir=model_dir, ckpt=plain,
               out=str(tmp_path / "unused"), pp=4, virtual=1, steps=1)
    assert convert.main(["reshard", ckpt, str(tmp_path / "resharded"), "--tp", "1", "--pp", "2",
                         "--virtual-stages", "4"]) == 0
    for pp, virtual, source in [(4, 1, ckpt), (1, 1, ckpt), (2, 4, str(tmp_path / "resharded")), (2, 2, plain)]:
        out = str(tmp_path / f"resumed-{pp}-{virtual}-{os.path.basename(source)}")
        result = worlds.run(pp, case_chunks_resume, model_dir=model_dir, ckpt=source, out=out,
                            pp=pp, virtual=virtual)[0]
        assert result["meta"]["step"] == 1
        if source == plain:  # its first step ran 1F1B at pp=4 on the same batch: equal up to AdamW's
            assert abs(result["loss"] - expected) <= 1e-3 * abs(expected)  # sign of near-zero gradients
            continue
        assert abs(result["loss"] - expected) <= 1e-5 * abs(expected), (pp, virtual)
        resumed = dict(load("gpt2_deep", out).named_parameters())
        err = max((resumed[n] - p).abs().max().item() for n, p in reference.items())
        assert err < 2e-5, f"resumed at pp={pp} x {virtual}: max weight difference {err}"


def test_converter_refuses_chunks_a_run_would_refuse(model_dirs, tmp_path, capsys):
    ckpt = convert.from_hf(model_dirs["gpt2_deep"], str(tmp_path / "ckpt"), tp=1, pp=2)
    for pp, virtual, message in [(1, 2, "needs pp >= 2"), (2, 0, "virtual_stages")]:
        assert convert.main(["reshard", ckpt, str(tmp_path / "out"), "--tp", "1", "--pp", str(pp),
                             "--virtual-stages", str(virtual)]) == 2
        assert message in capsys.readouterr().err
