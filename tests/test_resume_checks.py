"""Resuming checks what it resumes into: a model whose configuration differs from the saved one in
anything that changes what the tensors mean (fewer layers, other head counts, another norm epsilon,
tying), and an optimizer of another class (SGD would take AdamW's lr and weight decay), are refused
with the difference named, nothing loaded."""

from __future__ import annotations

import torch
from transformers import LlamaConfig, LlamaForCausalLM

import qn_hf
from qn_hf.checkpoint.format import CheckpointError
from qn_hf.checkpoint.load import config_differences
from tests.cases import mesh_for
from tests.models import CONFIGS, make_batch


def _model(**overrides) -> LlamaForCausalLM:
    torch.manual_seed(0)
    return LlamaForCausalLM(LlamaConfig(**{**CONFIGS["llama"].to_dict(), **overrides}))


def _refusal(fn) -> str:
    try:
        fn()
    except CheckpointError as e:
        return str(e)
    return "no error"


def case_resume_checks(*, path: str) -> dict[str, str]:
    pm = qn_hf.parallelize(_model(), mesh=mesh_for(1, 1))
    opt = qn_hf.optimizer(pm, torch.optim.AdamW, lr=1e-3)
    pm.train_step(make_batch("llama", size=2, seed=0))
    opt.step()
    pm.save_checkpoint(path, optimizer=opt, step=1)
    out = {}
    for name, overrides in (("layers", {"num_hidden_layers": 2}), ("eps", {"rms_norm_eps": 1e-3}),
                            ("heads", {"num_attention_heads": 4, "num_key_value_heads": 1}),
                            ("tying", {"tie_word_embeddings": True})):
        other = qn_hf.parallelize(_model(**overrides), mesh=mesh_for(1, 1))
        before = {n: p.detach().clone() for n, p in other.named_parameters()}
        out[name] = _refusal(lambda: other.load_checkpoint(path))
        out[name + " unchanged"] = str(all(torch.equal(before[n], p) for n, p in other.named_parameters()))
    same = qn_hf.parallelize(_model(attention_dropout=0.0, use_cache=False), mesh=mesh_for(1, 1))
    out["harmless"] = _refusal(lambda: same.load_checkpoint(path))
    for kind in (torch.optim.SGD, torch.optim.AdamW):
        other = qn_hf.parallelize(_model(), mesh=mesh_for(1, 1))
        out[kind.__name__] = _refusal(lambda: other.load_checkpoint(path, optimizer=qn_hf.optimizer(other, kind, lr=0.5)))
    return out


def test_resume_refuses_another_architecture(worlds, tmp_path):
    m = worlds.run(1, case_resume_checks, path=str(tmp_path / "ckpt"))[0]
    assert "num_hidden_layers: saved 4, this model 2" in m["layers"], m
    assert "rms_norm_eps: saved 1e-06, this model 0.001" in m["eps"], m
    assert "num_attention_heads: saved 8, this model 4" in m["heads"] and "num_key_value_heads" in m["heads"], m
    assert "tie_word_embeddings: saved False, this model True" in m["tying"], m
    assert all(m[k + " unchanged"] == "True" for k in ("layers", "eps", "heads", "tying")), m
    assert m["harmless"] == "no error", m
    assert "the optimizer state was saved from AdamW, this optimizer is SGD" in m["SGD"], m
    assert m["AdamW"] == "no error", m


def test_config_differences_ignores_what_does_not_change_the_tensors():
    saved = {"hidden_size": 32, "attention_dropout": 0.1, "eos_token_id": 2, "use_cache": True,
             "rope_parameters": {"rope_theta": 10000.0, "rope_type": "default"}, "only_saved": 1}
    current = {"hidden_size": 32, "attention_dropout": 0.0, "eos_token_id": 3, "use_cache": False,
               "rope_parameters": {"rope_theta": 500000.0, "rope_type": "default"}, "only_current": 2}
    assert config_differences(saved, current) == ["rope_parameters.rope_theta: saved 10000.0, this model 500000.0"]
