"""qn_hf.optimizer: ZeRO-1 equals the unsharded optimizer; its checkpoints reshard; misuse is refused."""

from __future__ import annotations

import pytest
from torch import nn

from qn_hf.config.features import Feature, Status
from qn_hf.memory.recompute import check_recompute
from tests import optim_cases
from tests.models import load

ZERO_CASES = [  # kind, dp, tp, pp, optimizer, schedule
    ("gpt2", 2, 2, 2, "AdamW", "1f1b"),  # tied embedding across stages, vocab padding
    ("llama", 2, 2, 1, "SGD", "1f1b"),  # SGD also against the plain model
    ("gpt2", 2, 1, 2, "SGD", "gpipe"),
    ("llama", 4, 1, 1, "AdamW", "1f1b"),
    ("gpt2", 2, 1, 2, "SGD", "zb_h1"),  # pieces bound by the weight passes; against the plain model
    ("llama", 2, 1, 2, "AdamW", "interleaved_1f1b"),
]


@pytest.mark.composes((Feature.PP_GPIPE, Feature.ZERO), case="gpt2-2-1-2-SGD-gpipe")
@pytest.mark.composes((Feature.PP_ZB_H1, Feature.ZERO), case="gpt2-2-1-2-SGD-zb_h1")
@pytest.mark.composes(
    (Feature.PP_INTERLEAVED, Feature.ZERO), case="llama-2-1-2-AdamW-interleaved_1f1b", status=Status.EQUIVALENT)
@pytest.mark.composes((Feature.TP, Feature.ZERO), (Feature.DP, Feature.ZERO), case="llama-2-2-1-SGD-1f1b")
@pytest.mark.parametrize(("kind", "dp", "tp", "pp", "opt_name", "schedule"), ZERO_CASES)
def test_zero_equals_the_unsharded_optimizer(worlds, model_dirs, kind, dp, tp, pp, opt_name, schedule):
    results = worlds.run(dp * tp * pp, optim_cases.zero_parity, kind=kind, model_dir=model_dirs[kind], dp=dp,
                         tp=tp, pp=pp, microbatches=2, opt_name=opt_name, schedule=schedule)
    for r in results:
        # Equal to float32 rounding, not bit for bit: the gradient norm the clip divides by is summed over
        # reduce-scattered pieces with ZeRO and over whole gradients without, and dp=4's reduce-scatter adds in
        # another order than its all-reduce; which last bits that moves depends on the CPU's vector width
        # (bit-equal on the machine these tests were first run on, 1.8e-7 apart on an AVX-512 one). Still
        # 20 times tighter than the plain-model bounds (1e-5 loss, 2e-5 weights).
        for loss, unsharded in zip(r["losses"], r["losses_unsharded"]):
            assert abs(loss - unsharded) <= 1e-6 * abs(unsharded), r
        assert r["weight_diff_unsharded"] <= 1e-6, r
        # 1/dp of the state (each bucket is padded to a multiple of dp)
        assert r["state_bytes"] * dp <= r["state_bytes_unsharded"] + 64 * dp * 8, r
        assert r["state_bytes"] * dp >= r["state_bytes_unsharded"], r
        if opt_name == "SGD":
            for loss, ref in zip(r["losses"], r["ref_losses"]):
                assert abs(loss - ref) <= 1e-5 * abs(ref), r
            assert r["weight_diff_ref"] < 2e-5, r


@pytest.mark.parametrize(("kind", "precision"), [("gpt2", None), ("llama", "bf16")])
def test_zero_checkpoint_resumes_at_other_meshes(worlds, model_dirs, tmp_path, kind, precision):
    ckpt, out = str(tmp_path / "ckpt"), str(tmp_path / "uninterrupted")
    loss = worlds.run(4, optim_cases.save_and_continue, kind=kind, model_dir=model_dirs[kind], ckpt=ckpt,
                      out=out, dp=2, tp=2, pp=1, zero=True, precision=precision)[0]
    expected = dict(load(kind, out).named_parameters())
    # bf16 weights after a step at another mesh differ by float rounding: one bf16 step at |w| < 0.125
    tol = 2e-5 if precision is None else 2 ** -9
    meshes = [(2, 2, 1, True), (4, 1, 1, True), (1, 2, 2, False)] + ([(2, 1, 2, None)] if precision is None else [])
    for dp, tp, pp, zero in meshes:
        resumed = str(tmp_path / f"resumed-{dp}-{tp}-{pp}-{zero}")
        r = worlds.run(dp * tp * pp, optim_cases.resume, kind=kind, model_dir=model_dirs[kind], ckpt=ckpt,
                       out=resumed, dp=dp, tp=tp, pp=pp, zero=zero, precision=precision)[0]
        assert r["step"] == 2
        assert abs(r["loss"] - loss) <= (1e-5 if precision is None else 1e-4) * loss, (dp, tp, pp, zero, r, loss)
        got = dict(load(kind, resumed).named_parameters())
        err = max((got[n].float() - p.float()).abs().max().item() for n, p in expected.items())
        assert err <= (0.0 if (dp, tp, pp) == (2, 2, 1) else tol), (dp, tp, pp, zero, err)


def test_misuse_is_refused(worlds, model_dirs):
    r = worlds.run(2, optim_cases.bad_input, model_dir=model_dirs["llama"])[0]
    assert "Adafactor is not one of them: use zero=False" in r["adafactor"], r
    assert "Muon is not one of them" in r["muon"], r
    assert "not a torch.optim.Optimizer subclass" in r["not_a_class"], r
    assert "not a trainable parameter of this ParallelModel" in r["foreign"], r
    assert "mixed_precision='fp8' is unknown; use one of ('bf16', 'fp16')" in r["precision"], r
    assert "recompute='some' is unknown; use one of ('full', 'selective')" in r["recompute"], r
    assert "already has a qn_hf.optimizer" in r["second"], r
    assert "call optimizer.zero_grad() after each optimizer.step()" in r["no_zero_grad"], r
    assert "build the optimizer with qn_hf.optimizer(pm, torch.optim.AdamW" in r["mixed_without_optimizer"], r


def test_recompute_needs_checkpointable_blocks():
    model = nn.Module()
    model.layers = nn.ModuleList([nn.Linear(2, 2)])
    with pytest.raises(ValueError, match="Linear \\(in layers\\) is not a transformers GradientCheckpointingLayer"):
        check_recompute(model, recompute="full", layers="layers")


def test_one_process_api(worlds, model_dirs):
    r = worlds.run(1, optim_cases.one_process_api, model_dir=model_dirs["llama"])[0]
    assert r["zero_warning"] and r["lr"] == pytest.approx(5e-4) and r["inner_lr"] == pytest.approx(5e-4), r
    assert r["state_dict_keys"] >= {"state", "param_groups", "qn_hf"} and r["restored"], r
    assert r["bf16_warning"], r


@pytest.mark.parametrize(("dp", "tp", "zero"), [(2, 1, False), (2, 1, True), (1, 2, False)])
def test_skip_nonfinite_skips_on_every_rank(worlds, model_dirs, dp, tp, zero):
    """A NaN in one rank's gradients: every rank skips the step (weights and optimizer state as they
    were), counted in skipped_steps; the next finite step is taken."""
    for r in worlds.run(dp * tp, optim_cases.skip_nonfinite_case, kind="llama", model_dir=model_dirs["llama"],
                        dp=dp, tp=tp, zero=zero):
        assert r == {"unchanged": True, "skipped": 1, "state_after_skip": 0, "moved": True, "skipped_after": 1}, r
