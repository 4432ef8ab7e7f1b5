"""The validation matrix: every public entry point refuses each mistake with its own clear
``ValueError`` before any communication (checked with ``CommMeter``: nothing sent)."""

from __future__ import annotations

import torch

import qn_hf
from tests.cases import error_message, mesh_for
from tests.models import load, make_batch


def case_validation(*, gpt2_dir: str, vit_dir: str) -> dict:
    out: dict[str, str] = {}
    mixed = load("gpt2", gpt2_dir)
    mixed.lm_head.to(torch.float64)  # lm_head is tied to wte: make another module differ
    mixed.transformer.h[0].mlp.c_fc.to(torch.float64)
    out["mixed dtypes"] = error_message(lambda: qn_hf.parallelize(mixed, tp=2, mesh=mesh_for(1, 2)))
    out["bad degree"] = error_message(lambda: qn_hf.parallelize(load("gpt2", gpt2_dir), tp=0))
    out["microbatches type"] = error_message(lambda: qn_hf.parallelize(load("gpt2", gpt2_dir), tp=2, microbatches=1.5))
    once = load("gpt2", gpt2_dir)
    qn_hf.parallelize(once, tp=2, mesh=mesh_for(1, 2))
    out["twice"] = error_message(lambda: qn_hf.parallelize(once, tp=2, mesh=mesh_for(1, 2)))

    pm = qn_hf.parallelize(load("gpt2", gpt2_dir), tp=2, microbatches=2, mesh=mesh_for(1, 2))
    good = make_batch("gpt2", size=4, seed=0)
    bad_batches = {
        "typo in a key": {"input_idz": good["input_ids"], "labels": good["labels"]},
        "float ids": {"input_ids": good["input_ids"].float(), "labels": good["labels"]},
        "1-D ids": {"input_ids": good["input_ids"][0], "labels": good["labels"][0]},
        "too long": {"input_ids": torch.zeros(4, 40, dtype=torch.long), "labels": torch.zeros(4, 40, dtype=torch.long)},
        "labels shape": {"input_ids": good["input_ids"], "labels": good["labels"][:, :-1]},
        "mask shape": {**good, "attention_mask": torch.ones(4, 3, dtype=torch.long)},
        "not a dict": [good["input_ids"]],
        "batch sizes differ": {"input_ids": good["input_ids"], "labels": good["labels"][:2]},
    }
    with qn_hf.CommMeter(pm) as meter:
        for name, batch in bad_batches.items():
            out[name] = error_message(lambda: pm.train_step(batch))
        out["eval float ids"] = error_message(lambda: pm.eval_step({"input_ids": good["input_ids"].float(), "labels": good["labels"]}))
    vit = qn_hf.parallelize(load("vit", vit_dir), tp=2, mesh=mesh_for(1, 2))
    images = make_batch("vit", size=2, seed=0)
    with qn_hf.CommMeter(vit) as vit_meter:
        out["int images"] = error_message(lambda: vit.train_step({**images, "pixel_values": images["pixel_values"].long()}))
        out["image size"] = error_message(lambda: vit.train_step({**images, "pixel_values": images["pixel_values"][..., :8, :8]}))
        out["label shape"] = error_message(lambda: vit.train_step({**images, "labels": images["labels"][:, None]}))
    # nothing but the hosts' agreement on each batch (step/agreement.py), which makes a refusal every rank's
    out["events"] = str(sum(e.group != "host" for e in [*meter.events, *vit_meter.events]))
    out["agreements"] = str(sum(e.group == "host" for e in [*meter.events, *vit_meter.events]))
    out["good still trains"] = str(pm.train_step(good).item() > 0)
    out["float mask"] = error_message(lambda: pm.train_step({**good, "attention_mask": torch.ones(4, 12)}))
    soft = {"input_ids": good["input_ids"], "labels": good["labels"].float()}  # a user's loss takes any labels
    out["float labels with loss_fn"] = error_message(lambda: pm.train_step(soft, loss_fn=lambda o, mb: o.logits.mean()))
    return out


EXPECTED = {
    "mixed dtypes": "the model's parameters mix dtypes ['torch.float32', 'torch.float64']",
    "bad degree": "tp=0 must be a positive integer",
    "microbatches type": "microbatches=1.5 must be a positive integer",
    "twice": "this model is already parallelized",
    "typo in a key": "batch lacks 'input_ids', the input of GPT2LMHeadModel",
    "float ids": "batch['input_ids'] has dtype torch.float32; it holds indices or a mask and must be an integer tensor",
    "1-D ids": "batch['input_ids'] has shape (12,); it must be (batch, sequence)",
    "too long": "sequence length 40 exceeds the model's 32 positions",
    "labels shape": "batch['labels'] has shape (4, 11); for a causal LM it must match input_ids (4, 12)",
    "mask shape": "batch['attention_mask'] has shape (4, 3), input_ids (4, 12)",
    "not a dict": "batch must be a non-empty dict of tensors, got list",
    "batch sizes differ": "batch tensors must share their size along dim 0",
    "eval float ids": "batch['input_ids'] has dtype torch.float32",
    "int images": "batch['pixel_values'] has dtype torch.int64; images must be floating point",
    "image size": "batch['pixel_values'] has shape (2, 3, 8, 8); the model takes (batch, 3, 16, 16)",
    "label shape": "batch['labels'] has shape (2, 1); class labels are one per example",
}


def test_each_mistake_is_one_clear_error_before_any_communication(worlds, model_dirs):
    for r in worlds.run(2, case_validation, gpt2_dir=model_dirs["gpt2"], vit_dir=model_dirs["vit"]):
        for name, fragment in EXPECTED.items():
            assert fragment in r[name], (name, r[name])
        assert r["events"] == "0", r["events"]  # refused before sending anything of the model's
        assert int(r["agreements"]) > 0, r["agreements"]
        assert r["good still trains"] == "True"
        assert r["float mask"] == "no error" and r["float labels with loss_fn"] == "no error"
