"""Demo: train a tiny GPT-2 with 3D parallelism on CPU processes and watch the loss fall.

    torchrun --standalone --nproc-per-node 8 scripts/demo.py                  # dp=2 x tp=2 x pp=2
    torchrun --standalone --nproc-per-node 4 scripts/demo.py                  # a mesh for 4: tp=2 x pp=2
    torchrun --standalone --nproc-per-node 4 scripts/demo.py --dp 2 --tp 2    # or name it

Without --dp/--tp/--pp the mesh is chosen for the number of processes (``choose_mesh``): tensor
parallelism 2 where it divides, then pipeline parallelism 2, the rest data parallel, so 8 processes
give the showcase dp=2 x tp=2 x pp=2, and 1 process trains plainly. The first line says which.

The model is built from a config (no download), written with ``save_pretrained`` and loaded back
with ``from_pretrained`` as a user would. The corpus is this repository's own text, tokenized as
bytes, so the demo runs offline. At the end the trained model is consolidated with
``save_pretrained`` and reloaded on rank 0 to check that it gives the same loss.
"""

from __future__ import annotations

import argparse
import datetime
import os
import tempfile
import time
from pathlib import Path

import torch
import torch.distributed as dist
import transformers
from transformers import GPT2Config, GPT2LMHeadModel

import qn_hf
from qn_hf.arguments import plural
from qn_hf.devices import default_device
from qn_hf.mesh import init_distributed, launched_world_size

ROOT = Path(__file__).resolve().parent.parent
HEADS = LAYERS = 4  # of the demo's GPT-2: tp must divide the heads, pp at most the layers
SHOWCASE = {"tp": 2, "pp": 2}  # each as long as it divides what is left; the rest is dp


def choose_mesh(world: int) -> dict[str, int]:
    """dp, tp, pp for ``world`` processes: tp=2 and pp=2 where they divide it, the rest dp (8 gives
    dp=2 x tp=2 x pp=2, 4 tp=2 x pp=2, 2 tp=2, an odd count data parallelism alone)."""
    mesh, left = {}, world
    for dim, degree in SHOWCASE.items():
        mesh[dim] = degree if left % degree == 0 else 1
        left //= mesh[dim]
    return {"dp": left, **mesh}


