"""The check's shrunk configs (qn_hf/check/shrink.py): a shrunk model's training forward draws nothing at
random (dropout under any of its names, stochastic depth, drop connect, per-stage rate lists), since no split
of the batch over ranks draws what one process draws; staged towers keep two blocks a stage at most."""

from __future__ import annotations

import pytest
import torch
import transformers
from transformers import CONFIG_MAPPING

from qn_hf.check.inputs import _per_row, dummy_batch
from qn_hf.check.shrink import STAGE_DEPTH, shrink_config
from tests.releases import INSTALLED, PINNED

# model type, class: per-stage rate lists (CvT), drop connect (ALIGN's and EfficientNet's towers), drop path
# (Swin, ConvNeXt, BEiT), SpecAugment and LayerDrop (wav2vec2)
RANDOM_IN_TRAINING = [("cvt", "CvtModel"), ("align", "AlignVisionModel"), ("efficientnet", "EfficientNetModel"),
                      ("swin", "SwinModel"), ("convnext", "ConvNextModel"), ("beit", "BeitModel"),
                      ("wav2vec2", "Wav2Vec2Model"), ("dinov3_vit", "DINOv3ViTModel"),  # RoPE rescaled at random
                      ("gpt2", "GPT2ForTokenClassification")]  # a head's dropout of 0.1 the config names no key for


@pytest.mark.parametrize(("model_type", "cls"), RANDOM_IN_TRAINING)
def test_a_shrunk_model_trains_without_random_draws(model_type, cls):
    config = shrink_config(CONFIG_MAPPING[model_type]())
    if model_type == "align":
        config = config.vision_config
    torch.manual_seed(0)
    model = getattr(transformers, cls)(config).train()
    for module in model.modules():  # batch statistics differ between rows, not between draws: fixed here
        if isinstance(module, torch.nn.modules.batchnorm._BatchNorm):
            module.eval()
    batch = dummy_batch(model, rows=2, seed=1)
    batch = {k: v for k, v in batch.items() if k != "labels"}
    outputs = []
    for seed in (1, 2):
        torch.manual_seed(seed)
        with torch.no_grad():
            outputs.append(_per_row(model(**batch)))
    assert outputs[0] and all(torch.equal(a, b) for a, b in zip(*outputs))


@pytest.mark.parametrize("model_type", ["resnet", "bit", "convnext", "regnet", "swin", "levit"])
def test_staged_towers_keep_every_stage_with_at_most_two_blocks(model_type):
    full, shrunk = CONFIG_MAPPING[model_type](), shrink_config(CONFIG_MAPPING[model_type]())
    assert len(shrunk.depths) == len(full.depths)
    assert shrunk.depths == [min(d, STAGE_DEPTH) for d in full.depths]


# configs whose validation ties sizes the plain shrink sets apart, or computes a count the shrink set: the
# repair's rule each (model type, what the config holds after it, the class built)
REPAIRED = [("xlnet", {"d_head": 16}, "XLNetModel"),  # d_head = d_model // n_head
            ("funnel", {"block_sizes": [STAGE_DEPTH] * 3}, "FunnelModel"),  # num_hidden_layers is a property
            ("prophetnet", {"num_encoder_layers": 4, "num_decoder_layers": 4}, "ProphetNetModel"),
            ("mamba2", {"head_dim": 32}, "Mamba2Model"),  # heads x head_dim = expand x hidden
            ("dots3_note", {}, "Dots3NoteForCausalLM"),  # an adapter's input width equal to the hidden size
            ("nemo_speechlm", {}, "Nemotron3_5TranscribeModel"),  # a CTC blank id beyond the shrunk vocabulary
            ("zaya", {"num_experts_per_tok": 1}, "ZayaModel"),  # supports one expert a token: taken back
            ("falcon_h1", {"mamba_d_ssm": 128}, "FalconH1ForCausalLM"),  # the SSM's width = its heads x head width
            ("glm5_next_text", {"index_kpool": 8}, "Glm5NextTextModel"),  # the top-k pooled in groups that divide it
            # each layer's kv source, an earlier layer's position: the first four layers' own
            ("mistral_large4_text", {"kv_source_layers": [0, 1, 2, 3]}, "MistralLarge4TextModel")]


