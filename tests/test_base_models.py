"""Base models (no head, no built-in loss) and user loss functions, against the plain model."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from transformers import AutoModel

import qn_hf
from tests.cases import mesh_for, model_inputs, reference_grad
from tests.models import dp_slice, load, make_batch


def hidden_energy(outputs, batch) -> torch.Tensor:
    return outputs.last_hidden_state.pow(2).mean()


def shifted_ce(outputs, batch) -> torch.Tensor:
    logits = outputs.logits[:, :-1]
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), batch["labels"][:, 1:].reshape(-1))


def case_user_loss(*, kind: str, model_dir: str, base: bool, dp: int, tp: int) -> dict[str, float]:
    loader = (lambda: AutoModel.from_pretrained(model_dir)) if base else (lambda: load(kind, model_dir))
    loss_fn = hidden_energy if base else shifted_ce
    ref = loader()
    pm = qn_hf.parallelize(loader(), dp=dp, tp=tp, microbatches=2, mesh=mesh_for(dp, tp))
    batch = make_batch(kind, size=4 * dp, seed=11)
    loss = pm.train_step(dp_slice(batch, dp=dp, dp_rank=pm.coords["dp"]), loss_fn=loss_fn)
    ref.train()
    ref_loss = loss_fn(ref(**model_inputs(batch)), batch)
    ref_loss.backward()
    params = dict(ref.named_parameters())
    grad_err = max((p.grad - reference_grad(params, n, pm)).abs().max().item() for n, p in pm.named_parameters())
    eval_loss = pm.eval_step(dp_slice(batch, dp=dp, dp_rank=pm.coords["dp"]), loss_fn=loss_fn)
    return {"loss_err": abs(loss.item() - ref_loss.item()) / ref_loss.item(), "grad_err": grad_err,
            "eval_err": abs(eval_loss.item() - ref_loss.item()) / ref_loss.item()}


@pytest.mark.parametrize(("kind", "base", "dp", "tp"), [
    ("gpt2", True, 1, 2), ("llama", True, 1, 2), ("vit", True, 2, 2), ("gpt2", False, 2, 2),
])
def test_user_loss_matches_plain_model(worlds, model_dirs, kind, base, dp, tp):
    for rank, r in enumerate(worlds.run(dp * tp, case_user_loss, kind=kind,
                                        model_dir=model_dirs[kind], base=base, dp=dp, tp=tp)):
        assert r["loss_err"] < 1e-5 and r["eval_err"] < 1e-5 and r["grad_err"] < 2e-6, (rank, r)


def case_base_model_needs_loss_fn(*, model_dir: str) -> str:
    pm = qn_hf.parallelize(AutoModel.from_pretrained(model_dir), tp=2, mesh=mesh_for(1, 2))
    try:
        pm.train_step(make_batch("gpt2", size=2, seed=0))
    except ValueError as e:
        return str(e)
    return "no error"


def test_base_model_without_loss_fn_is_an_error(worlds, model_dirs):
    for message in worlds.run(2, case_base_model_needs_loss_fn, model_dir=model_dirs["gpt2"]):
        assert "GPT2Model has no built-in loss" in message
