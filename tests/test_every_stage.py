"""Modules every pipeline stage holds (``ModelPolicy.pp_every_stage``): Gemma 4's and Gemma 3n's
per-layer embeddings, computed before the blocks from the token embedding and handed to every block.
Each stage computes them, its first block takes the received activation, the outputs that pack one
part per block are rotated to the stage's blocks, and the copies' gradients are summed over the
pipeline. Equal to the plain model at every schedule, with dp, ZeRO-1, tp and sequence parallelism,
4 stages, and through checkpoints moved between meshes; cuts that would split what a block shares
with another are refused before anything runs."""

from __future__ import annotations

import pytest
import torch
from transformers import AutoConfig, AutoModelForCausalLM

from qn_hf.check.shrink import shrink_config
from qn_hf.pipeline.split import build_stage_plan
from qn_hf.pipeline.standins import BlockRotation
from qn_hf.policies import resolve_policy
from qn_hf.policies.model_policy import ModelPolicy
from tests import cases, generation_cases, optim_cases
from tests.models import CONFIGS, load
from tests.test_parity import GRAD_ATOL, check

PER_LAYER = ("embed_tokens_per_layer", "per_layer_model_projection")


def _meta(config) -> torch.nn.Module:
    with torch.device("meta"):
        return AutoModelForCausalLM.from_config(config)


@pytest.mark.parametrize(("kind", "extra"), [("gemma4", ()), ("gemma3n", ("altup_projections",))])
def test_derived_policy_puts_what_precedes_the_blocks_on_every_stage(kind, extra):
    policy = resolve_policy(_meta(CONFIGS[kind]), None)
    assert policy.pp_every_stage == ("embed_tokens", *PER_LAYER, "per_layer_projection_norm", *extra)
    # the norm runs on the reshaped parts, one part at a time: rotating its input is enough
    assert policy.pp_per_block_outputs == PER_LAYER
    assert policy.pp_receive_at_blocks and policy.pp_refusal is None


def test_plain_models_keep_their_cut():
    policy = resolve_policy(_meta(CONFIGS["qwen3"]), None)
    assert policy.pp_every_stage == () and policy.pp_per_block_outputs == () and not policy.pp_receive_at_blocks


def test_a_module_tied_to_one_on_every_stage_is_on_every_stage_too():
    """ProphetNet's decoder wrapper holds a word_embeddings of its own, tied to its decoder's, which every stage
    holds: replaced on the first stage, it left that stage naming the shared weight otherwise than the last, and
    the pipeline's sum over the stages crashed gloo (a collective of two sizes)."""
    import transformers

    with torch.device("meta"):
        model = transformers.ProphetNetForCausalLM(shrink_config(AutoConfig.for_model("prophetnet")))
    policy = resolve_policy(model, None)
    assert "word_embeddings" in policy.pp_every_stage and "word_embeddings" not in policy.pp_last
    plan = build_stage_plan(model, policy, stages=2)
    assert "prophetnet.word_embeddings" in plan.every_stage


def test_an_encoder_decoder_stack_needing_modules_on_each_of_its_stages_is_not_cut():
    """Whisper's encoder runs conv2 and its position table before its blocks besides its entry: an encoder-decoder's
    stages hold a stack's modules on its own stages only, so the encoder runs whole on one stage."""
    import transformers

    with torch.device("meta"):
        model = transformers.WhisperForConditionalGeneration(shrink_config(AutoConfig.for_model("whisper")))
    cut = resolve_policy(model, None).pp_seq2seq
    assert cut.encoder_cut is None and cut.decoder_cut is not None
    assert "conv2, embed_positions would be real on each of its stages" in cut.encoder_why


def test_rotation_hands_each_block_its_own_part():
    blocks, part = 4, 3
    packed = torch.arange(2 * blocks * part, dtype=torch.float32).reshape(2, blocks * part)
    rotation = BlockRotation(blocks=blocks)
    for start in range(blocks):
        rotation.start = start
        out = rotation.hook(torch.nn.Identity(), (packed,), packed)
        out = packed if out is None else out
        # the stage's loop takes part i for its i-th block, which is block start + i
        for i in range(blocks - start):
            assert torch.equal(out.reshape(2, blocks, part)[:, i], packed.reshape(2, blocks, part)[:, start + i])
    rotation.start = 1
    with pytest.raises(ValueError, match="not one part for each of the 4 blocks"):
        rotation.hook(torch.nn.Identity(), (), torch.zeros(2, 5))


def test_cuts_through_shared_keys_and_values_are_refused():
    model = _meta(CONFIGS["gemma3n"])  # blocks 3-5 reuse the keys and values of blocks 1 and 2
    policy = resolve_policy(model, None)
    with pytest.raises(ValueError, match=r"block 3 \(kv_sharing_modes\[3\] = 'reuse'\) reuses the keys and values "
                                         r"stored by block 1, in chunk 0, but block 3 is in chunk 1"):
        build_stage_plan(model, policy, stages=2)
    plan = build_stage_plan(model, policy, stages=2, layers_per_stage=[1, 5])
    assert plan.layer_ranges == ((0, 1), (1, 6))
    # Gemma 4 with shared keys and values too (its real small models have them)
    config = shrink_config(AutoConfig.for_model("gemma4_text", num_kv_shared_layers=2))
    model = _meta(config)
    with pytest.raises(ValueError, match="block 2 .* reuses the keys and values stored by block 0"):
        build_stage_plan(model, resolve_policy(model, None), stages=2)


