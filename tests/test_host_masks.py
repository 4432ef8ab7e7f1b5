"""Masks decided on the host at cp=1 (qn_hf/context_parallel/host_masks.py): while a step trusts its
batch, transformers builds the plain model's masks (windows included) without reading the padding mask;
otherwise every mask is its own; the models it does not serve keep transformers' path.
The steps' use of it (no mask read per forward) is counted in test_host_syncs.py, and every parity test
at cp=1 runs through it."""

from __future__ import annotations

import copy
import gc
import inspect
import re
import sys
import weakref

import pytest
import torch
from transformers import (
    AutoModelForCausalLM,
    CLIPVisionConfig,
    Gemma3TextConfig,
    Gemma4TextConfig,
    GPT2Config,
    LlamaConfig,
    LlavaConfig,
    LlavaForConditionalGeneration,
    MistralConfig,
    MixtralConfig,
    OPTConfig,
    Qwen2Config,
    masking_utils,
)

import qn_hf
from qn_hf.config.options import LossKind
from qn_hf.context_parallel.apply import masks_reason
from qn_hf.context_parallel.host_masks import apply_host_masks, host_masks_serve, masks_needed, step_masks
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
def test_trusted_steps_build_transformers_masks_unread(name, monkeypatch):
    config = _models()[name]
    plain = AutoModelForCausalLM.from_config(config, attn_implementation="sdpa").eval()
    assert host_masks_serve(plain, _Plan()), name
    ours = copy.deepcopy(plain)
    switch = apply_host_masks(ours)
    assert ours.config._attn_implementation == switch.name != "sdpa"
    ids = torch.randint(0, 64, (2, 10), generator=torch.Generator().manual_seed(1))
    ones = step_masks([{"input_ids": ids}])[0]
    padding_masks = []  # what transformers' sdpa mask code is given to read
    ignore = masking_utils._ignore_causal_mask_sdpa
    monkeypatch.setattr(masking_utils, "_ignore_causal_mask_sdpa",
                        lambda padding_mask, *a, **k: padding_masks.append(padding_mask) or ignore(padding_mask, *a, **k))
    with torch.no_grad():
        expected = plain(input_ids=ids)
        with switch.trusting():
            got = ours(input_ids=ids, attention_mask=ones)
        assert torch.equal(got.logits, expected.logits), name
        assert padding_masks and all(m is None for m in padding_masks), name  # nothing left to read
        # outside a step's trust every mask is transformers' own: padding, packed documents
        padded = torch.ones_like(ids)
        padded[0, :3] = 0
        assert torch.equal(ours(input_ids=ids, attention_mask=padded).logits,
                           plain(input_ids=ids, attention_mask=padded).logits)
        packed = torch.tensor([[0, 1, 2, 3, 0, 1, 2, 3, 4, 5]] * 2)
        assert torch.equal(ours(input_ids=ids, position_ids=packed).logits, plain(input_ids=ids, position_ids=packed).logits)
    with switch.off():
        assert ours.config._attn_implementation == "sdpa"
    assert ours.config._attn_implementation == switch.name


def test_trust_covers_one_forward_and_leaves_caches_and_nested_calls_alone():
    plain = AutoModelForCausalLM.from_config(LlamaConfig(**SMALL), attn_implementation="sdpa").eval()
    ours = copy.deepcopy(plain)
    switch = apply_host_masks(ours)
    ids = torch.randint(0, 64, (2, 10), generator=torch.Generator().manual_seed(3))
    padded = torch.ones_like(ids)
    padded[0, :3] = 0
    with torch.no_grad():
        with switch.trusting():
            with switch.trusting(False):  # a call nested in a trusted forward decides for itself
                assert torch.equal(ours(input_ids=ids, attention_mask=padded).logits,
                                   plain(input_ids=ids, attention_mask=padded).logits)
            assert switch.trust.on
        assert not switch.trust.on
        # a cache makes the mask wider than the queries: kept, even under trust
        first = [m(input_ids=ids[:, :6], attention_mask=padded[:, :6], use_cache=True) for m in (plain, ours)]
        expected = plain(input_ids=ids[:, 6:], attention_mask=padded, past_key_values=first[0].past_key_values).logits
        with switch.trusting():
            got = ours(input_ids=ids[:, 6:], attention_mask=padded, past_key_values=first[1].past_key_values).logits
        assert torch.equal(got, expected)


