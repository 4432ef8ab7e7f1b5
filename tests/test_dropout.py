"""Dropout under tp: replicated regions draw the same numbers on every tp rank (different across
dp); dropout on a rank's own heads draws its own numbers."""

from __future__ import annotations

import torch
import torch.distributed as dist

import qn_hf
from qn_hf.comm import all_gather_tensors
from tests.cases import mesh_for, model_inputs
from tests.models import load, make_batch


def case_dropout_streams(*, gpt2_dir: str) -> dict[str, bool]:
    model = load("gpt2", gpt2_dir, resid_pdrop=0.1, embd_pdrop=0.1, attn_pdrop=0.1)
    pm = qn_hf.parallelize(model, dp=2, tp=2, seed=123, mesh=mesh_for(2, 2))
    probes: dict[str, torch.Tensor] = {}
    attn = pm.module.get_submodule("transformer.h.0.attn")
    # Registered after parallelize's own hooks, so they run inside the region being probed.
    attn.register_forward_pre_hook(lambda *_: probes.__setitem__("tp_local", torch.rand(4)))
    attn.resid_dropout.register_forward_pre_hook(lambda *_: probes.__setitem__("shared", torch.rand(4)))

    inputs = model_inputs(make_batch("gpt2", size=2, seed=3))  # the same data on every rank
    pm.train()
    hidden = pm(**inputs, output_hidden_states=True).hidden_states[-1]
    pm.eval()
    eval_hidden = pm(**inputs, output_hidden_states=True).hidden_states[-1]

    world = dist.group.WORLD
    h = all_gather_tensors(hidden.detach(), group=world)
    local = all_gather_tensors(probes["tp_local"], group=world)
    shared = all_gather_tensors(probes["shared"], group=world)
    # ranks: (dp0, tp0)=0, (dp0, tp1)=1, (dp1, tp0)=2, (dp1, tp1)=3
    return {
        "dropout is active in training": not torch.equal(hidden, eval_hidden),
        "replicated hidden states equal across tp": torch.equal(h[0], h[1]) and torch.equal(h[2], h[3]),
        "hidden states differ across dp": not torch.equal(h[0], h[2]),
        "shared stream equal across tp": torch.equal(shared[0], shared[1]) and torch.equal(shared[2], shared[3]),
        "shared stream differs across dp": not torch.equal(shared[0], shared[2]),
        "tp-local stream differs across tp": not torch.equal(local[0], local[1]) and not torch.equal(local[2], local[3]),
        "streams are restored after the region": pm.rng.current == "shared",
    }


def test_dropout_streams(worlds, model_dirs):
    for rank, results in enumerate(worlds.run(4, case_dropout_streams, gpt2_dir=model_dirs["gpt2"])):
        failed = [name for name, ok in results.items() if not ok]
        assert not failed, f"rank {rank}: {failed}"


def _stream_hooks(pm) -> int:
    """How many of the random streams' region hooks (rng.py) sit on the model."""
    return sum(1 for module in pm.module.modules() for hooks in (module._forward_pre_hooks, module._forward_hooks)
               for hook in hooks.values() if "RngStreams.hook_module" in getattr(hook, "__qualname__", ""))


def case_stream_hooks(*, gpt2_dir: str, llama_dir: str) -> dict[str, int]:
    """The regions' hooks go in only at tp > 1 on a model that draws in training."""
    out = {}
    for name, tp, kind, path, dropout in (("llama tp=2 no dropout", 2, "llama", llama_dir, {}),
                                          ("llama tp=2 attention dropout", 2, "llama", llama_dir,
                                           dict(attention_dropout=0.1)),
                                          ("gpt2 tp=2 dropout", 2, "gpt2", gpt2_dir, dict(attn_pdrop=0.1)),
                                          ("gpt2 tp=1 dropout", 1, "gpt2", gpt2_dir, dict(attn_pdrop=0.1))):
        pm = qn_hf.parallelize(load(kind, path, **dropout), dp=2 // tp, tp=tp, mesh=mesh_for(2 // tp, tp))
        out[name] = _stream_hooks(pm)
        assert pm.rng.current == "shared"
    return out


def test_stream_hooks_only_where_dropout_needs_them(worlds, model_dirs):
    for hooks in worlds.run(2, case_stream_hooks, gpt2_dir=model_dirs["gpt2"], llama_dir=model_dirs["llama"]):
        assert hooks["llama tp=2 no dropout"] == 0 and hooks["gpt2 tp=1 dropout"] == 0, hooks
        assert hooks["llama tp=2 attention dropout"] > 0 and hooks["gpt2 tp=2 dropout"] > 0, hooks


def test_draws_in_training():
    """What counts as a draw: dropout modules and attributes or config keys of a draw's probability, above 0."""
    from transformers import LlamaConfig, LlamaForCausalLM

    from qn_hf.tensor_parallel.rng import draws_in_training

    small = dict(hidden_size=16, intermediate_size=32, num_hidden_layers=1, num_attention_heads=2, vocab_size=32)
    assert not draws_in_training(LlamaForCausalLM(LlamaConfig(**small)))
    assert draws_in_training(LlamaForCausalLM(LlamaConfig(**small, attention_dropout=0.1)))  # an attribute
    model = LlamaForCausalLM(LlamaConfig(**small))
    model.model.layers[0].mlp.add_module("drop", torch.nn.Dropout(0.2))  # a module
    assert draws_in_training(model)
    model = LlamaForCausalLM(LlamaConfig(**small))
    model.config.hidden_dropout = 0.1  # a key some forwards read as p=self.config.<key>
    assert draws_in_training(model)