@pytest.mark.parametrize(("model_type", "holds", "cls"), REPAIRED)
def test_a_config_its_validation_refuses_shrunk_is_repaired(model_type, holds, cls):
    if model_type not in CONFIG_MAPPING:
        pytest.skip(f"transformers {transformers.__version__} has no {model_type}")
    shrunk = shrink_config(CONFIG_MAPPING[model_type]())
    assert {key: getattr(shrunk, key) for key in holds} == holds
    from qn_hf.check.run import build

    model = build(shrunk, seed=0, name=cls)
    assert sum(p.numel() for p in model.parameters()) < 10_000_000


def test_a_config_that_builds_shrunk_is_not_repaired(monkeypatch):
    """The repair runs only where the config refuses the shrink, so no config that built changes."""
    import qn_hf.check.shrink as shrink

    def refused(*args, **kwargs):
        raise AssertionError("repaired")

    monkeypatch.setattr(shrink, "repaired", refused)
    for model_type in ("mamba", "falcon_mamba", "nemotron_h", "llama", "t5", "bert", "clip"):
        shrink.shrink_config(CONFIG_MAPPING[model_type]())
    with pytest.raises(AssertionError, match="repaired"):
        shrink.shrink_config(CONFIG_MAPPING["xlnet"]())


# classes whose own code, not their config's validation, ties widths the shrink set apart: built from the shrunk
# config with those widths scaled as the hidden size was (model type, class, what the config holds then)
SCALED = [("squeezebert", "SqueezeBertForMaskedLM", {"embedding_size": 64}),  # as wide as the hidden size
          ("mobilebert", "MobileBertForMaskedLM", {"embedding_size": 16, "true_hidden_size": 16}),  # head: 64 - 16
          ("mimi", "MimiModel", {"upsample_groups": 64}),  # one group per hidden channel
          # a padding id its audio embedding must hold: the shrunk vocabulary's last
          ("kyutai_speech_to_text", "KyutaiSpeechToTextModel", {"audio_pad_token_id": 125})]


@pytest.mark.parametrize(("model_type", "cls", "holds"), SCALED)
def test_a_class_that_cannot_build_from_the_shrunk_config_gets_its_widths_scaled(model_type, cls, holds):
    model_class = getattr(transformers, cls)
    plain = shrink_config(CONFIG_MAPPING[model_type]())
    with pytest.raises(Exception), torch.device("meta"):  # noqa: B017 -- each class raises its own kind
        model_class(plain)
    shrunk = shrink_config(CONFIG_MAPPING[model_type](), builds=model_class)
    assert {key: getattr(shrunk, key) for key in holds} == holds and shrunk.hidden_size == plain.hidden_size
    with torch.device("meta"):
        model_class(shrunk)


def test_a_class_that_builds_from_the_shrunk_config_keeps_it():
    """ALBERT's embedding (128) and ConvBERT's (768, the original hidden size) stay: their classes build."""
    for model_type, cls in (("albert", "AlbertForMaskedLM"), ("convbert", "ConvBertForMaskedLM")):
        plain = shrink_config(CONFIG_MAPPING[model_type]())
        assert shrink_config(CONFIG_MAPPING[model_type](), builds=getattr(transformers, cls)).to_dict() == plain.to_dict()



