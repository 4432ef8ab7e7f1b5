"""A random batch any model class can train on: its main input (token ids, images, waveforms, mel
features) sized from its config, and the labels its head's loss reads (``policies/task.py``), so a
shrunk copy of any architecture under any head trains one step in ``qn-hf-check`` and the zoos.

A model without a loss of its own (a base model, or a loss qn_hf does not split) trains on
``probe_loss``: the mean square of its first output, a mean over the rows as a ``loss_fn`` must be.
"""

from __future__ import annotations

import functools
import inspect
import math
from collections.abc import Mapping

import torch
from torch import nn

from ..config.options import IGNORE_INDEX, LossKind
from ..policies.task import main_input_name, task_head
from ..step.packed import batch_rows, packed_keys
from .packed_batch import packed_tower_batch

SEQ_LEN = 12
AUDIO_FRAMES = 12  # frames an audio encoder's feature extractor makes of the waveform


class NoBatch(ValueError):
    """The model's main input is none this module knows how to make (refused, never guessed)."""


def _sub(config, name: str):
    """``config``'s ``name`` part (a vision or audio sub-config), or the config itself."""
    return getattr(config, name, None) or config


def _image(config) -> tuple[int, int, int]:
    vision = _sub(config, "vision_config")
    size = getattr(vision, "image_size", None) or getattr(vision, "crop_size", None) or 224  # (V-JEPA 2's crop)
    height, width = (size, size) if isinstance(size, int) else tuple(size)[:2]
    return getattr(vision, "num_channels", 3) or 3, height, width


# the keys a video model's config counts its clip's frames under
_FRAME_COUNTS = ("num_frames", "frames_per_clip")


def _feature_width(audio) -> int | None:
    """The width of each frame of an audio model that takes its features frames first: its feature projection's
    input (SeamlessM4T's, wav2vec2-BERT's), or its channels' features (Speech2Text's); None for Whisper's layout."""
    width = getattr(audio, "feature_projection_input_dim", None)
    per_channel, channels = getattr(audio, "input_feat_per_channel", None), getattr(audio, "input_channels", None)
    if not isinstance(width, int) and isinstance(per_channel, int) and isinstance(channels, int):
        width = per_channel * channels
    return width if isinstance(width, int) else None


def _frames(config) -> int | None:
    vision = _sub(config, "vision_config")
    return next((f for key in _FRAME_COUNTS if isinstance(f := getattr(vision, key, None), int)), None)


def _vision_inputs(model: nn.Module, *, rows: int, generator: torch.Generator) -> dict[str, torch.Tensor]:
    """Pixels as ``_pixels`` makes them, or where the forward takes the patches' grid (``spatial_shapes``) and
    the vision config counts its patches (SigLIP 2's NaFlex tower), the image already cut in patches: a square
    grid of them, flattened, none padded."""
    vision = _sub(model.config, "vision_config")
    patches, patch = getattr(vision, "num_patches", None), getattr(vision, "patch_size", None)
    if "spatial_shapes" not in inspect.signature(model.forward).parameters or not isinstance(patches, int) \
            or not isinstance(patch, int) or math.isqrt(patches) ** 2 != patches:
        return {"pixel_values": _pixels(model.config, rows=rows, generator=generator)}
    channels = getattr(vision, "num_channels", 3) or 3
    side = math.isqrt(patches)
    return {"pixel_values": torch.randn(rows, patches, channels * patch * patch, generator=generator),
            "pixel_attention_mask": torch.ones(rows, patches, dtype=torch.long),
            "spatial_shapes": torch.tensor([[side, side]] * rows, dtype=torch.long)}


def _pixels(config, *, rows: int, generator: torch.Generator) -> torch.Tensor:
    """Images, or where the vision config counts a clip's frames (VideoMAE, ViViT, TimeSformer, X-CLIP, V-JEPA
    2) clips of that many: (rows, frames, channels, height, width)."""
    channels, height, width = _image(config)
    frames = _frames(config)
    shape = (rows, channels, height, width) if frames is None else (rows, frames, channels, height, width)
    return torch.randn(*shape, generator=generator)


# a multimodal config's placeholder tokens: where the forward splices in image, video or audio features
_PLACEHOLDERS = ("image_token_id", "image_token_index", "video_token_id", "video_token_index", "audio_token_id",
                 "audio_token_index", "boi_token_id", "eoi_token_id", "vision_start_token_id", "vision_end_token_id")


def _placeholder_ids(config) -> set[int]:
    return {v for k in _PLACEHOLDERS if isinstance(v := getattr(config, k, None), int)}


