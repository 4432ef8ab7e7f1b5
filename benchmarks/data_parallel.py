"""Data parallelism: qn_hf's bucketed all-reduce against torch DDP, and a full 3D step's traffic.

    python benchmarks/data_parallel.py            # dp=2: qn_hf vs DistributedDataParallel
    python benchmarks/data_parallel.py --zero     # dp=2: qn_hf ZeRO-1 (qn_hf.optimizer zero=True) vs DDP
    python benchmarks/data_parallel.py --mesh 2,2,2   # one (dp, tp, pp) run: traffic per group vs theory

DDP comparison: the same GPT-2 (same weights, batches, AdamW, bucket size) on ``dp`` gloo ranks
with ``cores // dp`` threads each, rounds alternating between the two, median reported as train
steps per second and their ratio. The 3D mode prints, for one train step, the calls and bytes of
every collective and point-to-point transfer by group (``qn_hf.CommMeter``) beside the theoretical
minimum of what must cross each group; on 2 cores 8 ranks oversubscribe the CPU, so its time is
printed but means little.
"""

from __future__ import annotations

import argparse
import math
import os
import statistics
import tempfile
import time

import torch
import torch.distributed as dist
from world import run_world

CONFIG = dict(n_layer=6, n_embd=384, n_head=6, n_positions=256, vocab_size=8192, bos_token_id=0, eos_token_id=0,
              resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)


def batches(n: int, *, batch: int, seq: int, seed: int) -> list[dict[str, torch.Tensor]]:
    gen = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(n):
        ids = torch.randint(0, CONFIG["vocab_size"], (batch, seq), generator=gen)
        out.append({"input_ids": ids, "labels": ids})
    return out


def timed(step, opt, data, warmup: int) -> float:
    times = []
    for i, batch in enumerate(data):
        dist.barrier()
        start = time.perf_counter()
        opt.zero_grad()
        step(batch)
        opt.step()
        if i >= warmup:
            times.append(time.perf_counter() - start)
    return len(times) / sum(times)


