"""What the sections share: the device, the row format, the Llama shapes and how a model is built."""

from __future__ import annotations

import gc
import os

import torch

FIRST_LOSS_RTOL = 2e-2  # bf16 runs of the same weights and batch: their first step's losses
LOSS_RTOL, WEIGHT_ATOL = 1e-5, 2e-5  # float32 parity, as tests/test_parity.py


def device() -> torch.device:
    """This rank's GPU when CUDA is there, else the CPU."""
    if torch.cuda.is_available():
        return torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")))
    return torch.device("cpu")


def synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def release(device: torch.device) -> None:
    """Between two measurements: what the first held goes back to the device, and the peak starts again."""
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(device)


def row(section: str, case: str, result: str, detail: str, *, procs: int = 1, syncs: int | None = None,
        **metrics) -> dict:
    """One line of the table (and one ``GPU_CHECK_JSON`` line). ``result``: equal, ok (within a tolerance),
    measured, skipped; or different, failed, error (the exit status is then 1)."""
    return {"section": section, "case": case, "procs": procs, "result": result, "detail": detail, "syncs": syncs,
            "metrics": metrics}


def llama_config(*, big: bool, seq: int):
    """A 0.9B-parameter Llama (hidden 2048, 16 blocks, 16 heads over 8 KV heads, vocabulary 32000), or a tiny
    one, for sequences of ``seq`` tokens, without a KV cache (training)."""
    from transformers import AutoConfig

    shape = (dict(hidden_size=2048, intermediate_size=5632, num_hidden_layers=16, num_attention_heads=16,
                  num_key_value_heads=8, vocab_size=32000) if big else
             dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=2, vocab_size=256))
    return AutoConfig.for_model("llama", **shape, max_position_embeddings=seq, bos_token_id=1, eos_token_id=2,
                                pad_token_id=0, use_cache=False)


def build(config, device: torch.device, *, seed: int = 0):
    """The float32 causal LM of ``config`` initialised on ``device`` from ``seed``: the same weights each time."""
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    with torch.device(device):
        return AutoModelForCausalLM.from_config(config, attn_implementation="sdpa").float()