# audio decoders whose input_ids are rows x codebooks token rows, with labels per codebook (MusicGen's): a layout
# the splits of a batch over ranks would have to know
_CODEBOOK_ROWS = ("MusicgenDecoderConfig", "MusicgenMelodyDecoderConfig")
# audio codecs and encoders that take a waveform per channel, (rows, 1, samples), and whose config counts no
# audio_channels (DAC's, PE Audio's, VibeVoice's acoustic tokenizer's; as their feature extractors make it)
_MONO = ("DacConfig", "PeAudioEncoderConfig", "VibeVoiceAcousticTokenizerConfig")


def main_input(model: nn.Module, *, rows: int, seq_len: int, generator: torch.Generator) -> dict[str, torch.Tensor]:
    """The model's main input for ``rows`` examples (``model.main_input_name``)."""
    config = model.config
    name = main_input_name(model)
    if name == "input_ids":
        if type(config).__name__ in _CODEBOOK_ROWS:
            raise NoBatch(f"{type(model).__name__} takes input_ids of rows x {config.num_codebooks} codebooks, "
                          "which qn_hf's checks make no random batch for")
        vocab = getattr(config.get_text_config(), "vocab_size", None) or 100
        shape = (rows, 3, seq_len) if type(model).__name__.endswith("ForMultipleChoice") else (rows, seq_len)
        return {"input_ids": torch.randint(3, vocab, shape, generator=generator)}
    if name == "pixel_values":
        return _vision_inputs(model, rows=rows, generator=generator)
    if name == "input_values":  # a waveform: long enough for the feature extractor's strides
        audio = _sub(config, "audio_config")
        strides = getattr(audio, "conv_stride", None) or [320]
        kernels = getattr(audio, "conv_kernel", None) or [400]
        samples = AUDIO_FRAMES * math.prod(strides) + max(kernels)
        # an audio codec's waveform (EnCodec, Mimi): per channel; one where its config counts none (_MONO)
        channels = getattr(config, "audio_channels", None) or (1 if type(config).__name__ in _MONO else None)
        shape = (rows, channels, samples) if isinstance(channels, int) else (rows, samples)
        return {"input_values": torch.randn(*shape, generator=generator)}
    if name == "input_features":
        # the audio part: an audio sub-config, an ASR model's encoder config (Parakeet's CTC, Canary), or its own
        audio = next((part for key in ("audio_config", "encoder_config")
                      if isinstance(getattr(part := _sub(config, key), "num_mel_bins", None), int)), _sub(config, "audio_config"))
        frames = 2 * (getattr(audio, "max_source_positions", None) or 32)
        width = _feature_width(audio)
        if width is not None:  # frames first, each a vector of features (Speech2Text's, SeamlessM4T's, w2v-BERT's)
            return {"input_features": torch.randn(rows, frames, width, generator=generator)}
        bins = getattr(audio, "num_mel_bins", None) or 80
        if not any(isinstance(m, nn.Conv1d) and m.in_channels == bins for m in model.modules()):
            # no convolution over the mel bins as channels (Whisper's): the frames first, each its mel bins
            # (Parakeet's, Canary's, LASR's subsampling reads them so)
            return {"input_features": torch.randn(rows, frames, bins, generator=generator)}
        return {"input_features": torch.randn(rows, bins, frames, generator=generator)}  # Whisper's: bins x frames
    if name == "inputs_embeds":  # an encoder over given embeddings (Nemotron 3.5's word timestamps)
        width = config.get_text_config().hidden_size
        return {"inputs_embeds": torch.randn(rows, seq_len, width, generator=generator)}
    if name == "latents":  # an audio codec's decoder (Mimi's, Pocket TTS's): (rows, hidden, frames)
        return {"latents": torch.randn(rows, config.hidden_size, AUDIO_FRAMES, generator=generator)}
    if name == "audio_mel":  # Gemma 3n's audio encoder: mel frames, and a mask that is True at padding (none)
        frames = 2 * AUDIO_FRAMES
        return {"audio_mel": torch.randn(rows, frames, config.input_feat_size, generator=generator),
                "audio_mel_mask": torch.zeros(rows, frames, dtype=torch.bool)}
    if name == "pixel_values_videos" and _frames(config) is not None:
        # a video tower (VideoPrism's, V-JEPA 2's): its clip's frames, each an image
        return {"pixel_values_videos": _pixels(config, rows=rows, generator=generator)}
    if name == "states":  # Decision Transformer: a trajectory of states, actions, rewards and returns to go
        return {"states": torch.randn(rows, seq_len, config.state_dim, generator=generator),
                "actions": torch.randn(rows, seq_len, config.act_dim, generator=generator),
                "rewards": torch.randn(rows, seq_len, 1, generator=generator),
                "returns_to_go": torch.randn(rows, seq_len, 1, generator=generator),
                "timesteps": torch.randint(0, config.max_ep_len, (rows, seq_len), generator=generator),
                "attention_mask": torch.ones(rows, seq_len, dtype=torch.long)}
    if name == "past_values":  # a time series: its context, per channel where the model reads several
        context = getattr(config, "context_length", None)
        if isinstance(getattr(config, "num_input_channels", None), int) and isinstance(context, int):
            return {"past_values": torch.randn(rows, context, config.num_input_channels, generator=generator)}
        # a univariate forecaster (TimesFM) takes any length of whole patches: four, not its long context
        length = 4 * (getattr(config, "patch_length", None) or 8)
        series = {"past_values": torch.randn(rows, length, generator=generator)}
        params = inspect.signature(model.forward).parameters
        if "past_values_padding" in params:
            series["past_values_padding"] = torch.zeros(rows, length)  # nothing padded
        if "freq" in params:
            series["freq"] = torch.zeros(rows, 1, dtype=torch.long)  # frequency class 0 (high), as its docs show
        return series
    if name == "inputs":  # Perceiver: whatever its input preprocessor reads
        return {"inputs": _preprocessed(model, rows=rows, seq_len=seq_len, generator=generator)}
    raise NoBatch(f"{type(model).__name__} takes {name!r}, which qn_hf's checks make no random batch for")


