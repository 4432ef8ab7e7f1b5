"""A shrunk random copy of an architecture: the same config class and model class, small widths.

``shrink_config`` keeps every switch of the original config (attention kinds, norms, MoE routing,
layer patterns, softcapping, scales) and replaces only sizes, so the shrunk model runs the same code
paths as the full one, in seconds on a CPU. Every dropout is set to 0, so two runs of one step are
comparable bit for bit up to float summation order. Used by ``qn-hf-check`` and the model-zoo test.
"""

from __future__ import annotations

import re
from collections.abc import Callable

import torch
from transformers import PretrainedConfig

from .config_part import config_taken_by
from .gaps import COMPUTED, DEFAULT_GAPS
from .repair import repaired, widths_scaled
from .sizes import EXPERTS, HEAD_DIM, HEADS, HIDDEN, LAYERS, STAGE_DEPTH, VOCAB
from .sizes import LAYER_COUNTS as _LAYER_COUNTS
from .sizes import is_size as _is_size

# size key -> value (applied only to keys the config has and that are set)
_SIZES: dict[str, int] = {
    "hidden_size": HIDDEN, "intermediate_size": 128, "num_attention_heads": HEADS,
    "num_attention_heads_per_layer": HEADS,
    "intermediate_size_per_layer": 128, "head_dim": HEAD_DIM,
    "num_hidden_layers": LAYERS, "vocab_size": VOCAB, "max_position_embeddings": 128,
    # the rows a head keeps of a vocabulary the checkpoint pads (Inkling 2's LM head: 200,058 of 201,024, padded
    # back on save_pretrained from transformers 5.24, which fails where the padded size is the smaller)
    "unpadded_vocab_size": VOCAB,
    # mixture of experts
    "num_experts": EXPERTS, "num_local_experts": EXPERTS, "n_routed_experts": EXPERTS, "moe_num_experts": EXPERTS,
    "num_experts_per_tok": 2, "num_experts_per_token": 2, "moe_topk": 2, "moe_k": 2,
    "moe_intermediate_size": 32, "shared_expert_intermediate_size": 32, "shared_experts_intermediate_size": 32,
    "moe_shared_expert_intermediate_size": 32, "shared_intermediate_size": 32, "expert_ffn_hidden_size": 32,
    "dense_intermediate_size": 128, "intermediate_size_mlp": 128, "ffn_hidden_size": 128,
    "n_shared_experts": 1, "num_shared_experts": 1, "moe_num_shared_experts": 1,
    "n_group": 1, "topk_group": 1, "num_expert_group": 1, "first_k_dense_replace": 1, "num_dense_layers": 1,
    # multi-head latent attention
    "q_lora_rank": 32, "kv_lora_rank": 16, "qk_rope_head_dim": 8, "qk_nope_head_dim": 8, "v_head_dim": HEAD_DIM,
    "qk_head_dim": HEAD_DIM, "o_lora_rank": 16,
    # sparse attention indexers, linear attention, state-space mixers
    "index_n_heads": HEADS, "index_head_dim": HEAD_DIM, "index_topk": 8,
    "linear_num_key_heads": HEADS, "linear_num_value_heads": HEADS, "linear_key_head_dim": HEAD_DIM,
    "linear_value_head_dim": HEAD_DIM, "linear_num_heads": HEADS, "linear_head_dim": HEAD_DIM,
    "mamba_n_heads": HEADS, "mamba_num_heads": HEADS, "mamba_d_head": HEAD_DIM, "mamba_head_dim": HEAD_DIM,
    "mamba_d_state": 16, "ssm_state_size": 16, "mamba_n_groups": 1, "n_groups": 1, "mamba_chunk_size": 8,
    "chunk_size": 8, "mamba_dt_rank": 8,
    "swa_num_attention_heads": HEADS, "swa_head_dim": HEAD_DIM,
    # Qwen 4's sparse attention indexer: left None by the default config (a None size is filled, which
    # turns the indexed layers on); its own validation wants one kv head and budget % ratio == 0
    "indexer_n_heads": HEADS, "indexer_kv_heads": 1, "indexer_head_dim": HEAD_DIM, "indexer_budget": 8,
    "indexer_compress_ratio": 4,
    "hc_lowrank": 16,  # hyper-connection mixer rank (320 would dominate the shrunk model)
    "hidden_size_per_layer_input": 16, "vocab_size_per_layer_input": VOCAB, "laurel_rank": 8,
    "num_nextn_predict_layers": 0,
    # encoder-decoder models (BART, T5, Whisper) and other encoders name their sizes their own way
    "d_model": HIDDEN, "encoder_attention_heads": HEADS, "decoder_attention_heads": HEADS, "num_heads": HEADS,
    "encoder_ffn_dim": 128, "decoder_ffn_dim": 128, "d_ff": 128, "d_kv": HEAD_DIM, "max_source_positions": 32,
    "max_target_positions": 128, "pooler_hidden_size": HIDDEN,
    # Perceiver's latent array (256 latents of 1,280 features, 26 self-attentions a block by default: 260 M
    # parameters, 15 s a forward on 2 cores) and its decoders' query widths
    "num_latents": 16, "d_latents": HIDDEN, "num_self_attends_per_block": 2, "num_self_attention_heads": HEADS,
    "num_cross_attention_heads": HEADS, "output_num_channels": 32, "_label_trainable_num_channels": 32,
}
_TOKEN_IDS = {"pad_token_id": 0, "bos_token_id": 1, "eos_token_id": 2}
# Compound-scaled conv towers (EfficientNet, ALIGN's vision tower) spell their sizes as scaling coefficients
# over a block table and the image size: the same blocks once each on 64-pixel images (the defaults, 600 pixels
# at depth 3.1, are 90 s a step on a CPU). The widths stay: ALIGN projects its text to the tower's output width,
# and the head's width (hidden_dim) is the table's, scaled.
_COMPOUND_SCALED = {"depth_coefficient": 1.0, "image_size": 64}
# Staged towers (ResNet, BiT, ConvNeXt, RegNet, Swin, LeViT, ...) count blocks per stage in a list: two a stage
# at most, so that both a stage's first block (its downsampling shortcut) and a repeated one, and Swin's
# alternating shifted windows, still run; the stage count stays (strides, heads and widths are per stage).
# ResNet-50's 16 blocks at 2048 channels left the float32 model's own gradients 0.4% from a float64 run's.
_STAGE_DEPTHS = ("depths",)
# Scalar multipliers that default to 1.0 (Granite's muP scalars, AFMoE's routing scale) get another
# value: at 1.0 applying one twice, or on the wrong side of a stage or tp boundary, changes nothing,
# and the zoo would call equal what a real checkpoint (Granite 3: embedding_multiplier=12) trains
# differently. Not a power of two, so no rounding hides a repeat.
_MULTIPLIERS = ("embedding_multiplier", "residual_multiplier", "attention_multiplier", "logits_scaling", "route_scale")
MULTIPLIER = 1.37