def test_the_registry_does_not_keep_the_model():
    model = AutoModelForCausalLM.from_config(LlamaConfig(**SMALL), attn_implementation="sdpa")
    alive = weakref.ref(model)
    switch = apply_host_masks(model)
    del model, switch
    gc.collect()
    assert alive() is None


def test_the_host_decides_as_transformers_does():
    ids = torch.arange(12).reshape(2, 6)
    assert not masks_needed({"input_ids": ids, "labels": ids})
    assert not masks_needed({"input_ids": ids, "attention_mask": torch.ones_like(ids)})
    assert not masks_needed({"input_ids": ids, "position_ids": torch.arange(6).expand(2, 6) + 3})
    padded = torch.ones_like(ids)
    padded[1, -1] = 0
    assert masks_needed({"input_ids": ids, "attention_mask": padded})
    assert masks_needed({"input_ids": ids, "position_ids": torch.tensor([[0, 1, 2, 0, 1, 2]] * 2)})
    # transformers looks for packing only without an attention mask: with one of ones it is one sequence
    assert not masks_needed({"input_ids": ids, "attention_mask": torch.ones_like(ids),
                             "position_ids": torch.tensor([[0, 1, 2, 0, 1, 2]] * 2)})
    assert masks_needed({"input_ids": ids, "token_type_ids": ids})  # another input may bring masks of its own
    assert masks_needed({"inputs_embeds": torch.zeros(2, 6, 4)})
    # a prepared mask is the user's, even one that hides nothing (it may be bidirectional)
    assert masks_needed({"input_ids": ids, "attention_mask": torch.ones(2, 1, 6, 6, dtype=torch.bool)})
    assert masks_needed({"input_ids": ids, "position_ids": torch.arange(6).expand(3, 2, 6)})  # M-RoPE's
    given, made = step_masks([{"input_ids": ids, "attention_mask": torch.ones_like(ids)}, {"input_ids": ids}])
    assert torch.equal(made, torch.ones_like(ids)) and made.dtype == ids.dtype and given.dim() == 2
    # a mask only a loss_fn reads: the model is given none of it, so transformers would look for packing
    packed = {"input_ids": ids, "attention_mask": torch.ones_like(ids), "position_ids": torch.tensor([[0, 1, 2, 0, 1, 2]] * 2)}
    assert not masks_needed(packed) and masks_needed(packed, dropped=("attention_mask",))
    own = torch.ones_like(ids)
    assert step_masks([{"input_ids": ids, "attention_mask": own}], dropped=("attention_mask",))[0] is not own


def test_models_whose_forward_reads_the_mask_get_ones():
    """A mask of ones where the batch has none: OPT makes its positions from it, an MoE forward's own
    router loss weighs tokens by it."""
    ids = torch.randint(0, 64, (2, 10), generator=torch.Generator().manual_seed(2))
    for config in (OPTConfig(hidden_size=32, ffn_dim=64, num_hidden_layers=2, num_attention_heads=4, vocab_size=64,
                             word_embed_proj_dim=32, max_position_embeddings=64, dropout=0.0),
                   MixtralConfig(**SMALL, num_local_experts=4, num_experts_per_tok=2, output_router_logits=True)):
        plain = AutoModelForCausalLM.from_config(config, attn_implementation="sdpa").eval()
        assert host_masks_serve(plain, _Plan()), config.model_type
        ours = copy.deepcopy(plain)
        switch = apply_host_masks(ours)
        with torch.no_grad(), switch.trusting():
            got = ours(input_ids=ids, attention_mask=step_masks([{"input_ids": ids}])[0], labels=ids)
        expected = plain(input_ids=ids, labels=ids)
        assert torch.equal(got.logits, expected.logits), config.model_type
        assert torch.allclose(got.loss, expected.loss, rtol=1e-6, atol=0), config.model_type