def ddp_vs_qn(rank: int, world: int, path: str, args: argparse.Namespace) -> dict | None:
    from torch.nn.parallel import DistributedDataParallel as DDP
    from transformers import GPT2LMHeadModel

    import qn_hf

    data = batches(args.steps + 1, batch=args.batch // world, seq=args.seq, seed=100 + rank)
    rates: dict[str, list[float]] = {"qn_hf": [], "DDP": []}
    def run_qn() -> None:
        nonlocal pm, opt
        pm = qn_hf.parallelize(GPT2LMHeadModel.from_pretrained(path), dp=world, bucket_mb=args.bucket_mb, seed=0)
        opt = (qn_hf.optimizer(pm, torch.optim.AdamW, zero=True, lr=1e-4) if args.zero
               else torch.optim.AdamW(pm.parameters(), lr=1e-4))
        rates["qn_hf"].append(timed(pm.train_step, opt, data, warmup=1))

    def run_ddp() -> None:
        ddp = DDP(GPT2LMHeadModel.from_pretrained(path).train(), bucket_cap_mb=args.bucket_mb)
        rates["DDP"].append(timed(lambda b: ddp(**b).loss.backward(), torch.optim.AdamW(ddp.parameters(), lr=1e-4),
                                  data, warmup=1))

    pm = opt = None
    for r in range(args.rounds):  # alternate which goes first, so neither always runs on a warmer machine
        for run in (run_qn, run_ddp) if r % 2 == 0 else (run_ddp, run_qn):
            run()
    opt.zero_grad()
    with qn_hf.CommMeter(pm) as meter:  # one whole step: with zero=True the weights' all-gather is in opt.step
        pm.train_step(data[0])
        opt.step()
    grad_bytes = sum(p.numel() * p.element_size() for p in pm.parameters())
    state_bytes = sum(t.numel() * t.element_size() for s in opt.state.values() for t in s.values()
                      if isinstance(t, torch.Tensor))
    # CommMeter counts this rank's input to each call; a ring moves (n-1)/n of the whole tensor per
    # rank for a reduce-scatter (input: whole) or an all-gather (input: 1/n), twice that for an all-reduce.
    # One reduce (broadcast) per owner of a piece moves the same: its input is the piece.
    ring = {"all_reduce": 2 * (world - 1) / world, "reduce_scatter_tensor": (world - 1) / world,
            "all_gather_into_tensor": world - 1, "reduce": (world - 1) / world, "broadcast": (world - 1) / world}
    dp_bytes = sum(t.nbytes * ring.get(op, 1.0) for (g, op), t in meter.totals().items() if g == "dp")
    return {"rates": rates, "table": meter.table(), "grad_bytes": grad_bytes, "state_bytes": state_bytes,
            "dp_bytes": dp_bytes, "buckets": len(pm.buckets.buckets)} if rank == 0 else None


def three_d(rank: int, world: int, path: str, args: argparse.Namespace) -> dict | None:
    from transformers import GPT2LMHeadModel

    import qn_hf

    dp, tp, pp = args.mesh
    pm = qn_hf.parallelize(GPT2LMHeadModel.from_pretrained(path), dp=dp, tp=tp, pp=pp, microbatches=args.microbatches,
                           bucket_mb=args.bucket_mb, seed=0)
    data = batches(args.steps + 1, batch=args.batch // dp, seq=args.seq, seed=100 + pm.coords["dp"])
    rate = timed(pm.train_step, torch.optim.AdamW(pm.parameters(), lr=1e-4), data, warmup=1)
    with qn_hf.CommMeter(pm) as meter:
        pm.train_step(data[0])
    local = {"coords": pm.coords, "table": meter.table(), "totals": meter.totals(), "rate": rate,
             "grad_bytes": sum(p.numel() * p.element_size() for p in pm.parameters()),
             "layers": (lambda start, stop: stop - start)(*pm.stage.plan.layer_ranges[pm.coords["pp"]])}
    gathered = [None] * world
    dist.all_gather_object(gathered, local)
    return gathered if rank == 0 else None


def theory(r: dict, args: argparse.Namespace) -> dict[str, int]:
    """Bytes that must cross each group in one step for this rank (fp32), by the layout of the math:
    dp: every local gradient once. tp: per block 2 activation all-reduces forward (attention and
    MLP outputs) and 2 backward (their inputs), plus the embedding's forward all-reduce on the first
    stage and, on the last, the head input's backward all-reduce and the vocab-parallel loss's 3
    floats per token. pp: each microbatch's activation forward and its gradient backward, per
    neighbouring stage."""
    dp, tp, pp = args.mesh
    tokens = args.batch // dp * args.seq
    act = tokens * CONFIG["n_embd"] * 4
    first, last = r["coords"]["pp"] == 0, r["coords"]["pp"] == pp - 1
    out = {"dp": r["grad_bytes"] if dp > 1 else 0}
    out["tp"] = 0 if tp == 1 else 4 * r["layers"] * act + (act if first else 0) + ((act + 3 * tokens * 4) if last else 0)
    out["pp"] = 0 if pp == 1 else act * 2 * ((0 if first else 1) + (0 if last else 1))
    return out


def worker(rank: int, world: int, path: str, args: argparse.Namespace):
    return three_d(rank, world, path, args) if args.mesh else ddp_vs_qn(rank, world, path, args)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--dp", type=int, default=2)
    parser.add_argument("--mesh", type=lambda s: tuple(int(x) for x in s.split(",")), default=None, help="dp,tp,pp")
    parser.add_argument("--microbatches", type=int, default=4)
    parser.add_argument("--batch", type=int, default=8, help="global batch")
    parser.add_argument("--seq", type=int, default=128)
    parser.add_argument("--bucket-mb", type=float, default=25.0)
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--zero", action="store_true", help="qn_hf side uses qn_hf.optimizer(zero=True) (ZeRO-1)")
    args = parser.parse_args()

    from transformers import GPT2Config, GPT2LMHeadModel

    path = tempfile.mkdtemp(prefix="qn_hf_dp_")
    torch.manual_seed(0)
    GPT2LMHeadModel(GPT2Config(**CONFIG)).save_pretrained(path)
    world = math.prod(args.mesh) if args.mesh else args.dp
    out = run_world(worker, world=world, extra=(path, args))
    cores = os.cpu_count()
    params = sum(p.numel() for p in GPT2LMHeadModel.from_pretrained(path).parameters())
    print(f"GPT-2 {CONFIG['n_layer']} layers, n_embd {CONFIG['n_embd']}, vocab {CONFIG['vocab_size']} ({params / 1e6:.1f}M params); "
          f"global batch {args.batch}x{args.seq}; {world} gloo ranks x {max(1, cores // world)} thread(s) on {cores} cores")
    if not args.mesh:
        qn, ddp = statistics.median(out["rates"]["qn_hf"]), statistics.median(out["rates"]["DDP"])
        print(f"bucket {args.bucket_mb} MB; gradient {out['grad_bytes'] / 2**20:.1f} MiB in {out['buckets']} buckets")
        print(f"qn_hf dp={world}: {qn:.3f} steps/s {[round(r, 3) for r in out['rates']['qn_hf']]}")
        print(f"DDP   dp={world}: {ddp:.3f} steps/s {[round(r, 3) for r in out['rates']['DDP']]}")
        print(f"ratio qn_hf / DDP = {qn / ddp:.2f}x" + (" (qn_hf with zero=True)" if args.zero else ""))
        ring = 2 * (world - 1) / world  # all-reduce, or reduce-scatter + all-gather
        print(f"dp bytes per step per rank on a ring (rank 0, from CommMeter): {out['dp_bytes']:,.0f}; gradient bytes "
              f"{out['grad_bytes']:,}; ratio {out['dp_bytes'] / out['grad_bytes']:.4f} (theory 2(N-1)/N = {ring:.4f})")
        print(f"optimizer state on rank 0: {out['state_bytes']:,} B")
        print("one qn_hf step, rank 0:\n" + out["table"])
        return
    print(f"mesh (dp, tp, pp) = {args.mesh}, M = {args.microbatches}; train steps/s (oversubscribed): {out[0]['rate']:.3f}")
    for r in out:
        measured = {g: sum(t.nbytes for (gg, _), t in r["totals"].items() if gg == g) for g in ("dp", "tp", "pp")}
        expect = theory(r, args)
        line = "  ".join(f"{g}: {measured[g]:,} B (theory {expect[g]:,})" for g in ("dp", "tp", "pp"))
        print(f"rank coords {r['coords']}: {line}")
    print("rank 0 detail:\n" + out[0]["table"])


if __name__ == "__main__":
    main()
