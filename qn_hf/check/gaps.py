"""The values a default config leaves for a checkpoint to fill that the check's shrunk copy needs (data only;
read by ``shrink.py``): per model type, or config class where a sub-config has no type."""

from __future__ import annotations

from .sizes import HEADS, HIDDEN

# a width the config computes from its sizes when not given, which its default stores computed from the full
# ones: left out of the shrunk config, so that it is computed from the shrunk sizes
COMPUTED = object()

# Values a default config leaves for a checkpoint to fill, that nothing in the config tells how to
# fill, and without which its model cannot be built or run (model type, or config class where a sub-config
# has no type -> values; a list is a per-layer pattern, repeated over the layers; COMPUTED above). Gaps a rule
# can fill are filled in ``shrink._fill_gaps`` instead.
DEFAULT_GAPS: dict[str, dict] = {
    "lfm2_moe": {"layer_types": ["conv", "full_attention"]},  # the model reads layer_types[i]; None by default
    # Zamba ties every hybrid layer's shared transformer to the first's, and its tie keys need a second one: one
    # in 6 layers by default, so one in the 4 a shrunk copy has (it cannot build); a checkpoint's has 13 in 76.
    # Its attention width is twice the hidden size where unset, and the default config stores it set (7424)
    "zamba": {"layers_block_type": ["linear_attention", "hybrid"], "attention_hidden_size": COMPUTED},
    # computed so: Zamba 2's attention width (2 x hidden), Mamba heads' (expand x hidden / heads), hybrid layers'
    # positions (from its layer kinds); Marian's decoder vocabulary (its vocabulary), xLSTM's embedding (its
    # hidden size)
    "zamba2": dict.fromkeys(("attention_hidden_size", "attention_head_dim", "mamba_headdim", "hybrid_layer_ids"),
                            COMPUTED),
    "marian": {"decoder_vocab_size": COMPUTED},
    "xlstm": {"embedding_dim": COMPUTED},
    # DBRX's attention reads attn_config.rope_theta, which its checkpoints' attn_config holds and transformers
    # 5.23's default attention config lacks (it cannot build; the rotary embedding reads rope_parameters), and
    # clamps q, k, v at clip_qkv, which fails at the default None (dbrx-instruct's is 8)
    "DbrxAttentionConfig": {"rope_theta": 10000.0, "clip_qkv": 8.0},
    # DeepSeek-OCR 2's decoder reads a dense or sparse kind per layer (its checkpoint's: the first dense)
    "deepseek_ocr2_text": {"mlp_layer_types": ["dense", "sparse", "sparse", "sparse"]},
    # a dict for a sub-config: filled into that part once shrunk. T5Gemma 2's encoder-only text part lacks the
    # dropout_rate its layers read
    "t5gemma2_encoder": {"text_config": {"dropout_rate": 0.0}},
    # VideoPrism's clip: 16 frames of 288 x 288 (16 x 16 tubelets each) outran a zoo job's 8 minutes on 2 cores at
    # dp_shard=2; 4 frames of 72 x 72 keep every axis (frames, tubelets across and down)
    "videoprism_vision_model": {"num_frames": 4, "image_size": 72},
    # other video models' clips likewise: 4 frames of two patches (or tubelets) across and down (ViViT's 32 of 224 x
    # 224 in 2 x 16 x 16 tubelets were 3,136 tokens a clip), V-JEPA 2's predictor as small as its encoder
    "videomae": {"num_frames": 4, "image_size": 32},
    "vivit": {"num_frames": 4, "image_size": 32},
    "timesformer": {"num_frames": 4, "image_size": 32},
    "xclip": {"vision_config": {"num_frames": 4, "image_size": 64}},
    "vjepa2": {"frames_per_clip": 4, "crop_size": 32, "pred_hidden_size": HIDDEN, "pred_num_hidden_layers": 2,
               "pred_num_attention_heads": HEADS},
}