def _preprocessed(model: nn.Module, *, rows: int, seq_len: int, generator: torch.Generator) -> torch.Tensor:
    """Perceiver's ``inputs``: token ids where its input preprocessor embeds a vocabulary, an image where it
    preprocesses another input and the config sizes images, else (no preprocessor) embeddings of its
    ``d_model`` features, which its cross-attention reads as they are."""
    config = model.config
    holder = next((m for m in model.modules() if hasattr(m, "input_preprocessor")), None)
    if holder is None:  # (a speech encoder-decoder's inputs: whatever its encoder takes)
        raise NoBatch(f"{type(model).__name__} takes 'inputs', which qn_hf's checks make no random batch for")
    preprocessor = holder.input_preprocessor
    if preprocessor is None and isinstance(getattr(config, "d_model", None), int):
        return torch.randn(rows, seq_len, config.d_model, generator=generator)
    vocab = getattr(config, "vocab_size", None)
    if any(isinstance(m, nn.Embedding) and m.num_embeddings == vocab for m in preprocessor.modules()):
        # as its tokenizer pads them: to the positions its decoder's queries score (max_position_embeddings)
        length = getattr(config, "max_position_embeddings", None) or seq_len
        return torch.randint(3, vocab, (rows, length), generator=generator)
    if isinstance(getattr(config, "image_size", None), int):
        channels, height, width = _image(config)
        return torch.randn(rows, channels, height, width, generator=generator)
    raise NoBatch(f"{type(model).__name__} takes 'inputs' through a {type(preprocessor).__name__}, which qn_hf's "
                  "checks make no random batch for")


