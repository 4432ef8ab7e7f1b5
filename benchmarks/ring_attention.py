"""Ring attention alone, two implementations side by side: step time and peak memory per rank.

    python benchmarks/ring_attention.py --before /work/before      # cp=2, 1 x 8,192 tokens
    python benchmarks/ring_attention.py --before /work/before --documents 4 --rounds 3

Each variant is a checkout's ``qn_hf/context_parallel/ring_attention.py`` (``--before`` a pristine copy, ``--after``
this one by default), loaded from its file in a fresh world of ``--cp`` gloo ranks, one thread per
rank; the variants alternate (before, after, before, after, ...) so that a change in the machine's
load falls on both. A step is one call of ``ring_attention`` forward and its backward, float32,
batch 1, ``--heads`` query heads over ``--kv-heads`` KV heads of ``--head-dim``, the balanced layout;
``--documents N`` packs N documents into the sequence (the masked path) instead of one.

Time: the slowest rank's wall time per step (the ring waits for it), median over ``--steps`` steps
after one warm-up step. Memory: the rise of the process's resident set during a step above what
it held just before (inputs and gradients of the previous step freed): Linux's high-water mark
``VmHWM`` is reset through ``/proc/self/clear_refs`` before each step and read after it. glibc is
told to serve every allocation above 64 KiB with its own mmap (``MALLOC_MMAP_THRESHOLD_``), so
freed tensors go back to the system and the mark follows the tensors alive, kernels' scratch
included. Both ranks are reported; the largest rise over the steps counts.
"""

from __future__ import annotations

import argparse
import gc
import importlib.util
import os
import statistics
import sys
import time
from pathlib import Path

import torch
from world import reset_high_water, run_world, status_kib

HERE = Path(__file__).resolve().parents[1]


def _load(root: str):
    """The checkout's ring attention module. Its folder is loaded as a package of its own name (the
    module imports only torch and its sibling ``kernels.py``), so two checkouts' versions can run in
    one process without either replacing the installed qn_hf; an older checkout keeps the module at
    the package root, where its folder is the package root itself."""
    folder = Path(root) / "qn_hf" / "context_parallel"
    if not (folder / "ring_attention.py").exists():
        folder = Path(root) / "qn_hf"
    package = f"ring_checkout_{abs(hash(str(folder)))}"
    spec = importlib.util.spec_from_file_location(package, folder / "__init__.py",
                                                  submodule_search_locations=[str(folder)])
    module = importlib.util.module_from_spec(spec)
    sys.modules[package] = module  # the relative imports and dataclasses look their package up
    return importlib.import_module(f"{package}.ring_attention")


def ring_worker(rank: int, world: int, root: str, seq: int, heads: int, kv_heads: int, head_dim: int, steps: int,
                documents: int) -> list[dict]:
    import torch.distributed as dist

    torch.set_num_threads(1)
    ring = _load(root)
    layout = (getattr(ring, "PieceLayout", None) or ring.ChunkLayout)(size=world)  # named ChunkLayout before
    gen = torch.Generator().manual_seed(rank)
    local = seq // world
    q = torch.randn(1, heads, local, head_dim, generator=gen).requires_grad_()
    k, v = (torch.randn(1, kv_heads, local, head_dim, generator=gen).requires_grad_() for _ in range(2))
    grad = torch.randn(1, heads, local, head_dim, generator=gen)
    docs = (torch.arange(seq) * documents // seq).unsqueeze(0)  # equal documents, borders inside pieces
    valid = torch.ones(1, seq, dtype=torch.long)
    times, rises, fingerprint = [], [], None
    for step in range(steps + 1):
        for t in (q, k, v):
            t.grad = None
        gc.collect()
        dist.barrier()
        before = status_kib("VmRSS")
        reset_high_water()
        start = time.perf_counter()
        out = ring.ring_attention(q, k, v, documents=docs, valid=valid, layout=layout, group=dist.group.WORLD,
                                  scaling=head_dim ** -0.5)
        out.backward(grad)
        elapsed = time.perf_counter() - start
        rise = (status_kib("VmHWM") - before) * 1024
        if step:  # the first step is the warm-up
            times.append(elapsed)
            rises.append(rise)
        fingerprint = [float(out.detach().double().sum()), *(float(t.grad.double().abs().sum()) for t in (q, k, v))]
        del out
    mine = {"rank": rank, "times": times, "rise": max(rises), "baseline": status_kib("VmRSS") * 1024,
            "fingerprint": fingerprint}
    everyone: list = [None] * world
    dist.all_gather_object(everyone, mine)
    return everyone


def _load_average() -> str:
    return " ".join(Path("/proc/loadavg").read_text().split()[:3])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--before", required=True, help="root of the checkout to compare against")
    parser.add_argument("--after", default=str(HERE))
    parser.add_argument("--cp", type=int, default=2)
    parser.add_argument("--seq", type=int, default=8192)
    parser.add_argument("--heads", type=int, default=8)
    parser.add_argument("--kv-heads", type=int, default=2)
    parser.add_argument("--head-dim", type=int, default=64)
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--documents", type=int, default=1)
    args = parser.parse_args()
    # read by glibc when the ranks start (spawned: they inherit the environment)
    os.environ["MALLOC_MMAP_THRESHOLD_"] = str(64 * 1024)
    print(f"ring attention, cp={args.cp}, 1 x {args.seq} tokens, {args.heads} heads over {args.kv_heads} KV heads of "
          f"{args.head_dim}, float32, {args.documents} document(s), forward + backward, 1 thread per rank, "
          f"{os.cpu_count()} cores; load average at start {_load_average()}")
    print(f"{'variant':<8}{'round':>6}{'step s (median, max rank)':>27}{'peak rise MiB per rank':>26}"
          f"{'RSS MiB per rank':>20}   fingerprint (sum out, |dq|, |dk|, |dv|), rank 0")
    results: dict[str, list] = {"before": [], "after": []}
    for round_ in range(args.rounds):
        for name, root in (("before", args.before), ("after", args.after)):
            ranks = run_world(ring_worker, world=args.cp, extra=(root, args.seq, args.heads, args.kv_heads,
                                                                 args.head_dim, args.steps, args.documents))
            step = statistics.median(max(r["times"][i] for r in ranks) for i in range(args.steps))
            results[name].append((step, [r["rise"] for r in ranks]))
            rises = "/".join(f"{r['rise'] / 2**20:.0f}" for r in ranks)
            rss = "/".join(f"{r['baseline'] / 2**20:.0f}" for r in ranks)
            print(f"{name:<8}{round_:>6}{step:>27.3f}{rises:>26}{rss:>20}   "
                  + ", ".join(f"{x:.6g}" for x in ranks[0]["fingerprint"]))
    print(f"load average at end {_load_average()}")
    for name, runs in results.items():
        print(f"{name}: step {statistics.median(s for s, _ in runs):.3f} s (median over rounds), peak rise "
              f"{max(max(r) for _, r in runs) / 2**20:.0f} MiB (largest rank, all rounds)")
    before, after = (statistics.median(s for s, _ in results[n]) for n in ("before", "after"))
    print(f"after / before: step time x{after / before:.2f}, peak rise x"
          f"{max(max(r) for _, r in results['after']) / max(max(r) for _, r in results['before']):.3f}")


if __name__ == "__main__":
    main()