def test_policies_that_cannot_hold_are_refused():
    base = dict(model_type="x", layers="layers", tp_plan={}, pp_entry="embed_tokens")
    with pytest.raises(ValueError, match="pp_every_stage needs pp_receive_at_blocks"):
        ModelPolicy(**base, pp_every_stage=("embed_tokens", "table"))
    with pytest.raises(ValueError, match="must hold the entry 'embed_tokens'"):
        ModelPolicy(**base, pp_every_stage=("table",), pp_receive_at_blocks=True)
    with pytest.raises(ValueError, match="must be among pp_every_stage"):
        ModelPolicy(**base, pp_every_stage=("embed_tokens", "table"), pp_receive_at_blocks=True,
                    pp_per_block_outputs=("other",))


PARITY = [  # kind, dp, tp, pp, schedule, microbatches, layers_per_stage, sequence_parallel
    ("gemma4", 1, 1, 2, "zb_h1", 2, None, False),  # the projection's weight gradient deferred to W passes
    pytest.param("gemma4", 2, 1, 2, "1f1b", 2, None, False, marks=pytest.mark.long),  # dp buckets, then pp's sum
    ("gemma4", 1, 1, 4, "1f1b", 4, None, False),  # parts rotated by 1, 2 and 3 on the later stages
    pytest.param("gemma4", 1, 2, 2, "1f1b", 2, None, True, marks=pytest.mark.long),  # tp x pp with sp
    ("gemma3n", 1, 1, 2, "1f1b", 2, [1, 5], False),  # AltUp streams cross the stages; shared K/V stay in one
]


@pytest.mark.parametrize(("kind", "dp", "tp", "pp", "schedule", "microbatches", "layers_per_stage", "sp"), PARITY)
def test_equal_to_the_plain_model(worlds, model_dirs, tmp_path, kind, dp, tp, pp, schedule, microbatches,
                                  layers_per_stage, sp):
    results = worlds.run(dp * tp * pp, cases.parity, kind=kind, model_dir=model_dirs[kind], out_dir=str(tmp_path / "hf"),
                         dp=dp, tp=tp, pp=pp, schedule=schedule, microbatches=microbatches,
                         layers_per_stage=layers_per_stage, sequence_parallel=sp, padded=True, bucket_mb=0.01)
    # Gemma 4's embedding, tied to the head and scaled by sqrt(hidden), gets gradients up to 0.87
    # here; tp sums its vocabulary shards' parts in another order: 7.7e-6 off at tp=2 without a
    # pipeline too (float32 rounding, 1e-5 of the largest gradient), 2.8e-6 to 6.4e-6 with one
    check(results, tp=tp, grad_atol=1e-5 if tp > 1 else GRAD_ATOL)


def test_zero_equals_the_plain_model(worlds, model_dirs):
    """ZeRO-1 keeps the modules held on every stage in buckets of their own, laid out alike on every
    stage, so the pipeline's sum adds the same elements of each rank's pieces."""
    for r in worlds.run(4, optim_cases.zero_parity, kind="gemma4", model_dir=model_dirs["gemma4"], dp=2, tp=1, pp=2,
                        microbatches=2, opt_name="SGD"):
        assert r["losses"] == r["losses_unsharded"], r
        for loss, ref in zip(r["losses"], r["ref_losses"]):
            assert abs(loss - ref) <= 1e-5 * abs(ref), r
        assert r["weight_diff_ref"] < 2e-5, r


def test_checkpoint_moves_between_meshes(worlds, model_dirs, tmp_path):
    """Saved at dp=2 x pp=2 with ZeRO-1 (the first stage writes what every stage holds, once), resumed
    at one process, at pp=4 and at the same mesh: the third step is the uninterrupted run's."""
    ckpt, out = str(tmp_path / "ckpt"), str(tmp_path / "uninterrupted")
    loss = worlds.run(4, optim_cases.save_and_continue, kind="gemma4", model_dir=model_dirs["gemma4"], ckpt=ckpt,
                      out=out, dp=2, tp=1, pp=2, zero=True, precision=None)[0]
    expected = dict(load("gemma4", out).named_parameters())
    for dp, tp, pp, zero in [(1, 1, 1, None), (1, 1, 4, False), (2, 1, 2, True)]:
        resumed = str(tmp_path / f"resumed-{dp}-{tp}-{pp}")
        r = worlds.run(dp * tp * pp, optim_cases.resume, kind="gemma4", model_dir=model_dirs["gemma4"], ckpt=ckpt,
                       out=resumed, dp=dp, tp=tp, pp=pp, zero=zero, precision=None)[0]
        assert r["step"] == 2 and abs(r["loss"] - loss) <= 1e-5 * loss, (dp, tp, pp, r, loss)
        got = dict(load("gemma4", resumed).named_parameters())
        err = max((got[n] - p).abs().max().item() for n, p in expected.items())
        assert err <= 2e-5, (dp, tp, pp, err)


@pytest.mark.parametrize("virtual", [1, pytest.param(2, marks=pytest.mark.long)])
def test_generate_equals_the_plain_model(worlds, model_dirs, virtual):
    """pm.generate at pp=2 (and two chunks per rank): each stage computes the per-layer inputs of its
    own blocks for every new token; greedy and sampled tokens and the logits are the plain model's."""
    results = worlds.run(2, generation_cases.generation, model_dirs=model_dirs, kinds=["gemma4"], dp=1, tp=1, pp=2,
                         virtual_stages=virtual)
    for r in results:
        got = r["gemma4"]
        for case in ("greedy", "single", "sampled"):
            ours, ref = got[case]
            assert ours == ref, (case, r["rank"], ours, ref)
        assert got["logit_err"] < 1e-4, got["logit_err"]
        ours, ref = got["loss_after"]
        assert abs(ours - ref) <= 1e-5 * abs(ref), (ours, ref)
        assert got["training"] and got["generator"], got
