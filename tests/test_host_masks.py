"""Masks decided on the host at cp=1 (qn_hf/context_parallel/host_masks.py): the wrapper of sdpa given
the no-mask token computes what transformers' own mask code makes the plain model compute, windows
included; any other mask passes through unchanged; the models it does not serve keep transformers' path.
The steps' use of it (no mask read per forward) is counted in test_host_syncs.py, and every parity test
at cp=1 runs through it."""

from __future__ import annotations

import copy

import pytest
import torch
from transformers import (AutoModelForCausalLM, GPT2Config, LlamaConfig, MistralConfig, Qwen2Config,
                          Gemma3TextConfig)

import qn_hf
from qn_hf.config.options import LossKind
from qn_hf.context_parallel.host_masks import (apply_host_masks, host_masks_serve, is_no_mask, no_mask_token,
                                               step_masks_needed)
from tests.cases import mesh_for
from tests.models import dp_slice, load, make_batch

SMALL = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
             vocab_size=64, max_position_embeddings=64)


class _Plan:  # the one field host_masks_serve reads of a TpPlan
    def __init__(self, loss: LossKind = LossKind.CAUSAL_LM) -> None:
        self.loss = loss


def _models():
    torch.manual_seed(0)
    return {
        "llama": LlamaConfig(**SMALL),
        # every layer windowed, a window shorter than the sequence
        "mistral_window": MistralConfig(**SMALL, sliding_window=3),
        # a window the keys reach exactly (transformers builds the mask there, kv_length >= window)
        "mistral_window_equal": MistralConfig(**SMALL, sliding_window=10),
        "mistral_wide": MistralConfig(**SMALL, sliding_window=32),  # wider than the sequence: no mask
        # sliding and full layers mixed (config.layer_types)
        "qwen2_mixed": Qwen2Config(**SMALL, use_sliding_window=True, sliding_window=4, max_window_layers=1),
        "gemma3_mixed": Gemma3TextConfig(**SMALL, head_dim=8, sliding_window=4, sliding_window_pattern=2),
        "gpt2": GPT2Config(n_layer=2, n_embd=32, n_head=4, vocab_size=64, attn_pdrop=0.0, resid_pdrop=0.0,
                           embd_pdrop=0.0),
    }