def mesh_from_args(args: argparse.Namespace, world: int) -> tuple[dict[str, int], str]:
    """The mesh the user named (unnamed tp/pp 1, dp what is left), else ``choose_mesh``; and why."""
    named = {dim: getattr(args, dim) for dim in ("dp", "tp", "pp") if getattr(args, dim) is not None}
    if not named:
        return choose_mesh(world), f"chosen for {plural(world, 'process')}"
    tp, pp = named.get("tp", 1), named.get("pp", 1)
    return {"dp": named.get("dp", max(1, world // (tp * pp))), "tp": tp, "pp": pp}, "as given"


def corpus_bytes() -> torch.Tensor:
    files = sorted(ROOT.glob("*.md")) + sorted((ROOT / "qn_hf").glob("*.py"))
    data = b"\n".join(f.read_bytes() for f in files)
    return torch.tensor(list(data), dtype=torch.long)


def batches(data: torch.Tensor, *, batch: int, seq: int, seed: int):
    gen = torch.Generator().manual_seed(seed)
    while True:
        starts = torch.randint(0, len(data) - seq, (batch,), generator=gen)
        ids = torch.stack([data[s : s + seq] for s in starts])
        yield {"input_ids": ids, "labels": ids}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--dp", type=int, default=None, help="default: chosen for the number of processes")
    parser.add_argument("--tp", type=int, default=None, help=f"default: chosen (it must divide the {HEADS} heads)")
    parser.add_argument("--pp", type=int, default=None, help=f"default: chosen (at most the {LAYERS} layers)")
    parser.add_argument("--schedule", default="1f1b", choices=["1f1b", "gpipe"])
    parser.add_argument("--microbatches", type=int, default=4)
    parser.add_argument("--batch", type=int, default=16,
                        help="global batch size (split over dp; raised to a multiple of dp*microbatches if need be)")
    parser.add_argument("--seq", type=int, default=64)
    parser.add_argument("--steps", type=int, default=40)
    # The corpus is this repository's own text, which changes with every commit: at 3e-3 some versions of it
    # made the loss spike within 10 steps (the test's run); 1e-3 falls steadily on every one tried.
    parser.add_argument("--lr", type=float, default=1e-3)
    args = parser.parse_args()

    world = launched_world_size()
    mesh, why = mesh_from_args(args, world)
    step_rows = mesh["dp"] * args.microbatches
    batch = -(-args.batch // step_rows) * step_rows  # every dp rank splits its rows into whole microbatches
    transformers.logging.set_verbosity_error()
    transformers.logging.disable_progress_bar()
    torch.set_num_threads(max(1, (os.cpu_count() or 1) // int(os.environ.get("WORLD_SIZE", "1"))))
    workdir = Path(os.environ.get("QN_HF_DEMO_DIR", tempfile.gettempdir())) / "qn_hf_demo"
    # Join the process group first (as a user script may), so rank 0 can write the initial
    # checkpoint and the others wait at a barrier; parallelize then reuses this group.
    init_distributed(device=default_device(), timeout=datetime.timedelta(minutes=5))
    rank = dist.get_rank()
    if rank == 0:
        torch.manual_seed(0)
        config = GPT2Config(n_layer=LAYERS, n_embd=64, n_head=HEADS, n_positions=args.seq, vocab_size=257,
                            bos_token_id=256, eos_token_id=256, resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)
        GPT2LMHeadModel(config).save_pretrained(workdir / "init")
    dist.barrier()

    model = GPT2LMHeadModel.from_pretrained(workdir / "init")
    pm = qn_hf.parallelize(model, **mesh, microbatches=args.microbatches, schedule=args.schedule, seed=0)
    opt = torch.optim.AdamW(pm.parameters(), lr=args.lr)
    local_batch = batch // mesh["dp"]
    data = batches(corpus_bytes(), batch=local_batch, seq=args.seq, seed=1000 + pm.coords["dp"])
    held_out_global = next(batches(corpus_bytes(), batch=batch, seq=args.seq, seed=7))
    held_out = {k: v[pm.coords["dp"] * local_batch : (pm.coords["dp"] + 1) * local_batch] for k, v in held_out_global.items()}

    shards = sum(p.numel() for p in pm.parameters())
    total = sum(p.numel() for p in GPT2LMHeadModel.from_pretrained(workdir / "init").parameters())
    say(rank, f"mesh dp={mesh['dp']} tp={mesh['tp']} pp={mesh['pp']} ({why}; 8 processes give dp=2 x tp=2 x pp=2), "
              f"global batch {batch}, {plural(args.microbatches, 'microbatch')}: "
              f"this rank holds {shards:,} of {total:,} parameters")
    first_eval = pm.eval_step(held_out).item()
    start = time.perf_counter()
    for step in range(1, args.steps + 1):
        opt.zero_grad()
        loss = pm.train_step(next(data))
        norm = qn_hf.clip_grad_norm_(pm, 1.0)
        opt.step()
        if step == 1 or step % 5 == 0:
            say(rank, f"step {step:3d}  loss {loss.item():.4f}  grad-norm {norm.item():.3f}  {time.perf_counter() - start:.1f}s")
    last_eval = pm.eval_step(held_out).item()
    say(rank, f"held-out loss {first_eval:.4f} -> {last_eval:.4f}")

    pm.save_pretrained(str(workdir / "trained"))
    if rank == 0:
        reloaded = GPT2LMHeadModel.from_pretrained(workdir / "trained").eval()
        with torch.no_grad():
            plain = reloaded(**held_out_global).loss.item()
        say(rank, f"save_pretrained -> from_pretrained, one process, plain HF: held-out loss {plain:.4f}")
        if abs(plain - last_eval) > 1e-4 * abs(last_eval):
            raise SystemExit(f"the exported model disagrees with the parallel one: {plain:.6f} != {last_eval:.6f}")
    if last_eval >= first_eval:
        raise SystemExit(f"the loss did not fall: {first_eval:.4f} -> {last_eval:.4f}")
    dist.destroy_process_group()


def say(rank: int, message: str) -> None:
    if rank == 0:
        print(message, flush=True)


if __name__ == "__main__":
    main()
