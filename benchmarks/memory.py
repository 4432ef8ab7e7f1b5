"""Memory of the features real runs need: optimizer state with ZeRO-1 and mixed precision, and
activations with recomputation. Every figure is counted from real tensors, not estimated.

    python benchmarks/memory.py state          # bytes per rank at dp = 1, 2, 4 (zero off/on, fp32/bf16)
    python benchmarks/memory.py activations    # one 12-layer GPT-2 microbatch at seq 1024: none/selective/full

state: a 6-layer GPT-2 (13.9M parameters) trains one step with ``qn_hf.optimizer(AdamW)``; each rank
sums the bytes of its parameters, its gradient buffers (``.grad`` or the dp buckets, by storage), the
float32 master copies (when they are copies, not views of the weights) and the tensors in
``opt.state``.

activations: GPT-2 small (12 layers, n_embd 768, vocab 50257) in one process, batch 1 x 1024 tokens,
float32. ``LiveAllocations`` (qn_hf/memory/live_allocations.py) records every storage an op creates during the forward;
what is still alive when the forward returns is what backward will read (activations, logits and
loss): that is the activation memory. Step time is the median of timed ``train_step`` calls.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time

import torch
from world import run_world, storage_bytes

from qn_hf.memory.live_allocations import LiveAllocations

SMALL = dict(n_layer=6, n_embd=384, n_head=6, n_positions=256, vocab_size=8192, bos_token_id=0, eos_token_id=0,
             resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)
GPT2_SMALL = dict(n_layer=12, n_embd=768, n_head=12, n_positions=1024, vocab_size=50257, resid_pdrop=0.0,
                  embd_pdrop=0.0, attn_pdrop=0.0)


def state_worker(rank: int, world: int, path: str, zero: bool, precision: str | None) -> dict:
    from transformers import GPT2LMHeadModel

    import qn_hf

    pm = qn_hf.parallelize(GPT2LMHeadModel.from_pretrained(path), dp=world, seed=0, mixed_precision=precision)
    opt = qn_hf.optimizer(pm, torch.optim.AdamW, zero=zero, lr=1e-4)
    ids = torch.randint(0, SMALL["vocab_size"], (2, 64), generator=torch.Generator().manual_seed(rank))
    pm.train_step({"input_ids": ids, "labels": ids})
    opt.step()
    params = list(pm.parameters())
    grads = [b.buffer for b in pm.buckets.buckets] if pm.buckets is not None else [p.grad for p in params]
    weights = {p.untyped_storage().data_ptr() for p in params}
    masters = [m.tensor for m in opt.masters if m.tensor.untyped_storage().data_ptr() not in weights]
    state = [t for s in opt.state.values() for t in s.values() if isinstance(t, torch.Tensor)]
    return {"weights": storage_bytes(params), "grads": storage_bytes(grads), "masters": storage_bytes(masters), "state": storage_bytes(state)}


def state(args: argparse.Namespace) -> None:
    import tempfile

    from transformers import GPT2Config, GPT2LMHeadModel
    path = tempfile.mkdtemp(prefix="qn_hf_mem_")
    torch.manual_seed(0)
    GPT2LMHeadModel(GPT2Config(**SMALL)).save_pretrained(path)
    params = sum(p.numel() for p in GPT2LMHeadModel.from_pretrained(path).parameters())
    print(f"GPT-2 {SMALL['n_layer']} layers, {params / 1e6:.1f}M parameters; bytes per rank after one AdamW step")
    print(f"{'precision':<10}{'zero':<6}{'dp':>3}{'weights':>14}{'grads':>14}{'masters':>14}{'AdamW state':>14}"
          f"{'state/param':>13}")
    for precision in (None, "bf16"):
        for zero in (False, True):
            for dp in args.dps:
                r = run_world(state_worker, world=dp, extra=(path, zero, precision))
                per = (r["masters"] + r["state"]) / params
                print(f"{precision or 'fp32':<10}{str(zero):<6}{dp:>3}{r['weights']:>14,}{r['grads']:>14,}"
                      f"{r['masters']:>14,}{r['state']:>14,}{per:>12.2f}B")


def activations(args: argparse.Namespace) -> None:
    from transformers import GPT2Config, GPT2LMHeadModel

    import qn_hf
    torch.manual_seed(0)
    ids = torch.randint(0, GPT2_SMALL["vocab_size"], (1, args.seq), generator=torch.Generator().manual_seed(1))
    batch = {"input_ids": ids, "labels": ids}
    rows = []
    for mode in args.modes:
        recompute = None if mode == "none" else mode
        torch.manual_seed(0)
        pm = qn_hf.parallelize(GPT2LMHeadModel(GPT2Config(**GPT2_SMALL)), seed=0, recompute=recompute)
        pm.train()
        tracker = LiveAllocations()
        with tracker:
            out = pm(**batch)
        live = tracker.alive_bytes()
        out.loss.backward()
        del out
        times = []
        for _ in range(args.steps):
            for p in pm.parameters():
                p.grad = None
            start = time.perf_counter()
            pm.train_step(batch)
            times.append(time.perf_counter() - start)
        rows.append((mode, live, statistics.median(times)))
        print(f"  {mode}: {live / 2**20:,.1f} MiB, {statistics.median(times):.2f} s/step {[round(t, 2) for t in times]}",
              file=sys.stderr)
    base_live, base_time = rows[0][1], rows[0][2]
    print(f"GPT-2 12 layers, n_embd 768, one microbatch of 1 x {args.seq} tokens, float32, {torch.get_num_threads()} "
          f"threads; activation memory = bytes alive after the forward (LiveAllocations)")
    print(f"{'recompute':<11}{'activations MiB':>16}{'vs none':>9}{'s/step':>9}{'vs none':>9}")
    for mode, live, t in rows:
        print(f"{mode:<11}{live / 2**20:>16,.1f}{live / base_live:>9.2f}{t:>9.2f}{t / base_time:>9.2f}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("part", choices=("state", "activations"))
    parser.add_argument("--dps", type=lambda s: [int(x) for x in s.split(",")], default=[1, 2, 4])
    parser.add_argument("--seq", type=int, default=1024)
    parser.add_argument("--steps", type=int, default=2)
    parser.add_argument("--modes", type=lambda s: s.split(","), default=["none", "selective", "full"])
    args = parser.parse_args()
    state(args) if args.part == "state" else activations(args)


if __name__ == "__main__":
    main()
