"""Checkpoints of zoo architectures move between meshes: MoE experts (3-D weights sharded on their
intermediate dimension, frozen routing biases), MLA, a scaled embedding with per-layer attention
kinds. Saved at (dp, tp, pp) = (1, 2, 2) after an AdamW step, converted to a Hugging Face directory
(equal to save_pretrained's), and resumed at other meshes (and from an offline reshard): the next
step equals the uninterrupted run."""

from __future__ import annotations

import os

import pytest
import torch
from transformers import CONFIG_MAPPING

import qn_hf
from qn_hf import convert
from qn_hf.check.run import build, causal_lm_config, model_class
from qn_hf.check.shrink import shrink_config
from tests.cases import mesh_for, optimizer_step

SAVED_AT = (1, 2, 2)
RESUME_AT = [(2, 1, 1), (1, 2, 1), (1, 1, 2)]
MODEL_TYPES = ["qwen3_moe", "deepseek_v3", "gemma3_text"]


def _load(model_dir: str):
    from transformers import AutoConfig

    return model_class(AutoConfig.from_pretrained(model_dir)).from_pretrained(model_dir).float()


def _parallel(model_dir: str, dp: int, tp: int, pp: int):
    pm = qn_hf.parallelize(_load(model_dir), dp=dp, tp=tp, pp=pp, microbatches=2, mesh=mesh_for(dp, tp, pp))
    trainable = [p for p in pm.parameters() if p.requires_grad]
    return pm, torch.optim.AdamW(trainable, lr=1e-3, weight_decay=0.01)


def case_train_save_continue(*, model_dir: str, ckpt: str, out: str) -> float:
    pm, opt = _parallel(model_dir, *SAVED_AT)
    optimizer_step(pm, opt, seed=1)
    pm.save_checkpoint(ckpt, optimizer=opt, step=1)
    pm.save_pretrained(out + "-step1")  # what qn-hf-convert to-hf of the checkpoint must give
    loss = optimizer_step(pm, opt, seed=2)
    pm.save_pretrained(out)
    return loss


def case_resume(*, model_dir: str, ckpt: str, out: str, dp: int, tp: int, pp: int) -> float:
    pm, opt = _parallel(model_dir, dp, tp, pp)
    assert pm.load_checkpoint(ckpt, optimizer=opt)["step"] == 1
    loss = optimizer_step(pm, opt, seed=2)
    pm.save_pretrained(out)
    return loss


@pytest.mark.parametrize("model_type", MODEL_TYPES)
def test_zoo_checkpoint_resumes_at_other_meshes(worlds, tmp_path, model_type):
    model_dir = str(tmp_path / "model")
    build(shrink_config(CONFIG_MAPPING[model_type]()), seed=0).save_pretrained(model_dir)
    ckpt, uninterrupted = str(tmp_path / "ckpt"), str(tmp_path / "uninterrupted")
    expected = worlds.run(4, case_train_save_continue, model_dir=model_dir, ckpt=ckpt,
                          out=uninterrupted)[0]
    reference = dict(_load(uninterrupted).named_parameters())
    assert convert.main(["to-hf", ckpt, str(tmp_path / "to-hf")]) == 0
    exported, gathered = _load(str(tmp_path / "to-hf")).state_dict(), _load(uninterrupted + "-step1").state_dict()
    assert exported.keys() == gathered.keys() and all(torch.equal(exported[k], gathered[k]) for k in gathered)
    assert convert.main(["reshard", ckpt, str(tmp_path / "resharded"), "--tp", "1", "--pp", "2"]) == 0
    for dp, tp, pp, source in [(*mesh, ckpt) for mesh in RESUME_AT] + [(1, 1, 2, str(tmp_path / "resharded"))]:
        out = str(tmp_path / f"resumed-{dp}-{tp}-{pp}-{os.path.basename(source)}")
        loss = worlds.run(dp * tp * pp, case_resume, model_dir=model_dir, ckpt=source,
                          out=out, dp=dp, tp=tp, pp=pp)[0]
        assert abs(loss - expected) <= 1e-5 * abs(expected), (dp, tp, pp, loss, expected)
        resumed = dict(_load(out).named_parameters())
        err = max((resumed[n] - p).abs().max().item() for n, p in reference.items())
        assert err < 2e-5, f"resumed at {(dp, tp, pp)} from {os.path.basename(source)}: max weight difference {err}"


@pytest.mark.long  # a sweep over every zoo type and mesh (2 min on 2 cores), though it starts no process
def test_every_zoo_model_has_a_checkpoint_layout_where_it_trains_equal():
    """qn-hf-convert (from-hf, reshard) lays a checkpoint out from a meta-device model with the same
    policy and stage cut as parallelize: it must work for every model type and mesh the zoo finds
    equal (LongCat-Flash's identity-expert hook once needed a process group here)."""
    import json
    from pathlib import Path

    from qn_hf.check.zoo import COLUMNS, zoo_model_types
    from qn_hf.checkpoint.layout import model_layout

    expected = json.loads((Path(__file__).parent / "zoo_expected.json").read_text())
    # the record's types that the installed transformers plans (all of them on the release the test
    # extra pins, which test_zoo checks; an older release lacks some: tests/releases.py)
    installed = set(zoo_model_types())
    for model_type, outcomes in expected.items():
        if model_type not in installed:
            continue
        config = causal_lm_config(shrink_config(CONFIG_MAPPING[model_type]()))
        # the layout depends on tp, pp and the chunks only (dp, cp and sp shard no weight; ep's
        # expert boxes are tested in test_expert_parallel.py): each distinct one once
        cuts = {(COLUMNS[mesh].tp, COLUMNS[mesh].pp, COLUMNS[mesh].virtual_stages)
                for mesh, outcome in outcomes.items() if outcome == "equal" and COLUMNS[mesh].ep == 1}
        for tp, pp, virtual in sorted(cuts):
            layout = model_layout(config, tp=tp, pp=pp, virtual_stages=virtual)
            assert layout.tensors, (model_type, tp, pp, virtual)