def test_models_it_does_not_serve_keep_transformers_path():
    llama = AutoModelForCausalLM.from_config(LlamaConfig(**SMALL), attn_implementation="sdpa")
    assert host_masks_serve(llama, _Plan())
    assert not host_masks_serve(llama, _Plan(LossKind.CLASSIFICATION))  # a head may read the mask itself
    eager = AutoModelForCausalLM.from_config(LlamaConfig(**SMALL), attn_implementation="eager")
    assert not host_masks_serve(eager, _Plan())
    chunked = AutoModelForCausalLM.from_config(LlamaConfig(**SMALL), attn_implementation="sdpa")
    chunked.config.attention_chunk_size = 4
    assert not host_masks_serve(chunked, _Plan())
    hybrid = AutoModelForCausalLM.from_config(LlamaConfig(**SMALL), attn_implementation="sdpa")
    hybrid.config.layer_types = ["full_attention", "mamba"]
    assert not host_masks_serve(hybrid, _Plan())
    # a composite model whose vision tower runs another implementation: the name would replace it too
    text = LlamaConfig(**SMALL)
    vision = CLIPVisionConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=4,
                              image_size=16, patch_size=8)
    llava = LlavaForConditionalGeneration(LlavaConfig(text_config=text, vision_config=vision, image_token_index=3))
    llava.set_attn_implementation({"text_config": "sdpa", "vision_config": "eager"})
    assert llava.config.vision_config._attn_implementation == "eager"
    assert not host_masks_serve(llava, _Plan())
    # modeling code that asks for sdpa by name would take its other branch under qn_hf's name
    gemma4 = AutoModelForCausalLM.from_config(
        Gemma4TextConfig(**SMALL, head_dim=8, global_head_dim=8, layer_types=["sliding_attention", "full_attention"]),
        attn_implementation="sdpa")
    asks = re.search(r"_attn_implementation[^\n]*[\"']sdpa[\"']", inspect.getsource(sys.modules[type(gemma4).__module__]))
    assert masks_reason(gemma4) is None and host_masks_serve(gemma4, _Plan()) is (asks is None)  # asks in 5.24, not 5.17


def host_masked_parity(*, model_dir: str, padded: bool, dp: int, pp: int) -> dict:
    """One step at dp x pp against the plain model; which mask path the step took."""
    ref = load("llama", model_dir)
    pm = qn_hf.parallelize(copy.deepcopy(ref), dp=dp, pp=pp, microbatches=2, mesh=mesh_for(dp, 1, pp))
    batch = make_batch("llama", size=4, seed=3, padded=padded)
    from qn_hf.step import step_loss  # where the step prepares its batch (StepLoss.run)

    taken = []
    prepare = step_loss.prepare

    def spy(*args, **kwargs):  # which path each step's microbatches take
        prepared = prepare(*args, **kwargs)
        taken.append(prepared.masks is not None)
        return prepared

    step_loss.prepare = spy
    try:
        loss = pm.train_step(dp_slice(batch, dp=dp, dp_rank=pm.coords["dp"]))
    finally:
        step_loss.prepare = prepare
    expected = ref(**batch)
    expected.loss.backward()
    grads = {n: p.grad for n, p in ref.named_parameters()}
    err = max(((g - grads[pm.placement.owner(n)]).abs().max() / grads[pm.placement.owner(n)].abs().max().clamp_min(1e-12)
               ).item() for n, g in pm.named_grads())
    return {"loss": float(loss), "expected": expected.loss.item(), "grad_err": err, "host": taken}


@pytest.mark.core
@pytest.mark.parametrize(("padded", "dp", "pp"), [(False, 2, 1), (False, 1, 2), (True, 2, 1)])
def test_host_masked_step_equals_plain_model(worlds, model_dirs, padded, dp, pp):
    results = worlds.run(dp * pp, host_masked_parity, model_dir=model_dirs["llama"], padded=padded, dp=dp, pp=pp)
    for r in results:
        assert r["host"] == [not padded], r  # no padding: masks from the host; padding: transformers' own
        assert abs(r["loss"] - r["expected"]) <= 1e-5 * abs(r["expected"]), r
        assert r["grad_err"] <= 2e-5, r
