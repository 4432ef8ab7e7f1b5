"""Tensor-parallel train steps per second: qn_hf against torch's DTensor tensor parallelism.

    python benchmarks/tp_vs_dtensor.py [--tp 2] [--steps 10] [--rounds 3]

Both variants train the same tiny Llama (same weights, same batches, AdamW) on ``tp`` CPU processes
over gloo, each process with ``cores // tp`` intra-op threads, in one run; rounds alternate
between the variants and the median is reported. The DTensor variant is what a user would write
with ``parallelize_module``: q/k/v, gate/up ``ColwiseParallel``; o/down ``RowwiseParallel``; the
embedding ``RowwiseParallel`` (vocab-sharded) and the head ``ColwiseParallel`` gathering the logits
for HF's own loss. qn_hf keeps the logits vocab-sharded and uses its vocab-parallel loss.
"""

from __future__ import annotations

import argparse
import os
import statistics
import tempfile
import time

import torch
import torch.distributed as dist
from world import run_world

CONFIG = dict(hidden_size=256, intermediate_size=688, num_hidden_layers=4, num_attention_heads=8, num_key_value_heads=4,
              vocab_size=2048, max_position_embeddings=256, bos_token_id=1, eos_token_id=2, pad_token_id=0)


def batches(n: int, *, batch: int, seq: int, vocab: int) -> list[dict[str, torch.Tensor]]:
    gen = torch.Generator().manual_seed(0)
    out = []
    for _ in range(n):
        ids = torch.randint(3, vocab, (batch, seq), generator=gen)
        out.append({"input_ids": ids, "labels": ids})
    return out


def dtensor_model(path: str, tp: int):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Replicate
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module
    from transformers import LlamaForCausalLM

    model = LlamaForCausalLM.from_pretrained(path)
    mesh = init_device_mesh("cpu", (tp,))
    plan = {
        "model.embed_tokens": RowwiseParallel(input_layouts=Replicate(), output_layouts=Replicate()),
        "lm_head": ColwiseParallel(output_layouts=Replicate()),
    }
    for i in range(model.config.num_hidden_layers):
        for name in ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "mlp.gate_proj", "mlp.up_proj"):
            plan[f"model.layers.{i}.{name}"] = ColwiseParallel()
        for name in ("self_attn.o_proj", "mlp.down_proj"):
            plan[f"model.layers.{i}.{name}"] = RowwiseParallel()
    parallelize_module(model, mesh, plan)

    def step(batch):
        loss = model(**batch).loss
        loss.backward()
        return loss.detach()

    return model, step


def qn_model(path: str, tp: int):
    from transformers import LlamaForCausalLM

    import qn_hf

    pm = qn_hf.parallelize(LlamaForCausalLM.from_pretrained(path), tp=tp, seed=0)
    return pm, pm.train_step


def time_variant(build, path: str, tp: int, data: list[dict[str, torch.Tensor]], warmup: int) -> tuple[float, float]:
    model, step = build(path, tp)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    model.train()
    first_loss = None
    for i, batch in enumerate(data):
        if i == warmup:
            dist.barrier()
            start = time.perf_counter()
        opt.zero_grad()
        loss = step(batch)
        opt.step()
        first_loss = loss.item() if first_loss is None else first_loss
    elapsed = time.perf_counter() - start
    return (len(data) - warmup) / elapsed, first_loss


def worker(rank: int, tp: int, path: str, args: argparse.Namespace) -> tuple[dict, dict] | None:
    data = batches(args.steps + args.warmup, batch=args.batch, seq=args.seq, vocab=CONFIG["vocab_size"])
    rates: dict[str, list[float]] = {"qn_hf": [], "dtensor": []}
    losses: dict[str, float] = {}
    for _ in range(args.rounds):
        for name, build in (("qn_hf", qn_model), ("dtensor", dtensor_model)):
            rate, first = time_variant(build, path, tp, data, args.warmup)
            rates[name].append(rate)
            losses[name] = first
    return (rates, losses) if rank == 0 else None


def plain_rate(path: str, args: argparse.Namespace) -> float:
    from transformers import LlamaForCausalLM

    torch.set_num_threads(os.cpu_count() or 1)
    model = LlamaForCausalLM.from_pretrained(path).train()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    data = batches(args.steps + args.warmup, batch=args.batch, seq=args.seq, vocab=CONFIG["vocab_size"])
    for i, batch in enumerate(data):
        if i == args.warmup:
            start = time.perf_counter()
        opt.zero_grad()
        model(**batch).loss.backward()
        opt.step()
    return args.steps / (time.perf_counter() - start)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tp", type=int, default=2)
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--seq", type=int, default=128)
    args = parser.parse_args()

    from transformers import LlamaConfig, LlamaForCausalLM

    path = tempfile.mkdtemp(prefix="qn_hf_bench_")
    torch.manual_seed(0)
    LlamaForCausalLM(LlamaConfig(**CONFIG)).save_pretrained(path)
    rates, losses = run_world(worker, world=args.tp, extra=(path, args))
    plain = plain_rate(path, args)

    qn, dt = statistics.median(rates["qn_hf"]), statistics.median(rates["dtensor"])
    cores = os.cpu_count()
    print(f"tiny Llama {CONFIG['num_hidden_layers']} layers, hidden {CONFIG['hidden_size']}, vocab {CONFIG['vocab_size']}, "
          f"batch {args.batch}x{args.seq}; tp={args.tp} gloo ranks x {max(1, cores // args.tp)} thread(s) on {cores} cores")
    print(f"first-step loss: qn_hf {losses['qn_hf']:.6f}  dtensor {losses['dtensor']:.6f}")
    print(f"{'variant':<34}{'steps/s (median)':>18}   rounds")
    print(f"{'qn_hf.parallelize':<34}{qn:>18.3f}   {[round(r, 3) for r in rates['qn_hf']]}")
    print(f"{'DTensor parallelize_module':<34}{dt:>18.3f}   {[round(r, 3) for r in rates['dtensor']]}")
    print(f"{'plain HF, 1 process, all cores':<34}{plain:>18.3f}")
    print(f"ratio qn_hf / DTensor = {qn / dt:.2f}x")


if __name__ == "__main__":
    main()