# what a default config leaves unset or wrong that its checkpoints set, without which the model cannot build or
# run shrunk (model type, class, what the config holds then): DBRX's attention config (rope_theta, which its
# attention reads; clip_qkv, which it clamps at), Zamba's hybrid layers (two, which its tie keys need) and its
# attention width (twice the hidden size, stored at the full size by the default config), and others so stored
FILLED = [pytest.param("dbrx", "DbrxForCausalLM",
                       lambda c: (c.attn_config.rope_theta, c.attn_config.clip_qkv) == (10000.0, 8.0),
                       # 5.17's DBRX attention config refuses the keys its own to_dict writes
                       marks=pytest.mark.skipif(not PINNED, reason=f"transformers {INSTALLED}'s DBRX config")),
          ("zamba", "ZambaForCausalLM", lambda c: c.layers_block_type.count("hybrid") == 2
           and c.attention_hidden_size == 2 * c.hidden_size),
          # widths the config computes where not given, which its default stores computed from the full sizes
          ("zamba2", "Zamba2ForCausalLM", lambda c: (c.attention_hidden_size, c.mamba_headdim, c.hybrid_layer_ids)
           == (2 * c.hidden_size, c.mamba_expand * c.hidden_size // c.n_mamba_heads, [3])),
          # and a decoder's first token beyond the shrunk vocabulary (Marian's pad, 58100): at its pad
          ("marian", "MarianMTModel", lambda c: c.decoder_vocab_size == c.vocab_size and c.decoder_start_token_id == 0)]


@pytest.mark.parametrize(("model_type", "cls", "holds"), FILLED)
def test_a_gap_the_default_config_leaves_for_its_checkpoints_is_filled(model_type, cls, holds):
    from qn_hf.check.run import build

    shrunk = shrink_config(CONFIG_MAPPING[model_type]())
    assert holds(shrunk)
    model = build(shrunk, seed=0, name=cls)
    loss = model(**dummy_batch(model, rows=2, seed=1)).loss
    assert torch.isfinite(loss)


@pytest.mark.parametrize(("model_type", "cls", "part"), [
    ("llama4", "Llama4ForCausalLM", "text_config"), ("qwen3_5", "Qwen3_5ForCausalLM", "text_config"),
    # 5.17's MusicGen config cannot be built with its defaults
    pytest.param("musicgen", "MusicgenForCausalLM", "decoder",
                 marks=pytest.mark.skipif(not PINNED, reason=f"transformers {INSTALLED}'s MusicGen config")),
    ("llava", "LlavaForConditionalGeneration", None)])
def test_a_class_is_built_from_the_part_of_a_composite_config_it_takes(model_type, cls, part):
    """A text-only class of a multimodal type takes its text part (AutoModelForCausalLM.from_config does), and
    shrink_config's ``builds`` tries it on that part; a class of the whole config takes it whole."""
    from qn_hf.check.config_part import config_taken_by

    model_class = getattr(transformers, cls)
    shrunk = shrink_config(CONFIG_MAPPING[model_type](), builds=model_class)
    taken = config_taken_by(shrunk, model_class)
    assert taken is (getattr(shrunk, part) if part else shrunk)
    with pytest.raises(Exception), torch.device("meta"):  # noqa: B017 -- each class raises its own kind
        model_class(shrunk) if part else model_class(shrunk.text_config)
    with torch.device("meta"):
        model_class(taken)


@pytest.mark.parametrize(("model_type", "holds"), [
    # a text tower's projection its default sizes as its hidden size shrinks with it (SigLIP compares it with the
    # vision tower's width: "fails alone" before)
    ("siglip", lambda c: c.text_config.projection_size == c.text_config.hidden_size),
    # Perceiver's latent array and video models' clips, which at their default sizes outran a zoo job
    ("perceiver", lambda c: (c.num_latents, c.d_latents, c.num_self_attends_per_block) == (16, 64, 2)),
    ("vivit", lambda c: (c.num_frames, c.image_size) == (4, 32)),
    ("vjepa2", lambda c: (c.frames_per_clip, c.crop_size, c.pred_num_hidden_layers) == (4, 32, 2)),
])
def test_sizes_tied_to_the_shrunk_ones_or_too_large_to_run_are_shrunk(model_type, holds):
    assert holds(shrink_config(CONFIG_MAPPING[model_type]()))
