"""Every head, found from the model, with the loss its own forward computes (policies/task.py), split
exactly over microbatches (step/loss.py): the unit tier holds the rules, each against transformers'
own loss on the same rows."""

from __future__ import annotations

import pytest
import torch
import transformers
from transformers import CONFIG_MAPPING

from qn_hf.check.inputs import dummy_batch
from qn_hf.check.run import build
from qn_hf.check.shrink import shrink_config
from qn_hf.config.options import IGNORE_INDEX, LossKind, ProblemType
from qn_hf.policies.task import task_head
from qn_hf.step.loss import local_count, loss_scales, problem_type, summed_loss, term_weights
from tests.releases import needs_model_type

# Sub-configurations a model type needs named: transformers 5.17's EncoderDecoderConfig has no default
# encoder and decoder (later releases default to BERT's, these same ones).
_SUB_CONFIGS = {"encoder-decoder": {"encoder": {"model_type": "bert"},
                                    "decoder": {"model_type": "bert", "is_decoder": True, "add_cross_attention": True}}}


def _meta(model_type: str, cls: str, **overrides):
    config = shrink_config(CONFIG_MAPPING[model_type](**{**_SUB_CONFIGS.get(model_type, {}), **overrides}))
    with torch.device("meta"):
        return getattr(transformers, cls)(config)


@pytest.mark.parametrize(("model_type", "cls", "kind", "extra"), [
    ("llama", "LlamaForCausalLM", LossKind.CAUSAL_LM, {"vocab_output": "lm_head"}),
    ("gpt2", "GPT2LMHeadModel", LossKind.CAUSAL_LM, {"vocab_output": "lm_head"}),  # loss_type None: ForCausalLM
    ("bart", "BartForCausalLM", LossKind.TOKENS, {}),  # a causal LM whose inline loss does not shift
    ("bert", "BertForMaskedLM", LossKind.TOKENS, {"vocab_output": "cls.predictions.decoder"}),
    ("t5", "T5ForConditionalGeneration", LossKind.TOKENS, {"decoder_from_labels": True}),
    # FSMT makes its decoder's input from input_ids, not the labels: given the labels', it trained another model
    ("fsmt", "FSMTForConditionalGeneration", LossKind.TOKENS, {"decoder_from_labels": False}),
    # EncoderDecoderModel masks the padding of the decoder's input it makes from the labels
    ("encoder-decoder", "EncoderDecoderModel", LossKind.TOKENS, {"decoder_from_labels": True,
                                                                 "decoder_padding_mask": True}),
    ("t5gemma", "T5GemmaForConditionalGeneration", LossKind.TOKENS, {}),  # its loss_type override: ForMaskedLM
    ("gemma3", "Gemma3ForConditionalGeneration", LossKind.CAUSAL_LM, {}),
    ("llama", "LlamaForSequenceClassification", LossKind.CLASSIFICATION, {"problem_types": True, "modules": ("score",)}),
    ("bert", "BertForMultipleChoice", LossKind.CLASSIFICATION, {"problem_types": False, "reshapes_inputs": True}),
    ("wav2vec2", "Wav2Vec2ForSequenceClassification", LossKind.CLASSIFICATION, {"problem_types": False}),
    ("deberta-v2", "DebertaV2ForSequenceClassification", LossKind.CLASSIFICATION, {"own_problem_types": True}),
    ("biogpt", "BioGptForTokenClassification", LossKind.TOKENS, {"mask_labels": True}),
    ("bert", "BertForQuestionAnswering", LossKind.SPANS, {}),
    ("git", "GitForCausalLM", LossKind.OWN, {}),
    ("clip", "CLIPModel", LossKind.OWN, {}),
    ("bert", "BertModel", None, {}),
])
def test_the_head_and_its_loss_are_found_from_the_model(model_type, cls, kind, extra):
    head = task_head(_meta(model_type, cls))
    assert head.kind == kind, head
    for name, value in extra.items():
        assert getattr(head, name) == value, (name, head)


def test_a_class_transformers_computes_its_own_way_trains_its_own_loss():
    model = _meta("switch_transformers", "SwitchTransformersForConditionalGeneration")
    assert task_head(model).kind is LossKind.TOKENS
    model.config.output_router_logits = True  # its forward then adds the routers' z-loss and balancing terms
    head = task_head(model)
    assert head.kind is LossKind.OWN and "output_router_logits" in head.why_own