_DEFAULT_ROPE = {"rope_type": "default", "rope_theta": 10000.0}
_MROPE_AXES = 3  # M-RoPE's sections: time, height, width

# random augmentations in training besides dropout (wav2vec2's SpecAugment masks, LayerDrop, stochastic depth as
# drop path or drop connect, router jitter): no split of the batch draws what one process draws, so like dropout
# they are off in a shrunk copy. CvT spells its rates per stage as lists (drop_path_rate [0, 0, 0.1]); ALIGN's
# and EfficientNet's towers drop whole rows' residuals by drop_connect_rate (0.2): both were "different" at dp=2.
_RANDOM_IN_TRAINING = re.compile(r"dropout|pdrop$|layerdrop$|drop_?path|drop_connect_rate$|(^|_)drop(_[a-z]+)*_rate$"
                                 r"|jitter_noise$|^mask_(time|feature)_prob$")


# random augmentations whose "off" is None, not 0: DINOv3's RoPE augmentation draws a rescale of the patch
# coordinates in every training forward (pos_embed_rescale=2.0 by default)
_RANDOM_OFF_AS_NONE = ("pos_embed_shift", "pos_embed_jitter", "pos_embed_rescale")


def _is_dropout(key: str) -> bool:
    return _RANDOM_IN_TRAINING.search(key) is not None


