"""Five features at once on Qwen3-MoE, against the same run in one process (issue 34's measurement).

    python benchmarks/composed.py [--steps 30] [--json results/composed.json]

The composed run: dp=2 x pp=2 (interleaved 1F1B, 2 chunks per rank) x ep=2 (experts over the two dp
ranks of each stage), ZeRO-1 (masters and AdamW state split over dp, the experts' over the ranks
holding each block), bf16 compute with float32 masters, gradient clipping at 1.0, 4 ranks. The
reference: the same model, optimizer, clipping and global batches at world size 1 (one process,
bf16 with float32 masters, no sharding of any kind). Reported: the loss of every step on both and
their largest relative difference (the issue asks for 1% over 30 steps), plus one float32 step of
the same composed mesh (without bf16) against the plain Hugging Face model with torch's AdamW and
with SGD (lr 0.5): loss relative difference and the largest weight difference (1e-5 and 2e-5 are the
project's bars; its tests compare weights after SGD, because AdamW turns float rounding in a
near-zero gradient into a step of up to lr).

The model is a shrunk Qwen3-MoE (hidden 256, 4 layers of 8 experts, top-2); the batches are random
tokens (8 sequences of 64 per step), seeded by step, the same at both meshes. Each rank runs one
intra-op thread (world.py). Run from the repository root.
"""

from __future__ import annotations

import argparse
import json
import os

import torch
from world import run_world

CONFIG = dict(hidden_size=256, intermediate_size=512, moe_intermediate_size=256, num_experts=8, num_experts_per_tok=2,
              num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2, head_dim=64, vocab_size=512,
              max_position_embeddings=256, norm_topk_prob=True, output_router_logits=False, tie_word_embeddings=False)
ROWS, SEQ = 8, 64  # global batch per step
ADAMW = dict(lr=1e-3, weight_decay=0.01)
SGD = dict(lr=0.5)
COMPOSED = dict(dp=2, pp=2, ep=2, schedule="interleaved_1f1b", virtual_stages=2, microbatches=2)


def _model():
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

    torch.manual_seed(0)
    return Qwen3MoeForCausalLM(Qwen3MoeConfig(**CONFIG)).float()


def _batch(step: int) -> torch.Tensor:
    return torch.randint(3, CONFIG["vocab_size"], (ROWS, SEQ), generator=torch.Generator().manual_seed(1000 + step))


def _train(rank: int, world: int, mesh: dict, steps: int, precision: str | None, zero: bool,
           sgd: bool = False) -> dict:
    import qn_hf

    pm = qn_hf.parallelize(_model(), **mesh, mixed_precision=precision)
    opt = (qn_hf.optimizer(pm, torch.optim.SGD, zero=zero, **SGD) if sgd
           else qn_hf.optimizer(pm, torch.optim.AdamW, zero=zero, **ADAMW))
    dp = mesh.get("dp", 1)
    rows = ROWS // dp
    losses = []
    for step in range(steps):
        ids = _batch(step)[pm.coords["dp"] * rows : (pm.coords["dp"] + 1) * rows]
        opt.zero_grad()
        losses.append(pm.train_step({"input_ids": ids, "labels": ids.clone()}).item())
        qn_hf.clip_grad_norm_(pm, 1.0)
        opt.step()
    state = pm.state_dict()  # whole float tensors on every rank
    weights = {n: t.float() for n, t in state.items()} if rank == 0 else None
    pm.close()
    return {"losses": losses, "weights": weights}


def _plain_step(sgd: bool) -> dict:
    """One float32 step of the plain model with torch's AdamW (or SGD) and clipping."""
    model = _model()
    opt = torch.optim.SGD(model.parameters(), **SGD) if sgd else torch.optim.AdamW(model.parameters(), **ADAMW)
    ids = _batch(0)
    loss = model(input_ids=ids, labels=ids, use_cache=False).loss
    loss.backward()
    torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
    opt.step()
    return {"loss": loss.item(), "weights": {n: p.detach().clone() for n, p in model.state_dict().items()}}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--json", default=None, help="write the results here")
    args = parser.parse_args()
    composed = run_world(_train, world=4, extra=(COMPOSED, args.steps, "bf16", True))
    single = run_world(_train, world=1, extra=({}, args.steps, "bf16", False))
    curve = [abs(a - b) / abs(b) for a, b in zip(composed["losses"], single["losses"])]
    one_step = {}
    for name, sgd in (("adamw", False), ("sgd", True)):
        fp32 = run_world(_train, world=4, extra=(COMPOSED, 1, None, True, sgd))
        plain = _plain_step(sgd)
        errs = {n: (fp32["weights"][n] - w).abs().max().item() for n, w in plain["weights"].items()}
        worst = max(errs, key=errs.get)
        one_step[name] = {"loss_rel_diff": abs(fp32["losses"][0] - plain["loss"]) / abs(plain["loss"]),
                          "max_weight_diff": errs[worst], "worst": worst}
    result = {
        "mesh": COMPOSED, "zero": True, "steps": args.steps,
        "bf16_losses_composed": composed["losses"], "bf16_losses_one_process": single["losses"],
        "bf16_first_step_rel_diff": curve[0], "bf16_max_rel_diff": max(curve),
        "fp32_one_step": one_step,
    }
    print(f"composed {COMPOSED}, ZeRO-1, bf16, {args.steps} steps against one process:")
    print(f"  first step loss rel diff {curve[0]:.2e}; worst over {args.steps} steps {max(curve):.2e} "
          f"(step {curve.index(max(curve)) + 1}); losses {composed['losses'][0]:.4f} -> {composed['losses'][-1]:.4f}")
    for name, r in one_step.items():
        print(f"float32, one {name} step against the plain HF model: loss rel diff {r['loss_rel_diff']:.2e}, "
              f"max weight diff {r['max_weight_diff']:.2e} ({r['worst']})")
    if args.json:
        os.makedirs(os.path.dirname(args.json) or ".", exist_ok=True)
        with open(args.json, "w") as f:
            json.dump(result, f, indent=1)


if __name__ == "__main__":
    main()