def _split_loss(model, batch, *, parts: int) -> torch.Tensor:
    """The built-in loss summed over ``parts`` microbatches, each scaled by the whole batch's counts."""
    head = task_head(model)
    problem = problem_type(model.config, batch["labels"], problem_types=head.problem_types,
                           own=head.own_problem_types) if head.kind is LossKind.CLASSIFICATION else None
    count = local_count(batch, kind=head.kind, head=head, problem=problem, device=torch.device("cpu"))
    rows = [len(r) for r in torch.tensor_split(torch.arange(next(iter(batch.values())).shape[0]), parts)]
    scales = loss_scales(count, rows=rows, builtin=True, weights=term_weights(head.kind))
    total = torch.zeros(())
    for part, scale in zip(range(parts), scales):
        micro = {k: torch.tensor_split(v, parts)[part] for k, v in batch.items()}
        inputs = {k: v for k, v in micro.items() if k not in head.label_keys}
        if head.decoder_from_labels:
            inputs["decoder_input_ids"] = model.prepare_decoder_input_ids_from_labels(labels=micro["labels"])
        sums = summed_loss(model(**inputs), micro, kind=head.kind, head=head, problem=problem, vocab=None, group=None)
        total = total + (sums.double() * scale).sum()
    return total


@pytest.mark.parametrize(("model_type", "cls", "overrides", "labels"), [
    ("llama", "LlamaForCausalLM", {}, None),
    ("bart", "BartForCausalLM", {}, None),
    ("bert", "BertForMaskedLM", {}, None),
    ("t5", "T5ForConditionalGeneration", {}, None),
    ("bert", "BertForTokenClassification", {}, None),
    ("biogpt", "BioGptForTokenClassification", {}, "masked"),
    ("bert", "BertForSequenceClassification", {}, None),
    ("bert", "BertForSequenceClassification", {"num_labels": 1}, "regression"),
    ("bert", "BertForSequenceClassification", {"num_labels": 3}, "multi_label"),
    ("deberta-v2", "DebertaV2ForSequenceClassification", {"num_labels": 3}, "soft"),
    ("deberta-v2", "DebertaV2ForSequenceClassification", {"num_labels": 3}, "negative"),
    ("bert", "BertForMultipleChoice", {}, None),
    ("bert", "BertForQuestionAnswering", {}, "out_of_span"),
    ("vit", "ViTForImageClassification", {}, None),
])
def test_each_kind_split_over_microbatches_is_the_models_own_loss(model_type, cls, overrides, labels):
    """The sum over three uneven microbatches (of 7 rows) of each one's scaled sums equals the plain
    model's own ``outputs.loss`` on all the rows, for every kind of head and problem type."""
    config = shrink_config(CONFIG_MAPPING[model_type](**overrides))
    if getattr(config, "pad_token_id", 0) is None:
        config.pad_token_id = 0
    model = build(config, seed=0, name=cls).eval()
    batch = dummy_batch(model, rows=7, seed=3)
    g = torch.Generator().manual_seed(4)
    if labels == "regression":
        batch["labels"] = torch.randn(7, generator=g)
    elif labels == "multi_label":
        batch["labels"] = (torch.rand(7, 3, generator=g) > 0.5).float()
    elif labels == "soft":
        batch["labels"] = torch.softmax(torch.randn(7, 3, generator=g), -1)
    elif labels == "negative":  # DeBERTa drops every negative label without a problem_type
        batch["labels"][:3] = torch.tensor([-1, IGNORE_INDEX, -7])
    elif labels == "masked":  # BioGPT's token classifier leaves out what its attention mask does
        batch["attention_mask"] = (torch.rand(batch["input_ids"].shape, generator=g) > 0.3).long()
    elif labels == "out_of_span":  # past the sequence: ignored, and the ends' count differs from the starts'
        batch["end_positions"][:2] = 40
        batch["start_positions"][0] = -100  # clamped to 0: a target, as transformers scores it
    with torch.no_grad():
        ours = _split_loss(model, batch, parts=3)
        plain = model(**batch).loss
    assert torch.allclose(ours.float(), plain.float(), rtol=1e-5), (ours, plain)


def test_problem_types_follow_transformers():
    config = shrink_config(CONFIG_MAPPING["bert"](num_labels=3))
    ints, floats = torch.tensor([0, 2]), torch.rand(2, 3)
    assert problem_type(config, ints, problem_types=True) is ProblemType.SINGLE_LABEL
    assert problem_type(config, floats, problem_types=True) is ProblemType.MULTI_LABEL
    assert problem_type(config, floats, problem_types=False) is ProblemType.SINGLE_LABEL  # multiple choice, audio
    assert problem_type(config, floats, problem_types=True, own=True) is ProblemType.SOFT_LABEL  # DeBERTa
    config.problem_type = "regression"
    assert problem_type(config, ints, problem_types=True) is ProblemType.REGRESSION