@pytest.mark.parametrize("name", list(_models()))
def test_no_mask_token_equals_transformers_masks(name):
    config = _models()[name]
    plain = AutoModelForCausalLM.from_config(config, attn_implementation="sdpa").eval()
    assert host_masks_serve(plain, _Plan()), name
    ours = copy.deepcopy(plain)
    switch = apply_host_masks(ours)
    assert ours.config._attn_implementation == switch.name != "sdpa"
    ids = torch.randint(0, 64, (2, 10), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        expected = plain(input_ids=ids).logits
        assert torch.equal(ours(input_ids=ids, attention_mask=no_mask_token(ids)).logits, expected), name
        # an attention mask of ones and packed position ids: transformers' rules on the host decide alike
        assert torch.equal(ours(input_ids=ids, attention_mask=torch.ones_like(ids)).logits, expected)
        # any mask transformers builds passes through the wrapper unchanged: padding, packed documents
        padded = torch.ones_like(ids)
        padded[0, :3] = 0
        assert torch.equal(ours(input_ids=ids, attention_mask=padded).logits, plain(input_ids=ids, attention_mask=padded).logits)
        packed = torch.tensor([[0, 1, 2, 3, 0, 1, 2, 3, 4, 5]] * 2)
        assert torch.equal(ours(input_ids=ids, position_ids=packed).logits, plain(input_ids=ids, position_ids=packed).logits)
    with switch.off():
        assert ours.config._attn_implementation == "sdpa"
    assert ours.config._attn_implementation == switch.name


def test_the_host_decides_as_transformers_does():
    ids = torch.arange(12).reshape(2, 6)
    assert not step_masks_needed({"input_ids": ids, "labels": ids})
    assert not step_masks_needed({"input_ids": ids, "attention_mask": torch.ones_like(ids)})
    assert not step_masks_needed({"input_ids": ids, "position_ids": torch.arange(6).expand(2, 6) + 3})
    padded = torch.ones_like(ids)
    padded[1, -1] = 0
    assert step_masks_needed({"input_ids": ids, "attention_mask": padded})
    assert step_masks_needed({"input_ids": ids, "position_ids": torch.tensor([[0, 1, 2, 0, 1, 2]] * 2)})
    # transformers looks for packing only without an attention mask: with one of ones it is one sequence
    assert not step_masks_needed({"input_ids": ids, "attention_mask": torch.ones_like(ids),
                                  "position_ids": torch.tensor([[0, 1, 2, 0, 1, 2]] * 2)})
    assert step_masks_needed({"input_ids": ids, "token_type_ids": ids})  # another input may change the mask
    assert step_masks_needed({"inputs_embeds": torch.zeros(2, 6, 4)})
    # a mask transformers builds always has query rows
    assert is_no_mask(no_mask_token(ids)) and not is_no_mask(torch.ones(2, 1, 1, 6, dtype=torch.bool))
    assert not is_no_mask(None) and not is_no_mask(torch.ones(2, 6))


def test_models_it_does_not_serve_keep_transformers_path():
    llama = AutoModelForCausalLM.from_config(LlamaConfig(**SMALL), attn_implementation="sdpa")
    assert host_masks_serve(llama, _Plan())
    assert not host_masks_serve(llama, _Plan(LossKind.CLASSIFICATION))  # a head may read the mask itself
    eager = AutoModelForCausalLM.from_config(LlamaConfig(**SMALL), attn_implementation="eager")
    assert not host_masks_serve(eager, _Plan())  # eager's attention builds no causal mask of its own
    bidirectional = AutoModelForCausalLM.from_config(LlamaConfig(**SMALL, is_causal=False), attn_implementation="sdpa")
    assert not host_masks_serve(bidirectional, _Plan())
    chunked = AutoModelForCausalLM.from_config(LlamaConfig(**SMALL), attn_implementation="sdpa")
    chunked.config.attention_chunk_size = 4
    assert not host_masks_serve(chunked, _Plan())
    opaque = AutoModelForCausalLM.from_config(LlamaConfig(**SMALL), attn_implementation="sdpa")
    type(opaque)._supports_attention_backend, kept = False, type(opaque)._supports_attention_backend
    try:
        assert not host_masks_serve(opaque, _Plan())
    finally:
        type(opaque)._supports_attention_backend = kept
    hybrid = AutoModelForCausalLM.from_config(LlamaConfig(**SMALL), attn_implementation="sdpa")
    hybrid.config.layer_types = ["full_attention", "mamba"]
    assert not host_masks_serve(hybrid, _Plan())


def host_masked_parity(*, model_dir: str, padded: bool, dp: int, pp: int) -> dict:
    """One step at dp x pp against the plain model; which mask path the step took."""
    ref = load("llama", model_dir)
    pm = qn_hf.parallelize(copy.deepcopy(ref), dp=dp, pp=pp, microbatches=2, mesh=mesh_for(dp, 1, pp))
    batch = make_batch("llama", size=4, seed=3, padded=padded)
    taken = []
    prepare = qn_hf.parallel_model.prepare

    def spy(*args, **kwargs):  # which path each step's microbatches take
        prepared = prepare(*args, **kwargs)
        taken.append(prepared.masks is not None)
        return prepared

    qn_hf.parallel_model.prepare = spy
    try:
        loss = pm.train_step(dp_slice(batch, dp=dp, dp_rank=pm.coords["dp"]))
    finally:
        qn_hf.parallel_model.prepare = prepare
    expected = ref(**batch)
    expected.loss.backward()
    grads = {n: p.grad for n, p in ref.named_parameters()}
    err = max(((g - grads[pm.placement.owner(n)]).abs().max() / grads[pm.placement.owner(n)].abs().max().clamp_min(1e-12)
               ).item() for n, g in pm.named_grads())
    return {"loss": float(loss), "expected": expected.loss.item(), "grad_err": err, "host": taken}


@pytest.mark.core
@pytest.mark.parametrize(("padded", "dp", "pp"), [(False, 2, 1), (True, 1, 2)])
def test_host_masked_step_equals_plain_model(worlds, model_dirs, padded, dp, pp):
    results = worlds.run(dp * pp, host_masked_parity, model_dir=model_dirs["llama"], padded=padded, dp=dp, pp=pp)
    for r in results:
        assert r["host"] == [not padded], r  # no padding: masks from the host; padding: transformers' own
        assert abs(r["loss"] - r["expected"]) <= 1e-5 * abs(r["expected"]), r
        assert r["grad_err"] <= 2e-5, r
