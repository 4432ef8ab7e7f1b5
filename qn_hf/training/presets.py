"""Named tiny model configs, so the scripts run offline with no model directory.

Presets have dropout 0: a parallel run then follows the single-process run step for step (its
random streams differ by design), which is what the results' baselines compare (docs/measured.md). Sizes depend on
the data (vocabulary, image shape, classes), so each preset is a function of them.
"""

from __future__ import annotations

from transformers import GPT2Config, LlamaConfig, PretrainedConfig, Qwen3MoeConfig, ViTConfig

PRESETS = ("tiny-gpt2", "tiny-llama", "tiny-qwen3-moe", "tiny-vit")
LM_PRESETS = ("tiny-gpt2", "tiny-llama", "tiny-qwen3-moe")
TASK_PRESETS = {"lm": LM_PRESETS, "vit": ("tiny-vit",)}


def lm_preset(name: str, *, vocab_size: int, seq_len: int, eos_token_id: int | None) -> PretrainedConfig:
    if name == "tiny-gpt2":
        return GPT2Config(
            n_layer=4, n_embd=128, n_head=4, n_positions=seq_len, vocab_size=vocab_size,
            bos_token_id=eos_token_id, eos_token_id=eos_token_id,
            resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0,
        )
    if name == "tiny-llama":
        return LlamaConfig(
            num_hidden_layers=4, hidden_size=128, intermediate_size=256, num_attention_heads=4,
            num_key_value_heads=2, max_position_embeddings=seq_len, vocab_size=vocab_size,
            bos_token_id=eos_token_id, eos_token_id=eos_token_id, tie_word_embeddings=False,
        )
    if name == "tiny-qwen3-moe":
        # tiny-llama's attention with a mixture of experts in every block: 8 experts of width 128, 2 per
        # token, the top-2 weights renormalised as in Qwen3-30B-A3B (which has 128 experts, 8 per token).
        # No load-balancing loss (output_router_logits=False): qn_hf adds it only where its pool over the
        # whole batch is exact, with pp=1 and one microbatch (router_loss.py), which the recipes rarely use.
        return Qwen3MoeConfig(
            num_hidden_layers=4, hidden_size=128, num_attention_heads=4, num_key_value_heads=2, head_dim=32,
            intermediate_size=256, moe_intermediate_size=128, num_experts=8, num_experts_per_tok=2,
            norm_topk_prob=True, output_router_logits=False, max_position_embeddings=seq_len, vocab_size=vocab_size,
            bos_token_id=eos_token_id, eos_token_id=eos_token_id, tie_word_embeddings=False,
        )
    raise ValueError(f"{name!r} is not a language-model preset; choose one of {LM_PRESETS}")


def vit_preset(*, image_size: int, num_channels: int, labels: list[str]) -> ViTConfig:
    # Patches of 2 pixels: an 8x8 digit becomes 16 tokens (plus the class token).
    return ViTConfig(
        image_size=image_size, patch_size=2 if image_size <= 16 else 4, num_channels=num_channels,
        hidden_size=96, num_hidden_layers=4, num_attention_heads=4, intermediate_size=192,
        hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0,
        num_labels=len(labels), id2label=dict(enumerate(labels)), label2id={n: i for i, n in enumerate(labels)},
    )