def _is_rate(value: object) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def _gaps(data: dict, config_class: str) -> dict:
    return DEFAULT_GAPS.get(data.get("model_type") or config_class, {})


def _fill_gaps(data: dict, *, mrope: bool, config_class: str) -> None:
    """Fill, in place, what the default config leaves for a checkpoint and the model needs. ``mrope``:
    the model reads M-RoPE sections from its rope."""
    start = data.get("decoder_start_token_id")
    if (start is None and data.get("is_encoder_decoder")) or (isinstance(start, int) and start >= VOCAB):
        # the decoder's first input: a checkpoint's config names it (T5's default config does not), and where
        # the default's is beyond the shrunk vocabulary (Marian's pad, 58100; Whisper's end of text, 50257), the pad
        data["decoder_start_token_id"] = _TOKEN_IDS["pad_token_id"]
    for key, value in _gaps(data, config_class).items():
        if isinstance(value, dict):
            continue  # a sub-config's: filled once it is shrunk (_shrunk)
        if value is COMPUTED:
            data.pop(key, None)
        else:
            data[key] = _resized_pattern(value, data["num_hidden_layers"]) if isinstance(value, list) else value
    kinds = data.get("layer_types")
    if data.get("rope_parameters") == {} and isinstance(kinds, list) and kinds:
        # An empty rope dict beside layer kinds is a per-kind rope left empty (Cohere Compass reads
        # rope_parameters[layer_type]): every kind gets the default rope, with M-RoPE sections where
        # the model reads them (sized for the shrunk head by _resize_rope; the model's own default is
        # sized for the full head, which transformers before 5.21 cannot build a smaller head with).
        rope = {**_DEFAULT_ROPE, **({"mrope_section": [1] * _MROPE_AXES} if mrope else {})}
        data["rope_parameters"] = {kind: dict(rope) for kind in dict.fromkeys(kinds)}
    rope = data.get("rope_parameters")
    if mrope and isinstance(rope, dict) and rope.get("rope_type") and "mrope_section" not in rope:
        # a rope without sections where the model falls back to the full head's ([16, 24, 24] in Qwen2-VL,
        # GLM-4V): sections sized for the shrunk head (_resize_rope)
        rope["mrope_section"] = [1] * _MROPE_AXES


def _tied_to_hidden(key: str, value: object, hidden: object) -> bool:
    """A channel width equal to the hidden size is tied to it (Phi-4's audio conformer convolutions
    feed the hidden size), so it shrinks with it; so is a text tower's projection its default sizes as its
    hidden size (SigLIP's projection_size, which its model compares with the vision tower's width). Input
    channels (``num_channels``) are not."""
    return (("channel" in key and key != "num_channels" or key == "projection_size") and _is_size(value)
            and value == hidden)


def _resized_pattern(values: list, length: int) -> list:
    """The first ``length`` entries of a per-layer list, with every kind it had still present
    (the last entries are replaced by kinds the prefix lacks, in their original order)."""
    out = [values[i % len(values)] for i in range(length)]
    missing = [v for v in dict.fromkeys(values) if v not in out]
    for i, v in enumerate(missing[: length - 1]):
        out[length - 1 - i] = v
    return out