@pytest.mark.parametrize(("model_type", "cls", "overrides", "inputs", "decoder"), [
    ("bert", "BertForSequenceClassification", {"max_position_embeddings": 40}, 40, None),
    ("roberta", "RobertaForMaskedLM", {"max_position_embeddings": 40, "pad_token_id": 1}, 38, None),  # from padding_idx + 1
    ("gpt2", "GPT2LMHeadModel", {"n_positions": 40}, 40, None),
    ("bart", "BartForConditionalGeneration", {"max_position_embeddings": 40}, 40, 40),  # offset 2 rows
    ("led", "LEDForConditionalGeneration", {"max_encoder_position_embeddings": 64, "max_decoder_position_embeddings": 40},
     64, 40),
    ("llama", "LlamaForCausalLM", {"max_position_embeddings": 40}, None, None),  # RoPE: no table, no limit
    ("t5", "T5ForConditionalGeneration", {}, None, None),  # relative positions
])
def test_sequences_longer_than_a_position_table_are_refused(model_type, cls, overrides, inputs, decoder):
    """The longest sequences are read from the model's own position tables (policies/positions.py), per
    stack of an encoder-decoder, and a longer batch is one ValueError naming the table, where the plain
    model would fail on an index inside its forward (a device-side assert on CUDA)."""
    from qn_hf.policies.positions import learned_positions
    from qn_hf.step.batch import check_model_inputs

    config = shrink_config(CONFIG_MAPPING[model_type]())
    for key, value in overrides.items():  # after shrinking, which sets its own lengths
        setattr(config, key, value)
    model = build(config, seed=0, name=cls)
    limits = learned_positions(model)
    assert (limits.inputs and limits.inputs.positions, limits.decoder and limits.decoder.positions) == (inputs, decoder)
    for key, most in (("input_ids", inputs), ("labels", decoder)):
        if most is None:
            continue
        batch = {"input_ids": torch.ones(2, inputs if key == "labels" else most + 1, dtype=torch.long)}
        batch["labels"] = torch.ones(2, most + 1 if key == "labels" else 4, dtype=torch.long)
        with pytest.raises(ValueError, match=rf"sequence length {most + 1} exceeds the model's {most} positions .*{key}"):
            check_model_inputs(batch, model=model, loss=None, positions=limits)
        batch[key] = batch[key][:, :most]
        check_model_inputs(batch, model=model, loss=None, positions=limits)
    if inputs is not None:  # the plain model agrees: one position more is out of its table
        with pytest.raises((IndexError, RuntimeError)):
            model(input_ids=torch.full((1, inputs + 1), 2),  # no padding token (RoBERTa numbers the others)
                  **({"decoder_input_ids": torch.ones(1, 2, dtype=torch.long)} if decoder else {}))


def test_a_decoder_on_several_stages_needs_the_decoders_inputs_in_the_batch():
    """BART's classifier makes its decoder's inputs from input_ids inside its forward, which only the
    last chunk runs whole: with the decoder on more than one stage the batch must carry them."""
    from qn_hf.step.batch import check_step_batch

    model = build(shrink_config(CONFIG_MAPPING["bart"]()), seed=0, name="BartForSequenceClassification")
    batch = dummy_batch(model, rows=2)
    check = dict(model=model, loss=LossKind.CLASSIFICATION, builtin=True, microbatches=1, cp=1, cp_keys=(),
                 split=(1, ""), config=model.config, head=task_head(model))
    assert check_step_batch(batch, **check, decoder_stages=1) == 2
    with pytest.raises(ValueError, match="decoder runs on 2 pipeline stages.*pass decoder_input_ids"):
        check_step_batch(batch, **check, decoder_stages=2)
    decoder = {"decoder_input_ids": batch["input_ids"].clone()}
    assert check_step_batch({**batch, **decoder}, **check, decoder_stages=2) == 2


