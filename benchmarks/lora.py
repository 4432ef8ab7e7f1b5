"""LoRA against full fine-tuning: bytes per rank and data-parallel traffic, from real tensors.

    python benchmarks/lora.py            # tp=2 memory per rank, dp=2 bytes per step, both modes

A Llama of 8 layers (hidden 512, 8 heads, MLP 1408, vocabulary 8192; 34.1M parameters) trains one
AdamW step (``qn_hf.optimizer``) on 4 sequences of 128 tokens, fully or with peft's LoRA (r=16 on
every projection of the blocks: q, k, v, o, gate, up, down). Each rank sums the bytes of its
parameters (trainable and frozen), its gradient buffers (``.grad`` or the dp buckets, by storage)
and the tensors in ``opt.state``. The dp traffic is what ``qn_hf.CommMeter`` counts on the
gradient group during ``train_step``; theory is 4 bytes x the trainable parameters per rank (one
all-reduce of each gradient, whose payload is the whole tensor), plus 12 bytes of step scalars.
"""

from __future__ import annotations

import argparse
import tempfile

import torch
from world import run_world, storage_bytes

CONFIG = dict(hidden_size=512, intermediate_size=1408, num_hidden_layers=8, num_attention_heads=8,
              num_key_value_heads=8, vocab_size=8192, max_position_embeddings=256)
TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


def worker(rank: int, world: int, path: str, lora: bool, dp: int, tp: int, rank_r: int) -> dict:
    from transformers import AutoModelForCausalLM

    import qn_hf

    model = AutoModelForCausalLM.from_pretrained(path)
    if lora:
        from peft import LoraConfig, get_peft_model

        model = get_peft_model(model, LoraConfig(r=rank_r, lora_alpha=2 * rank_r, target_modules=TARGETS))
    pm = qn_hf.parallelize(model, dp=dp, tp=tp, seed=0)
    opt = qn_hf.optimizer(pm, torch.optim.AdamW, lr=1e-4)
    ids = torch.randint(0, CONFIG["vocab_size"], (4 // dp, 128), generator=torch.Generator().manual_seed(rank))
    with qn_hf.CommMeter(pm) as meter:
        pm.train_step({"input_ids": ids, "labels": ids})
    opt.step()
    params = list(pm.parameters())
    trainable = [p for p in params if p.requires_grad]
    grads = [b.buffer for b in pm.buckets.buckets] if pm.buckets is not None else [p.grad for p in trainable]
    state = [t for s in opt.state.values() for t in s.values() if isinstance(t, torch.Tensor)]
    reduced = sum(t.nbytes for (group, _), t in meter.totals().items() if group in ("dp", "replicas"))
    return {"weights": storage_bytes(params), "trainable": sum(p.numel() for p in trainable), "grads": storage_bytes(grads),
            "state": storage_bytes(state), "dp_bytes": reduced}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rank", type=int, default=16, help="LoRA r")
    args = parser.parse_args()
    from transformers import LlamaConfig, LlamaForCausalLM

    path = tempfile.mkdtemp(prefix="qn_hf_lora_")
    torch.manual_seed(0)
    LlamaForCausalLM(LlamaConfig(**CONFIG)).save_pretrained(path)
    total = sum(p.numel() for p in LlamaForCausalLM.from_pretrained(path).parameters())
    print(f"Llama 8 layers, {total / 1e6:.1f}M parameters, float32; LoRA r={args.rank} on {', '.join(TARGETS)}")
    print(f"{'mesh':<7}{'mode':<6}{'trainable/rank':>15}{'weights MiB':>12}{'grads MiB':>11}{'AdamW MiB':>11}"
          f"{'dp bytes/step':>15}{'theory':>12}")
    for dp, tp in ((1, 2), (2, 1)):
        for lora in (False, True):
            r = run_world(worker, world=dp * tp, extra=(path, lora, dp, tp, args.rank))
            theory = 4 * r["trainable"] if dp > 1 else 0
            print(f"{f'dp{dp}tp{tp}':<7}{'lora' if lora else 'full':<6}{r['trainable']:>15,}"
                  f"{r['weights'] / 2**20:>12.1f}{r['grads'] / 2**20:>11.1f}{r['state'] / 2**20:>11.1f}"
                  f"{r['dp_bytes']:>15,}{theory:>12,}")


if __name__ == "__main__":
    main()