def dummy_batch(model: nn.Module, *, rows: int, seq_len: int = SEQ_LEN, seed: int = 1) -> dict[str, torch.Tensor]:
    """A batch of ``rows`` examples for ``model``: its main input, and its head's labels (none for a
    head without a built-in loss: train it with ``probe_loss``)."""
    generator = torch.Generator().manual_seed(seed)
    batch = packed_tower_batch(model, rows=rows, generator=generator) or main_input(
        model, rows=rows, seq_len=seq_len, generator=generator)
    params = inspect.signature(model.forward).parameters
    placeholders = _placeholder_ids(model.config)
    if placeholders and "input_ids" in batch:
        # a model that splices image features in at placeholder tokens (LLaVA, Qwen2-VL, PaliGemma) trains
        # on text alone: how many placeholders an image takes, and what else its vision tower reads (sizes,
        # grids, aspect ratios), is each processor's own; random ids that hit a placeholder are moved off it
        ids = batch["input_ids"]
        for token in placeholders:
            ids[ids == token] = 3 if token != 3 else 4
    elif "pixel_values" in params and "pixel_values" not in batch and getattr(model.config, "vision_config", None):
        # a text-and-image model (CLIP) takes both; a text-and-video one (X-CLIP) clips
        batch.update(_vision_inputs(model, rows=rows, generator=generator))
    if ("noise" in params and "pixel_values" in batch and isinstance(getattr(model.config, "mask_ratio", None), float)
            and isinstance(getattr(model.config, "patch_size", None), int)):
        # ViT-MAE shuffles and masks its patches by noise it draws itself where the caller passes none: no split
        # of the batch over ranks draws what one process draws, so the check passes it, one row per example (a
        # value per patch; Hiera's noise, a value per mask unit of its patch grid, is left to it: only its
        # pretraining class, which the shrink cannot build, masks)
        patch = model.config.patch_size
        patches = (batch["pixel_values"].shape[-2] // patch) * (batch["pixel_values"].shape[-1] // patch)
        batch["noise"] = torch.rand(rows, patches, generator=generator)
    head = task_head(model)
    config = model.config
    text = config.get_text_config()
    vocab = getattr(text, "vocab_size", None) or 100
    ids = batch.get("input_ids", batch.get("inputs"))  # (Perceiver's inputs: token ids or another input)
    positions = ids.shape[-1] if ids is not None and not ids.is_floating_point() else seq_len
    if head.kind is LossKind.CAUSAL_LM and "input_ids" in batch:
        batch["labels"] = batch["input_ids"].clone()
    elif head.kind in (LossKind.CAUSAL_LM, LossKind.TOKENS):
        # an encoder-decoder's config under a token classifier of its encoder (UMT5's, T5Gemma's) scores as many
        # classes as its classifier's width (num_labels); a seq2seq head the vocabulary
        width = _output_width(model, head) if config.is_encoder_decoder else None
        classes = vocab if head.vocab_output or head.kind is LossKind.CAUSAL_LM else width if width is not None \
            else vocab if config.is_encoder_decoder else config.num_labels
        labels = torch.randint(0, classes, (rows, seq_len if config.is_encoder_decoder else positions),
                               generator=generator)
        labels[torch.rand(labels.shape, generator=generator) < 0.25] = IGNORE_INDEX  # some positions unscored
        batch["labels"] = labels
    elif head.kind is LossKind.CLASSIFICATION:
        choices = batch["input_ids"].shape[1] if batch.get("input_ids") is not None and batch["input_ids"].dim() == 3 \
            else config.num_labels
        batch["labels"] = torch.randint(0, choices, (rows,), generator=generator)
        eos = getattr(text, "eos_token_id", None)
        if isinstance(eos, int) and "input_ids" in batch:
            # as a tokenizer ends each text: BART's family pools the classifier at the last end-of-sequence
            # token and refuses rows without one (random ids start above the special ones)
            batch["input_ids"][..., -1] = eos
    elif head.kind is LossKind.SPANS:
        batch["start_positions"] = torch.randint(0, positions, (rows,), generator=generator)
        batch["end_positions"] = torch.randint(0, positions, (rows,), generator=generator)
    languages = getattr(config, "languages", None)
    if "lang_ids" in params and "input_ids" in batch and isinstance(languages, (list, tuple)) and languages:
        # X-MOD routes each row through its language's adapters and refuses a batch that names none (its config
        # sets no default language), as a caller passes them: one a row
        batch["lang_ids"] = torch.randint(0, len(languages), (rows,), generator=generator)
    if (config.is_encoder_decoder and "decoder_input_ids" in params and "labels" not in batch
            and head.kind in (None, LossKind.OWN)):
        # a seq2seq model trained on its outputs makes no decoder input of its own where its labels would
        # (Marian's, Pegasus', Blenderbot's base models and generation heads fail without one; Whisper's, over
        # audio features), as a caller passes it: drawn last, so that no other input of any model changes
        batch["decoder_input_ids"] = torch.randint(3, vocab, (rows, seq_len), generator=generator)
    required = params.get("bool_masked_pos")
    patches = next((n for m in model.modules() if isinstance(n := getattr(m, "num_patches", None), int)), None)
    if required is not None and required.default is required.empty and patches and "pixel_values" in batch:
        # VideoMAE's pretraining reconstructs the patches a caller masks (as its examples do: the same number in
        # every row, which its loss's reshape needs): half of each row's, drawn apart
        batch["bool_masked_pos"] = torch.rand(rows, patches, generator=generator).argsort(dim=1) < patches // 2
    _required_ids(model, params, batch, rows=rows, seq_len=seq_len, generator=generator)
    return batch


def _required_ids(model: nn.Module, params: Mapping[str, inspect.Parameter], batch: dict, *, rows: int, seq_len: int,
                  generator: torch.Generator) -> None:
    """Token ids the forward (its ``params``) requires beside its main input, in place (BLIP-2's and Grounding
    DINO's text, InstructBLIP's Q-Former prompt, in its own vocabulary); any other input it requires: NoBatch,
    naming it (drawn last, so that no other input of any model changes)."""
    kinds = (inspect.Parameter.POSITIONAL_OR_KEYWORD, inspect.Parameter.KEYWORD_ONLY)
    missing = [n for n, p in params.items() if p.kind in kinds and p.default is p.empty and n not in batch]
    for name in [n for n in missing if n.endswith("input_ids")]:
        part = getattr(model.config, name.removesuffix("input_ids") + "config", None)  # qformer_ -> qformer_config
        vocab = getattr(part or model.config.get_text_config(), "vocab_size", None) or 100
        batch[name] = torch.randint(3, vocab, (rows, seq_len), generator=generator)
        missing.remove(name)
    if missing:
        raise NoBatch(f"{type(model).__name__} requires {', '.join(map(repr, missing))}, which qn_hf's checks make "
                      "no random batch for")


def _output_width(model: torch.nn.Module, head) -> int | None:
    """The width of the last module in the head's modules that has one (a classifier's ``out_features``,
    inside a classification head's block as T5Gemma's ``score.out_proj``), or None."""
    for name in reversed(head.modules):
        for module in reversed(list(model.get_submodule(name).modules())):
            width = getattr(module, "out_features", None)
            if isinstance(width, int):
                return width
    return None


# outputs that compare every row with every other (a contrastive model's similarity matrices): a mean
# of them over a dp rank's rows is not that over the batch's, so the probe never reads them
_ACROSS_ROWS = ("logits_per_image", "logits_per_text", "logits_per_video", "logits_per_audio")
# outputs that hold, per row, one value for every row of another input where they are rows x rows (X-CLIP's text
# embeddings: every text of the batch prompted by each video's features), likewise never read
_PAIRED = ("text_embeds",)


def probe_loss(outputs, batch: Mapping[str, torch.Tensor]) -> torch.Tensor:
    """A loss for a model without its own: over its floating outputs computed per row (logits, hidden
    states, embeddings, a tower's outputs inside), the sum of the mean squares of each shifted by a fixed
    pattern, each a mean over the rows, as a ``loss_fn`` is. The shift matters: a plain mean square is
    constant on a unit-normalized embedding (BLIP's, CLIP's) and on a LayerNorm's output at its initial
    weights, so the gradient reaching the layers before would be rounding noise, which no two orders of
    summation share; shifted, each row's loss depends on the direction of its output. Only outputs whose
    first dimension is the batch's rows are read: a sequence-first tensor (BridgeTower's vision tower keeps
    CLIP's old positions x rows layout) would take a pattern over rows, which a rank's share of them
    does not repeat."""
    packed = bool(packed_keys(batch))
    rows = batch_rows(batch) if packed else next(
        (v.shape[0] for v in batch.values() if isinstance(v, torch.Tensor) and v.dim() >= 1), None)
    outputs_read = _per_row(outputs, rows)
    read = [t for t in outputs_read if t.shape[0] == rows]
    # a packed batch's outputs over its items (a vision tower's patches, back to back): each row's sum, meaned
    # over the rows (the items of a rank's rows are its own); the pattern spans one patch, the same on every rank
    # (HunYuan-VL's tower keeps a batch dim of 1 before them: read per patch, over the last dim)
    items = [t.reshape(-1, t.shape[-1]) for t in outputs_read if t.shape[0] != rows] if packed else []
    # float32 at least: a float64 model's loss stays float64 (the check's float64 step)
    wide = functools.reduce(torch.promote_types, [t.dtype for t in read + items], torch.float32)
    loss = sum(((t.to(wide) + _pattern(t, wide)).square().mean() for t in read), torch.zeros((), dtype=wide))
    return loss + sum(((t.to(wide) + _pattern(t, wide)).square().sum() / (rows * t[0].numel()) for t in items),
                      torch.zeros((), dtype=wide))


def _pattern(t: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """A fixed shift of one row's shape (the same for every row): cos of the element's index in the row."""
    shape = t.shape[1:]
    return torch.cos(torch.arange(math.prod(shape), dtype=torch.float32, device=t.device)).to(dtype).reshape(shape)


def _per_row(outputs, rows: int | None = None) -> list[torch.Tensor]:
    if isinstance(outputs, torch.Tensor):
        return [outputs] if outputs.is_floating_point() and outputs.dim() >= 1 else []
    items = outputs.items() if hasattr(outputs, "items") else enumerate(outputs) if isinstance(outputs, tuple) else []
    return [t for k, v in items if k not in _ACROSS_ROWS
            and not (k in _PAIRED and isinstance(v, torch.Tensor) and tuple(v.shape[:2]) == (rows, rows))
            for t in _per_row(v, rows)]