def test_the_image_size_checked_is_the_vision_models_own():
    """A vision model's config fixes its input's size (ViT's position table): another is a ValueError. A
    composite config's top-level image_size may be its processor's (MiniCPM-V 4.6 slices images to 448
    while its tower takes 224), so it is not read: the tower's own size trains."""
    from qn_hf.step.batch import check_model_inputs

    vit = build(shrink_config(CONFIG_MAPPING["vit"]()), seed=0, name="ViTModel")
    size = vit.config.image_size
    check_model_inputs({"pixel_values": torch.zeros(2, 3, size, size)}, model=vit, loss=None)
    with pytest.raises(ValueError, match=rf"has shape \(2, 3, {size + 2}, {size + 2}\); the model takes \(batch, 3, {size}"):
        check_model_inputs({"pixel_values": torch.zeros(2, 3, size + 2, size + 2)}, model=vit, loss=None)
    if "minicpmv4_6" not in CONFIG_MAPPING:
        return  # transformers before 5.2x
    model = build(shrink_config(CONFIG_MAPPING["minicpmv4_6"]()), seed=0, name="MiniCPMV4_6Model")
    batch = dummy_batch(model, rows=2)
    assert model.config.image_size != batch["pixel_values"].shape[-1] == model.config.vision_config.image_size
    check_model_inputs(batch, model=model, loss=None)
    model(**batch)  # the plain model takes it


@pytest.mark.parametrize(("model_type", "cls", "shapes"), [
    ("patchtst", "PatchTSTModel", {"past_values": (2, 32, 1)}),  # its context, per channel
    # a univariate forecaster: whole patches, nothing padded, a frequency class per series
    ("timesfm", "TimesFmModel", {"past_values": (2, 128), "past_values_padding": (2, 128), "freq": (2, 1)}),
    # Hiera's masking noise is a value per mask unit of its patch grid (patch_size a pair), not ViT-MAE's per patch:
    # none passed (the check's batch crashed on it), and only its pretraining class masks
    ("hiera", "HieraModel", {"pixel_values": (2, 3, 224, 224)}),
    ("decision_transformer", "DecisionTransformerModel", {"states": (2, 12, 17), "actions": (2, 12, 4),
                                                          "rewards": (2, 12, 1), "returns_to_go": (2, 12, 1),
                                                          "timesteps": (2, 12), "attention_mask": (2, 12)}),
    # embeddings given (Nemotron 3.5's word timestamps); an audio codec's decoder's latents (hidden x frames);
    # Gemma 3n's mel frames, none padded; a video tower's clip, and the text a contrastive one requires beside it
    ("nemotron3_5_transcribe_word_timestamp", "Nemotron3_5TranscribeWordTimestampModel", {"inputs_embeds": (2, 12, 64)}),
    ("mimi_decoder", "MimiDecoderModel", {"latents": (2, 64, 12)}),
    # a seq2seq model over audio features whose head is its own: the decoder's input, as a caller passes it
    ("whisper", "WhisperForConditionalGeneration", {"input_features": (2, 80, 64), "decoder_input_ids": (2, 12)}),
    # a vision tower whose main_input_name is transformers' default input_ids, and whose forward takes pixel_values
    ("smolvlm_vision", "SmolVLMVisionTransformer", {"pixel_values": (2, 3, 224, 224)}),
    ("gemma3n_audio", "Gemma3nAudioEncoder", {"audio_mel": (2, 24, 128), "audio_mel_mask": (2, 24)}),
    ("videoprism", "VideoPrismClipModel", {"pixel_values_videos": (2, 4, 3, 72, 72), "input_ids": (2, 12)}),
    # Perceiver's inputs, what its preprocessor reads: token ids padded to its decoder's queries, an image, or
    # (none) embeddings of d_model features
    ("perceiver", "PerceiverForMaskedLM", {"inputs": (2, 128), "labels": (2, 128)}),
    ("perceiver", "PerceiverForImageClassificationLearned", {"inputs": (2, 3, 56, 56), "labels": (2,)}),
    ("perceiver", "PerceiverModel", {"inputs": (2, 12, 64)}),
    # video models: clips of the frames their config counts (were images: "fails alone" on their unpacking of
    # five dimensions); VideoMAE's pretraining the same number of
    # patches masked in every row
    ("vivit", "VivitModel", {"pixel_values": (2, 4, 3, 32, 32)}),
    ("vjepa2", "VJEPA2Model", {"pixel_values_videos": (2, 4, 3, 32, 32)}),
    ("xclip", "XCLIPModel", {"input_ids": (2, 12), "pixel_values": (2, 4, 3, 64, 64)}),
    ("videomae", "VideoMAEForPreTraining", {"pixel_values": (2, 4, 3, 32, 32), "bool_masked_pos": (2, 8)}),
    # audio features frames first, each its projection's width (were Whisper's mel bins x frames: "fails alone")
    ("wav2vec2-bert", "Wav2Vec2BertModel", {"input_features": (2, 64, 160)}),
    ("speech_to_text", "Speech2TextModel", {"input_features": (2, 64, 80), "decoder_input_ids": (2, 12)}),
    # mel bins no convolution takes as channels (Whisper's does): frames first, each its bins, read off an ASR
    # model's encoder config (Parakeet's CTC head)
    ("parakeet_ctc", "ParakeetForCTC", {"input_features": (2, 64, 80)}),
    # an audio codec's waveform per channel where its config counts none (DAC's)
    ("dac", "DacModel", {"input_values": (2, 1, 4240)}),
    # SigLIP 2's NaFlex tower takes its image cut in patches, with their mask and grid
    ("siglip2_vision_model", "Siglip2VisionModel", {"pixel_values": (2, 256, 768), "pixel_attention_mask": (2, 256),
                                                    "spatial_shapes": (2, 2)}),
])
def test_a_model_with_a_main_input_of_its_own_gets_a_batch_it_runs_on(model_type, cls, shapes):
    needs_model_type(model_type)
    model = build(shrink_config(CONFIG_MAPPING[model_type](), builds=getattr(transformers, cls)), seed=0, name=cls)
    batch = dummy_batch(model, rows=2)
    assert {k: tuple(v.shape) for k, v in batch.items()} == shapes
    from qn_hf.step.batch import check_model_inputs

    check_model_inputs(batch, model=model, loss=None)  # and so does qn_hf's check of a batch
    model(**batch)  # the plain model takes it