def _resize_rope(rope: dict, *, head_dim: int) -> dict:
    """Per-frequency lists (longrope factors, mrope sections) sized for the new head dimension; a rope
    per layer kind, each."""
    if rope and all(isinstance(v, dict) for v in rope.values()):
        return {kind: _resize_rope(v, head_dim=head_dim) for kind, v in rope.items()}
    rope = dict(rope)
    half = int(head_dim * rope.get("partial_rotary_factor", 1.0)) // 2  # GLM-4V-MoE rotates half of each head
    for key in ("short_factor", "long_factor"):
        if isinstance(rope.get(key), list):
            rope[key] = [1.0] * half
    if isinstance(rope.get("mrope_section"), list):
        n = len(rope["mrope_section"])
        rope["mrope_section"] = [half // n + (1 if i < half % n else 0) for i in range(n)]
    if "original_max_position_embeddings" in rope:
        rope["original_max_position_embeddings"] = 64
    return rope


def _reads_mrope(config: PretrainedConfig) -> bool:
    """Whether the model reads M-RoPE sections from its rope: its config says so by exempting them
    from transformers' rope validation."""
    return "mrope_section" in getattr(type(config), "ignore_keys_at_rope_validation", ())


def _kv_heads(values: dict) -> int:
    """KV heads for the shrunk sizes: still grouped where the original was (GQA), else equal."""
    heads, kv = values.get("num_attention_heads"), values.get("num_key_value_heads")
    grouped = isinstance(heads, int) and isinstance(kv, int) and 0 < kv < heads
    return HEADS // 2 if grouped else HEADS


def _shrink_sizes(values: dict) -> dict:
    """A per-layer-kind or per-layer-index override dict (``per_layer_config``) at the new sizes."""
    out = {k: _SIZES[k] if k in _SIZES and isinstance(v, int) and not isinstance(v, bool) else v
           for k, v in values.items()}
    if "num_key_value_heads" in values:
        out["num_key_value_heads"] = _kv_heads(values)
    return out


def _resized_overrides(overrides: dict, *, data: dict, kinds: list | None, layers: int) -> dict:
    """Per-layer overrides by index (``per_layer_config``) for the shrunk layers, sizes shrunk. Where
    the config has layer kinds and every overridden layer of a kind had the same override, each new
    layer of that kind gets it (Gemma 4's full-attention layers keep a head_dim of their own, larger
    than the others' as in the full model); otherwise the first ``layers`` layers keep theirs."""
    old_kinds = data.get("layer_types")
    by_kind: dict[str, list] = {}
    if isinstance(old_kinds, list) and isinstance(kinds, list) and len(old_kinds) == data.get("num_hidden_layers"):
        for index, override in overrides.items():
            by_kind.setdefault(old_kinds[int(index)], []).append(override)
    if by_kind and all(all(o == found[0] for o in found) for found in by_kind.values()):
        chosen = {i: by_kind[kind][0] for i, kind in enumerate(kinds) if kind in by_kind}
    else:
        chosen = {int(i): o for i, o in overrides.items() if int(i) < layers}
    out = {}
    for index, override in chosen.items():
        if not isinstance(override, dict):
            out[str(index)] = override
            continue
        small = _shrink_sizes(override)
        for key, value in override.items():  # a head wider than the model's stays wider (twice)
            if key == "head_dim" and _is_size(value) and _is_size(data.get(key)) and value > data[key]:
                small[key] = 2 * small[key]
        out[str(index)] = small
    return out


def _mla_head_dim(data: dict) -> int:
    """Multi-head latent attention: head_dim is the rotary part where it was (DeepSeek), else the
    whole query-key head (nope + rope, as Dots 3's sliding layers require)."""
    return _SIZES["qk_rope_head_dim"] if data.get("head_dim") == data.get("qk_rope_head_dim") else \
        _SIZES["qk_rope_head_dim"] + _SIZES["qk_nope_head_dim"]


def shrink_config(config: PretrainedConfig, *, layers: int = LAYERS,
                  builds: Callable[[PretrainedConfig], object] | None = None) -> PretrainedConfig:
    """A copy of ``config`` (same class) with small sizes, no dropout and token ids in the vocabulary.
    Sub-configs (a multimodal model's text, vision and audio parts) are shrunk the same way. ``builds``
    (a model class, built from the part of the config it takes, or anything that builds one from a
    config): where it cannot build from the shrunk config, the widths no rule names are scaled with the
    hidden size (``repair.widths_scaled``), if it can then; a config it builds from is never changed."""
    shrunk = _shrunk(config, layers=layers)
    if builds is None or _builds(builds, shrunk):
        return shrunk
    # the model's own code refused the sizes: widths scaled, if it builds then
    scaled = widths_scaled(config, shrunk)
    return scaled if scaled is not None and _builds(builds, scaled) else shrunk


def _builds(builds: Callable[[PretrainedConfig], object], config: PretrainedConfig) -> bool:
    try:
        with torch.device("meta"):
            builds(config_taken_by(config, builds) if isinstance(builds, type) else config)
    except Exception:  # noqa: BLE001 - any refusal of the model's own code
        return False
    return True


def _shrunk(config: PretrainedConfig, *, layers: int) -> PretrainedConfig:
    data = config.to_dict()
    _fill_gaps(data, mrope=_reads_mrope(config), config_class=type(config).__name__)
    subconfigs = {k: shrink_config(v, layers=layers).to_dict() for k, v in vars(config).items()
                  if isinstance(v, PretrainedConfig)}
    for key, values in _gaps(data, type(config).__name__).items():
        if isinstance(values, dict) and key in subconfigs:
            subconfigs[key].update(values)
    new: dict = {}
    # a config may store a size under its own name (GPT-J's n_embd for hidden_size): its attribute map says
    # (only where the config holds no value under the name itself, and the stored name is no size of ours)
    canonical = {stored: name for name, stored in getattr(type(config), "attribute_map", {}).items()
                 if name not in data and stored not in _SIZES and stored not in _LAYER_COUNTS}
    layers_before = data.get(next((k for k, v in canonical.items() if v == "num_hidden_layers"), "num_hidden_layers"))
    for key, value in data.items():
        size_key = canonical.get(key, key)
        if size_key in _SIZES and (value is None or _is_size(value)):
            new[key] = _SIZES[size_key]  # None too: some defaults leave a size for the checkpoint to fill
        elif key in _RANDOM_OFF_AS_NONE:
            new[key] = None
        elif _is_dropout(key) and _is_rate(value):
            new[key] = type(value)(0)  # the config's own type: strict configs (MPT's) check it
        elif _is_dropout(key) and isinstance(value, list) and value and all(_is_rate(v) for v in value):
            new[key] = [type(v)(0) for v in value]  # a rate per stage
        elif isinstance(value, list) and value and len(value) == layers_before:
            # a per-layer list (layer kinds, per-layer heads or widths): same kinds, new length
            per_layer = [_SIZES.get(key.removesuffix("_per_layer"), v) if isinstance(v, int) else v for v in value]
            new[key] = _resized_pattern(per_layer, layers)
        elif isinstance(value, dict) and value and all(str(k).isdigit() for k in value):
            new[key] = value  # per-layer overrides by index: resized below, once the layer kinds are
        elif (isinstance(value, dict) and value and all(isinstance(v, dict) for v in value.values())
              and key not in subconfigs):
            new[key] = {k: _shrink_sizes(v) for k, v in value.items()}  # per layer kind
        elif key in _MULTIPLIERS and value == 1.0 and not isinstance(value, bool):
            new[key] = MULTIPLIER
        elif _tied_to_hidden(key, value, data.get("hidden_size")):
            new[key] = HIDDEN
    # only the counts the config has (a sub-config without one, an audio encoder, must not gain one);
    # read as attributes too: Longcat's num_hidden_layers is a property that sets num_layers
    new.update({key: layers for key in _LAYER_COUNTS
                if _is_size(data.get(key)) or _is_size(getattr(config, key, None))})
    new.update({stored: layers for stored, name in canonical.items() if name in _LAYER_COUNTS and _is_size(data.get(stored))})
    if "num_hidden_layers" not in data and _is_size(data.get("num_layers")):
        # the stored count is of blocks and num_hidden_layers a property over it (LongCat: two attention
        # sublayers a block): 4 blocks, as every other type gets
        new.pop("num_hidden_layers", None)
        new["num_layers"] = layers
    for key in _STAGE_DEPTHS:
        if isinstance(data.get(key), list) and data[key] and all(_is_size(d) for d in data[key]):
            new[key] = [min(d, STAGE_DEPTH) for d in data[key]]
    if "depth_coefficient" in data:
        new.update({key: value for key, value in _COMPOUND_SCALED.items() if key in data})
    if "num_key_value_heads" in data:
        new["num_key_value_heads"] = _kv_heads(data)
    if isinstance(data.get("num_kv_heads"), int):  # Falcon counts them under its own name
        new["num_kv_heads"] = _kv_heads({**data, "num_key_value_heads": data["num_kv_heads"]})
    if isinstance(data.get("mamba_expand"), int) and "mamba_d_head" in data:
        new["mamba_d_head"] = data["mamba_expand"] * HIDDEN // HEADS  # Mamba: heads * head dim = expand * hidden
    if isinstance(data.get("num_kv_shared_layers"), int) and data["num_kv_shared_layers"] > 0 and "layer_types" in new:
        # Gemma 3n: the last layers reuse the caches of earlier layers of their kind, so the first half
        # holds every kind and the second half repeats it.
        half = layers // 2
        new["layer_types"] = _resized_pattern(data["layer_types"], half) * 2 + new["layer_types"][2 * half :]
        new["num_kv_shared_layers"] = layers - half
    for key, value in new.items():
        if isinstance(value, dict) and value and all(str(k).isdigit() for k in value):
            new[key] = _resized_overrides(value, data=data, kinds=new.get("layer_types"), layers=layers)
    for key in ("linear_num_key_heads", "swa_num_key_value_heads", "index_n_heads"):
        if isinstance(data.get(key), int):
            new[key] = _kv_heads(data) if key != "index_n_heads" else HEADS
    if _is_size(data.get("rotary_dim")) and "head_dim" not in data:
        new["rotary_dim"] = HEAD_DIM // 2  # GPT-J, CodeGen: rotary over part of each head, as theirs
    if isinstance(data.get("attention_types"), list) and data["attention_types"]:
        # GPT-Neo: [[kinds, repeats]] spells its per-layer kinds; the same kinds, over the new layers
        kinds = data["attention_types"][0][0]
        new["attention_types"] = [[kinds, max(1, layers // len(kinds))]]
        new.pop("attention_layers", None)
        data.pop("attention_layers", None)
    if isinstance(data.get("sliding_window"), int):
        new["sliding_window"] = 8  # shorter than the test sequences: the window is exercised
    if "qk_rope_head_dim" in data and "head_dim" in data:
        new["head_dim"] = _mla_head_dim(data)
    for key, value in _TOKEN_IDS.items():
        if isinstance(data.get(key), int):
            new[key] = value
        elif isinstance(data.get(key), list):
            new[key] = [value]
    head_dim = new.get("head_dim") or HIDDEN // HEADS
    for key in ("rope_parameters", "rope_scaling"):
        if isinstance(data.get(key), dict):
            new[key] = _resize_rope(data[key], head_dim=head_dim)
    if "output_router_logits" in data:
        new["output_router_logits"] = False
    merged = {**data, **new, **subconfigs}
    # a backbone's stages are named after its layers: the config names them anew for the new count
    for key in ("model_type", "transformers_version", "architectures", "out_features", "out_indices", "stage_names"):
        merged.pop(key, None)
    try:
        shrunk = type(config)(**merged)
    except Exception as first:  # noqa: BLE001 - the config's own validation, any type: repaired once, else raised
        fixed = repaired(merged, data=data, new=new, config=config)
        try:
            shrunk = type(config)(**fixed)
        except Exception:  # noqa: BLE001
            raise first from None
    if getattr(shrunk, "classifier_dropout", None) is None and getattr(shrunk, "hidden_dropout", None) is None:
        # a head that finds neither falls back to a dropout of 0.1 (GPT-2's and every generic token classifier):
        # the config names none, so no key above reached it
        shrunk.classifier_dropout = 0.0
    if getattr(config, "architectures", None):
        shrunk.architectures = list(config.architectures)
    return shrunk


