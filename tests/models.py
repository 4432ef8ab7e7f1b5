"""Tiny models (built from configs, saved with ``save_pretrained``) and deterministic batches."""

from __future__ import annotations

from pathlib import Path

import torch
from transformers import (
    AutoConfig,
    AutoModelForCausalLM,
    AutoModelForImageClassification,
    GPT2Config,
    LlamaConfig,
    MistralConfig,
    Qwen2Config,
    Qwen3Config,
    ViTConfig,
)

from qn_hf.check.shrink import shrink_config

NO_DROPOUT_GPT2 = dict(resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)

CONFIGS = {
    # 4 heads: tp in {1, 2, 4}; vocab 99 is padded for tp 2 and 4; lm_head tied to wte;
    # 5 blocks split unevenly over 2 or 4 stages.
    "gpt2": GPT2Config(n_layer=5, n_embd=32, n_head=4, n_positions=32, vocab_size=99, bos_token_id=0, eos_token_id=0,
                       **NO_DROPOUT_GPT2),
    # 8 query heads over 2 KV heads: tp=2 splits the KV heads, tp=4 replicates each on 2 ranks.
    "llama": LlamaConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=4, num_attention_heads=8,
                         num_key_value_heads=2, vocab_size=101, max_position_embeddings=64, pad_token_id=0,
                         bos_token_id=1, eos_token_id=2),
    "vit": ViTConfig(image_size=16, patch_size=4, num_channels=3, hidden_size=32, num_hidden_layers=4,
                     num_attention_heads=4, intermediate_size=64, num_labels=5, hidden_dropout_prob=0.0,
                     attention_probs_dropout_prob=0.0),
    # No policy file of ours: derived from transformers' base_model_tp_plan.
    "mistral": MistralConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                             num_key_value_heads=2, vocab_size=97, max_position_embeddings=64, head_dim=8,
                             bos_token_id=1, eos_token_id=2),
    "qwen2": Qwen2Config(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                         num_key_value_heads=2, vocab_size=97, max_position_embeddings=64, bos_token_id=1,
                         eos_token_id=2),
    # Per-head q/k norms whose gradients are summed over tp; derived policy.
    "qwen3": Qwen3Config(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                         num_key_value_heads=2, head_dim=8, vocab_size=97, max_position_embeddings=64,
                         bos_token_id=1, eos_token_id=2),
}
# 8 blocks: pp x virtual_stages up to 8 chunks (interleaved schedules).
CONFIGS["gpt2_deep"] = GPT2Config(**{**CONFIGS["gpt2"].to_dict(), "n_layer": 8})
CONFIGS["llama_deep"] = LlamaConfig(**{**CONFIGS["llama"].to_dict(), "num_hidden_layers": 8})
# What the base forward computes before the blocks for every block (per-layer embeddings), held on
# every pipeline stage: Gemma 4 (4 blocks, lm_head tied to the embedding), and Gemma 3n with AltUp
# streams and 6 blocks, of which 3 to 5 reuse the keys and values of blocks 1 and 2.
CONFIGS["gemma4"] = shrink_config(AutoConfig.for_model("gemma4_text"))
CONFIGS["gemma3n"] = shrink_config(AutoConfig.for_model("gemma3n_text"), layers=6)
CONFIGS["qwen3_moe"] = shrink_config(AutoConfig.for_model("qwen3_moe"))  # 4 experts, 2 a token
# What the task forward does to the logits after the head, which the chunked loss must run as it is:
# Gemma 2's soft-capping (tied head) and Granite's divisor.
CONFIGS["gemma2"] = shrink_config(AutoConfig.for_model("gemma2", final_logit_softcapping=2.0))
CONFIGS["granite"] = shrink_config(AutoConfig.for_model("granite", logits_scaling=4.0))
VISION = {"vit"}


def auto_class(kind: str):
    return AutoModelForImageClassification if kind in VISION else AutoModelForCausalLM


def save_tiny_models(root: Path) -> dict[str, str]:
    dirs = {}
    for kind, config in CONFIGS.items():
        torch.manual_seed(1234)
        model = auto_class(kind).from_config(config)
        path = root / kind
        model.save_pretrained(path)
        dirs[kind] = str(path)
    return dirs


def load(kind: str, path: str, **overrides):
    return auto_class(kind).from_pretrained(path, **overrides)


def make_batch(kind: str, *, size: int, seed: int, seq: int = 12, padded: bool = False,
               packed: bool = False) -> dict[str, torch.Tensor]:
    """A global batch; ``padded`` right-pads some rows (attention_mask 0, labels -100); ``packed``
    puts two or three documents in each row (``position_ids`` restart at 0 where one begins)."""
    gen = torch.Generator().manual_seed(seed)
    config = CONFIGS[kind]
    if kind in VISION:
        return {
            "pixel_values": torch.randn(size, config.num_channels, config.image_size, config.image_size, generator=gen),
            "labels": torch.randint(0, config.num_labels, (size,), generator=gen),
        }
    ids = torch.randint(3, config.vocab_size, (size, seq), generator=gen)
    batch = {"input_ids": ids, "labels": ids.clone()}
    if padded:
        lengths = torch.randint(seq // 2, seq + 1, (size,), generator=gen)
        mask = (torch.arange(seq)[None, :] < lengths[:, None]).long()
        batch["attention_mask"] = mask
        batch["labels"] = ids.masked_fill(mask == 0, -100)
    if packed:
        positions = torch.empty(size, seq, dtype=torch.long)
        for row in range(size):
            starts = sorted({0, *torch.randint(1, seq, (2,), generator=gen).tolist()})
            for a, b in zip(starts, [*starts[1:], seq]):
                positions[row, a:b] = torch.arange(b - a)
        batch["position_ids"] = positions
    return batch


def dp_slice(batch: dict[str, torch.Tensor], *, dp: int, dp_rank: int) -> dict[str, torch.Tensor]:
    n = next(iter(batch.values())).shape[0] // dp
    return {k: v[dp_rank * n : (dp_rank + 1) * n] for k, v in batch.items()}