def test_an_input_the_forward_requires_and_the_check_cannot_make_is_no_batch():
    """SegGPT requires a prompt image and its mask beside the image, which the check does not make: no batch, naming
    them (a TypeError from the plain forward was counted as the model failing alone)."""
    from qn_hf.check.inputs import NoBatch

    model = build(shrink_config(CONFIG_MAPPING["seggpt"]()), seed=0, name="SegGptModel")
    with pytest.raises(NoBatch, match="SegGptModel requires 'prompt_pixel_values', 'prompt_masks'"):
        dummy_batch(model, rows=2)


def test_a_vision_tower_taking_packed_patches_gets_one_image_a_row():
    """Qwen3-VL's vision tower takes every image's patches back to back beside their grid (the processor's
    layout): the check makes it, each row an image of other sizes (check/packed_batch.py), and it trains."""
    from qn_hf.check.inputs import probe_loss
    from qn_hf.step.packed import row_layout

    model = build(shrink_config(CONFIG_MAPPING["qwen3_vl"]()).vision_config, seed=0, name="Qwen3VLVisionModel")
    batch = dummy_batch(model, rows=3)
    assert batch["grid_thw"].tolist() == [[1, 4, 4], [1, 2, 4], [1, 4, 2]]
    assert tuple(batch["hidden_states"].shape) == (32, 3 * 2 * 16 * 16)  # a Conv3d's channels x kernel
    assert row_layout(batch, model.config).bounds == {"hidden_states": (0, 16, 24, 32)}
    loss = probe_loss(model(**batch), batch)
    loss.backward()
    assert loss > 0 and model.patch_embed.proj.weight.grad.abs().sum() > 0


def test_the_probe_reads_no_output_that_pairs_every_row_with_every_other():
    """X-CLIP's text embeddings are every text of the batch prompted by each video (videos x texts x width): a dp
    rank's share pairs its rows with its own only, so the probe leaves them out, as CLIP's similarity logits;
    CLIP's text embeddings, one a row, it reads."""
    from qn_hf.check.inputs import probe_loss

    batch = {"input_ids": torch.zeros(4, 12, dtype=torch.long)}
    pooled = torch.randn(4, 8)
    paired = {"text_embeds": torch.randn(4, 4, 8), "image_embeds": pooled}
    assert torch.equal(probe_loss(paired, batch), probe_loss({"image_embeds": pooled}, batch))
    per_row = {"text_embeds": torch.randn(4, 8), "image_embeds": pooled}
    assert not torch.equal(probe_loss(per_row, batch), probe_loss({"image_embeds": pooled}, batch))


def test_a_main_input_named_among_several_is_the_first_the_forward_takes():
    """transformers 5.24 names OneFormer's main inputs as a list (pixel_values, task_inputs): the batch key is
    the first of them the forward takes (a list is no key: the heads zoo's OneFormer cases failed on it)."""
    from qn_hf.policies.task import main_input_name

    class Several(torch.nn.Module):
        main_input_name = ["pixel_values", "task_inputs"]

        def forward(self, pixel_values, task_inputs):
            return pixel_values

    class Unknown(Several):
        main_input_name = ["frames", "pixel_values"]

    assert main_input_name(Several()) == "pixel_values" and main_input_name(Unknown()) == "pixel_values"
