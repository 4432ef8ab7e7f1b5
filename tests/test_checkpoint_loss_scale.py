"""float16's loss scale is training state: a checkpoint saves it and a load restores it (issue 46,
item 8), so a resumed fp16 run overflows, skips and scales exactly as the uninterrupted one, also
at another mesh; and what a load does with a checkpoint of another precision, or of an older qn_hf."""

from __future__ import annotations

import warnings
from pathlib import Path

import torch

import qn_hf
from tests.cases import mesh_for
from tests.models import dp_slice, load, make_batch

STEPS, SAVED_AFTER = 8, 4
# Two good steps double the scale: from 2**17 the tiny Llama's scaled gradients overflow float16 at
# 2**18 on some steps and not others, so the scale moves up and down and steps are skipped before and
# after the save. A resume that forgets any of it (scale, good steps, interval, skip count) skips other
# steps than the uninterrupted run (without the restore: step 5 trains, and steps 6 and 7 lose otherwise).
GROWTH_INTERVAL, START_SCALE = 2, 2.0**17
V1 = str(Path(__file__).parent / "data" / "checkpoint_v1" / "checkpoint")


def _fp16(model_dir: str, *, dp: int, tp: int):
    pm = qn_hf.parallelize(load("llama", model_dir), dp=dp, tp=tp, mesh=mesh_for(dp, tp), mixed_precision="fp16")
    pm.scaler.growth_interval, pm.scaler.scale = GROWTH_INTERVAL, START_SCALE  # as the run was set up
    return pm, qn_hf.optimizer(pm, torch.optim.AdamW, lr=1e-2)


def _steps(pm, opt, steps: range) -> list[tuple[float, int, float]]:
    """(loss, skipped steps so far, scale after the step) of each step."""
    out = []
    for step in steps:
        opt.zero_grad()
        batch = dp_slice(make_batch("llama", size=4, seed=100 + step, padded=True), dp=pm.dims.dp,
                         dp_rank=pm.coords["dp"])
        loss = pm.train_step(batch).item()
        qn_hf.clip_grad_norm_(pm, 1.0)
        opt.step()
        out.append((loss, opt.skipped_steps, pm.scaler.scale))
    return out


def case_uninterrupted(*, model_dir: str, ckpt: str) -> dict:
    """Every step at tp=2, saving after SAVED_AFTER of them (a save changes nothing in the run)."""
    pm, opt = _fp16(model_dir, dp=1, tp=2)
    first = _steps(pm, opt, range(SAVED_AFTER))
    pm.save_checkpoint(ckpt, optimizer=opt, step=SAVED_AFTER)
    saved = pm.scaler.state()
    return {"steps": first + _steps(pm, opt, range(SAVED_AFTER, STEPS)), "saved": saved}


def case_resume(*, model_dir: str, ckpt: str, dp: int, tp: int) -> dict:
    pm, opt = _fp16(model_dir, dp=dp, tp=tp)
    meta = pm.load_checkpoint(ckpt, optimizer=opt)
    return {"loaded": pm.scaler.state(), "meta": meta, "steps": _steps(pm, opt, range(SAVED_AFTER, STEPS))}


def test_a_resumed_fp16_run_scales_and_skips_as_the_uninterrupted_one(worlds, model_dirs, tmp_path):
    ckpt, model_dir = str(tmp_path / "ckpt"), model_dirs["llama"]
    run = worlds.run(2, case_uninterrupted, model_dir=model_dir, ckpt=ckpt)[0]
    steps, saved = run["steps"], run["saved"]
    skipped = [s for _, s, _ in steps]
    scales = [scale for _, _, scale in steps]
    # the case is sensitive: steps were skipped before the save and after it, and the scale moved both ways
    assert 0 < saved["skipped_steps"] < skipped[-1], steps
    assert len(set(scales[:SAVED_AFTER])) > 1 and len(set(scales[SAVED_AFTER:])) > 1, steps

    same = worlds.run(2, case_resume, model_dir=model_dir, ckpt=ckpt, dp=1, tp=2)[0]
    assert same["loaded"] == saved and same["meta"]["loss_scaler"] == saved
    assert same["steps"] == steps[SAVED_AFTER:]  # bit for bit: losses, skipped steps, scales

    # at another mesh (dp=2: tp's sums round otherwise in float16) the scale is the same, so are the skips
    other = worlds.run(2, case_resume, model_dir=model_dir, ckpt=ckpt, dp=2, tp=1)
    for rank in other:
        assert rank["loaded"] == saved
        assert [s[1:] for s in rank["steps"]] == [s[1:] for s in steps[SAVED_AFTER:]], (rank["steps"], steps)
        for (loss, _, _), (expected, _, _) in zip(rank["steps"], steps[SAVED_AFTER:]):
            assert abs(loss - expected) <= 2e-3 * expected


def case_across_precisions(*, model_dir: str, root: str) -> dict:
    """A float16 checkpoint into a bf16 run, a bf16 one into a float16 run, and a v1 checkpoint (saved
    before the loss scale was) into a float16 run: what each load gives the scaler, and its warnings."""
    out = {}
    fp16, opt = _fp16(model_dir, dp=1, tp=2)
    fp16.scaler.load_state({**fp16.scaler.state(), "scale": 512.0, "good_steps": 1, "skipped_steps": 3})
    fp16.save_checkpoint(root + "/fp16", optimizer=opt, step=1)
    bf16 = qn_hf.parallelize(load("llama", model_dir), tp=2, mesh=mesh_for(1, 2), mixed_precision="bf16")
    bf16_opt = qn_hf.optimizer(bf16, torch.optim.AdamW, lr=1e-2)
    out["fp16 into bf16"] = bf16.load_checkpoint(root + "/fp16", optimizer=bf16_opt)["loss_scaler"]
    bf16.save_checkpoint(root + "/bf16", optimizer=bf16_opt, step=2)
    fresh, fresh_opt = _fp16(model_dir, dp=1, tp=2)
    out["fp16 before"] = fresh.scaler.state()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        fresh.load_checkpoint(root + "/bf16", optimizer=fresh_opt)
        out["bf16 into fp16"] = fresh.scaler.state()
        out["bf16 warnings"] = [str(w.message) for w in caught]
        caught.clear()
        gpt2 = qn_hf.parallelize(load("gpt2", str(Path(V1).parent / "hf")), tp=2, mesh=mesh_for(1, 2),
                                 mixed_precision="fp16")
        gpt2.scaler.scale = 1024.0
        gpt2.load_checkpoint(V1)
        out["v1 into fp16"] = gpt2.scaler.state()
        out["v1 warnings"] = [str(w.message) for w in caught]
    return out


def test_loads_across_precisions_and_from_before_the_loss_scale_was_saved(worlds, model_dirs, tmp_path):
    out = worlds.run(2, case_across_precisions, model_dir=model_dirs["llama"], root=str(tmp_path))[0]
    assert out["fp16 into bf16"]["scale"] == 512.0  # read, and left unused: bf16 needs no scale
    # the run's own starting scale, as a new fp16 run's, without a word
    assert out["bf16 into fp16"] == out["fp16 before"] and out["bf16 warnings"] == [], out
    assert out["fp16 before"]["scale"] == START_SCALE and out["fp16 before"]["skipped_steps"] == 0
    assert out["v1 into fp16"]["scale"] == 1024.0  # no scale saved: the run's own stays, with a warning
    assert any("before qn_hf recorded float16's loss scale" in w for w in out["v1 warnings"]), out["v1 warnings"]
