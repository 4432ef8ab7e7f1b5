"""The FSDP2 reference job (tests/fsdp2_cases.py) is right, so that DCP interchange tests can trust it:
on 2 ranks its two AdamW steps equal the plain model's on the whole global batches, and a fresh FSDP2
job loaded from its DCP checkpoint (each layout) continues exactly as the uninterrupted one."""

from __future__ import annotations

import pytest
import torch
from torch.distributed.checkpoint import FileSystemReader

from tests import fsdp2_cases
from tests.models import load, make_batch

WORLD = 2
_PLAIN: dict[str, dict] = {}


def _plain_two_steps(kind: str, model_dir: str) -> dict:
    """The plain model, one process, the same two steps on the whole global batches (cached per kind)."""
    if kind not in _PLAIN:
        model = load(kind, model_dir).float()
        model.train()
        opt = fsdp2_cases.fsdp2_optimizer(model)
        weights, losses = [], []
        for seed in (1, 2):
            opt.zero_grad()
            loss = model(**make_batch(kind, size=8, seed=seed, padded=False)).loss
            loss.backward()
            opt.step()
            losses.append(loss.item())
            weights.append({n: p.detach().clone() for n, p in model.named_parameters()})
        _PLAIN[kind] = {"losses": losses, "weights": weights}
    return _PLAIN[kind]


def _weight_error(path: str, kind: str, expected: dict[str, torch.Tensor]) -> float:
    got = dict(load(kind, path).named_parameters())
    assert got.keys() == expected.keys()
    return max((got[n] - p).abs().max().item() for n, p in expected.items())


def _keys(path: str) -> set[str]:
    return set(FileSystemReader(path).read_metadata().state_dict_metadata)


def _check_layout(ckpt, layout: str, model) -> None:
    """The flattened DCP keys each layout is known by (one weight, one state tensor, the groups)."""
    name = next(n for n, _ in model.named_parameters())
    if layout == "accelerate":
        weights = _keys(ckpt / fsdp2_cases.ACCELERATE_MODEL_DIR)
        optim = _keys(ckpt / fsdp2_cases.ACCELERATE_OPTIMIZER_DIR)
        assert f"model.{name}" in weights and not any(k.startswith("optimizer.") for k in weights)
        assert {f"optimizer.state.{name}.exp_avg", "optimizer.param_groups.0.lr",
                "optimizer.param_groups.0.params"} <= optim
        assert not any(k.startswith("model.") for k in optim)
        return
    keys = _keys(ckpt)
    assert {f"model.{name}", f"optim.state.{name}.exp_avg", f"optim.state.{name}.step"} <= keys
    if layout == "flat":  # hyperparameters per parameter, no params list
        assert f"optim.param_groups.{name}.lr" in keys and "optim.param_groups.0.params" not in keys
    else:
        assert {"optim.param_groups.0.lr", "optim.param_groups.0.params"} <= keys


@pytest.mark.parametrize("layout", fsdp2_cases.LAYOUTS)
@pytest.mark.parametrize("kind", ["gpt2", "llama"])
def test_fsdp2_reference_equals_plain_and_resumes(worlds, model_dirs, tmp_path, kind, layout):
    model_dir, ckpt, out = model_dirs[kind], tmp_path / "ckpt", str(tmp_path / "fsdp2")
    plain = _plain_two_steps(kind, model_dir)
    losses = worlds.run(WORLD, fsdp2_cases.case_fsdp2_train_save, kind=kind, model_dir=model_dir,
                        ckpt=str(ckpt), out=out, layout=layout)
    assert losses[0] == losses[1]
    expected = plain["losses"][1]
    assert abs(losses[0] - expected) <= 1e-5 * abs(expected), (losses[0], expected)
    assert _weight_error(out + "-step1", kind, plain["weights"][0]) < 2e-5
    assert _weight_error(out, kind, plain["weights"][1]) < 2e-5
    _check_layout(ckpt, layout, load(kind, model_dir))

    resumed = str(tmp_path / "resumed")
    loaded = worlds.run(WORLD, fsdp2_cases.case_fsdp2_load_step, kind=kind, model_dir=model_dir,
                        ckpt=str(ckpt), out=resumed, seed=2, layout=layout)
    # the same shards on the same mesh: the resumed step is the uninterrupted one, bit for bit
    assert loaded[0] == losses[0]
    uninterrupted = dict(load(kind, out).named_parameters())
    assert _weight_error(resumed, kind, uninterrupted) == 0.0
    assert _weight_error(resumed, kind, plain["weights"][1]) < 2e-5


@pytest.mark.parametrize("kind", ["gpt2", "llama"])
def test_fsdp2_gradients_are_the_global_mean_loss(worlds, model_dirs, kind):
    """The gradients themselves (AdamW's steps above would hide a wrong scale): those of the plain
    model's mean loss over the whole global batch."""
    result = worlds.run(WORLD, fsdp2_cases.case_fsdp2_grads, kind=kind, model_dir=model_dirs[kind], seed=1)[0]
    plain = load(kind, model_dirs[kind]).float()
    plain.train()
    loss = plain(**make_batch(kind, size=8, seed=1, padded=False)).loss
    loss.backward()
    expected = {n: p.grad for n, p in plain.named_parameters()}
    assert abs(result["loss"] - loss.item()) <= 1e-6 * abs(loss.item())
    assert result["grads"].keys() == expected.keys()
    assert max((result["grads"][n] - g).abs().max().item() for n, g in expected.items()) < 1e-6
