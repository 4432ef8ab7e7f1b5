"""When dp_shard's collectives run against the compute, on a measured timeline: a profiler trace of
one training step, read back into which block computes when and when each all-gather and
reduce-scatter is issued and executes.

    python benchmarks/sharded_overlap.py [--rounds 3] [--steps 3] [--trace DIR]

A 6-layer Llama (hidden 384, 16.9M parameters, float32) at dp=2, dp_shard=2 on 2 gloo ranks (one
intra-op thread each), one microbatch of 2 x 256 tokens, SGD. ``torch.profiler`` records the step on
rank 0: FSDP's own record functions on the main thread (a group's pre-forward with its copy-out and
the next block's prefetch, post-forward, pre-backward, post-backward's reduce), torch's c10d calls
(when a collective is issued) and gloo's work on its worker threads (when it executes). From them,
per block: its forward and backward compute (between FSDP's hooks), when the next block's
all-gather is issued and when it executes, and when its reduce-scatter is issued and executes.

Two runs:

* as qn_hf runs: the next block's all-gather is issued before the running block's compute (FSDP's
  explicit forward prefetch, which ``ShardedParameters`` sets, and its backward prefetch), and each
  block's reduce-scatter as its backward ends, before the previous block's backward. FSDP issues
  them on streams of their own, which is where they overlap compute on a GPU; a CPU has no streams,
  so gloo's calls block the main thread until done: the timeline shows the order, with ~0 overlap.
* "async all-gather" (this benchmark only): FSDP's ``_set_unshard_async_op(True)``, so gloo runs a
  prefetched all-gather on its worker thread while the main thread computes, as NCCL runs it on its
  own stream. Its overlap is what prefetching before compute buys when the collective can run beside
  it. FSDP's reduce-scatter has no such switch (on CPU it blocks either way).

The overlap of a collective is the share of its execution (gloo's worker thread) during which the
main thread was computing a block. Step times: the median of ``--steps`` steps, both runs
alternating ``--rounds`` times.
"""

from __future__ import annotations

import json
import os
import re

import torch
from world import alternating_medians, benchmark_parser, median_step_seconds, run_world, save_tiny_llama

CONFIG = dict(hidden_size=384, intermediate_size=1024, num_hidden_layers=6, num_attention_heads=6,
              num_key_value_heads=6, vocab_size=8192, max_position_embeddings=512, bos_token_id=1, eos_token_id=2)
ROWS, SEQ = 2, 256
RUNS = ("as qn_hf runs", "async all-gather")


def _build(path: str, run: str):
    from transformers import AutoModelForCausalLM

    import qn_hf

    pm = qn_hf.parallelize(AutoModelForCausalLM.from_pretrained(path), dp=2, dp_shard=2, seed=0)
    if run == "async all-gather":
        pm.module._set_unshard_async_op(True)  # FSDP's own switch (private; no public equivalent)
    opt = torch.optim.SGD(pm.parameters(), lr=1e-3)

    def step(n: int) -> None:
        ids = torch.randint(3, CONFIG["vocab_size"], (ROWS, SEQ),
                            generator=torch.Generator().manual_seed(pm.coords.dp * 1000 + n))
        opt.zero_grad(set_to_none=True)
        pm.train_step({"input_ids": ids, "labels": ids})
        opt.step()

    return pm, step


def _intervals(events: list[dict]) -> dict:
    """The step's timeline (ms from its first event) from the profiler's events."""
    t0 = min(e["start"] for e in events)
    main = [e for e in events if e["main"]]
    workers = sorted((e for e in events if e["name"].startswith("gloo:")), key=lambda e: e["start"])

    def first(pattern: str, after: float = -1.0) -> dict | None:
        return next((e for e in main if re.fullmatch(pattern, e["name"]) and e["start"] > after), None)

    blocks = sorted({int(m[1]) for e in main if (m := re.search(r"model\.layers\.(\d+)\)", e["name"]))})
    compute = []  # (block, pass, start, end): from the end of FSDP's hooks before it to the first after it
    for b in blocks:
        pre = first(rf"FSDP::pre_forward \(model\.layers\.{b}\)")
        prefetch = first(rf"FSDP::forward_prefetch for model\.layers\.{b + 1}", pre["start"])
        post = first(rf"FSDP::post_forward \(model\.layers\.{b}\)", pre["start"])
        start = prefetch["end"] if prefetch and prefetch["start"] < post["start"] else pre["end"]
        compute.append((b, "forward", start, post["start"]))
        pre_b = first(rf"FSDP::pre_backward \(model\.layers\.{b}\)")
        post_b = first(rf"FSDP::post_backward_accumulate \(model\.layers\.{b}\)", pre_b["start"])
        compute.append((b, "backward", pre_b["end"], post_b["start"]))
    # each c10d call, matched to the gloo work that executed it: the first unmatched one that starts after
    calls = sorted((e for e in main if e["name"] in ("c10d::_allgather_base_", "c10d::_reduce_scatter_base_")),
                   key=lambda e: e["start"])
    kinds = {"c10d::_allgather_base_": ("gloo:all_gather",),
             "c10d::_reduce_scatter_base_": ("gloo:reduce_scatter", "gloo:all_reduce")}
    used, collectives = set(), []
    for call in calls:
        i = next(i for i, w in enumerate(workers)
                 if i not in used and w["name"] in kinds[call["name"]] and w["start"] >= call["start"])
        used.add(i)
        work = workers[i]
        around = [e for e in main if e["start"] <= call["start"] <= e["end"] and e["name"].startswith("FSDP::")]
        # what FSDP was doing when it issued the call: the innermost hook around it, not its own wrapper
        hooks = [e for e in around if not e["name"].startswith("FSDP::all_gather")]
        inside = min(hooks, key=lambda e: e["end"] - e["start"])["name"] if hooks else "FSDP::root"
        # whose weights or gradients: the wrapper FSDP names after its group (none for the root)
        wrapper = next((e["name"] for e in around
                        if e["name"].startswith(("FSDP::all_gather", "FSDP::post_backward_reduce"))), "")
        target = re.search(r"model\.layers\.(\d+)", wrapper)
        collectives.append({"op": "all-gather" if "allgather" in call["name"] else "reduce-scatter",
                            "block": int(target[1]) if target else None, "during": inside.removeprefix("FSDP::"),
                            "issued": call["start"], "start": work["start"], "end": work["end"]})
    busy = [(s, e) for _, _, s, e in compute]
    for c in collectives:
        hidden = sum(max(0.0, min(c["end"], e) - max(c["start"], s)) for s, e in busy)
        c["overlap"] = hidden / max(c["end"] - c["start"], 1e-9)
    ms = lambda x: (x - t0) / 1e3  # noqa: E731  (profiler times are in microseconds)
    return {"compute": [(b, p, ms(s), ms(e)) for b, p, s, e in compute],
            "collectives": [{**c, "issued": ms(c["issued"]), "start": ms(c["start"]), "end": ms(c["end"])}
                            for c in collectives]}


def profile_worker(rank: int, world: int, path: str, run: str, trace: str | None) -> dict:
    from torch.profiler import ProfilerActivity, profile

    pm, step = _build(path, run)
    step(0)
    step(1)
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        step(2)
    if trace and rank == 0:
        prof.export_chrome_trace(os.path.join(trace, f"{run.replace(' ', '_')}.json"))
    kept = [e for e in prof.events() if e.name.startswith(("FSDP::", "c10d::", "gloo:"))]
    main = next(e.thread for e in kept if e.name.startswith("FSDP::"))  # FSDP's hooks run on the main thread
    events = [{"name": e.name, "start": e.time_range.start, "end": e.time_range.end, "main": e.thread == main}
              for e in kept]
    return _intervals(events)


def time_worker(rank: int, world: int, path: str, run: str, steps: int) -> float:
    return median_step_seconds(_build(path, run)[1], steps=steps)


def main() -> None:
    parser = benchmark_parser(__doc__, steps=3)
    parser.add_argument("--trace", default=None, help="write each run's chrome trace (rank 0) into this folder")
    args = parser.parse_args()
    if args.trace:
        os.makedirs(args.trace, exist_ok=True)
    path = save_tiny_llama(CONFIG, prefix="qn_hf_overlap_")
    for run in RUNS:
        r = run_world(profile_worker, world=2, extra=(path, run, args.trace))
        print(f"\n{run}: rank 0's step in time order, ms from its first event (all-gathers and reduce-scatters of "
              f"the root, block None, left out of the table, counted below)")
        print("| ms | main thread | collective | issued during | executes on gloo's thread | overlap with compute |")
        print("|---|---|---|---|---|---|")
        rows = [(s_, f"block {b} {p} computes until {e:.2f}", "", "", "", "") for b, p, s_, e in r["compute"]]
        rows += [(c["issued"], "issues", f"{c['op']} of block {c['block']}", c["during"],
                  f"{c['start']:.2f}-{c['end']:.2f}", f"{100 * c['overlap']:.0f}%")
                 for c in r["collectives"] if c["block"] is not None]
        for row in sorted(rows):
            print(f"| {row[0]:.2f} | " + " | ".join(row[1:]) + " |")
        for op in ("all-gather", "reduce-scatter"):
            cs = [c for c in r["collectives"] if c["op"] == op]
            total = sum(c["end"] - c["start"] for c in cs)
            hidden = sum((c["end"] - c["start"]) * c["overlap"] for c in cs)
            print(f"{op}: {len(cs)} calls executing {total:.2f} ms, {hidden:.2f} ms of it ({100 * hidden / total:.0f}%) "
                  f"while a block computed")
        if args.trace:
            with open(os.path.join(args.trace, f"{run.replace(' ', '_')}.timeline.json"), "w") as f:
                json.dump(r, f, indent=1)
    times = alternating_medians(time_worker, RUNS, world=2, rounds=args.rounds, extra=lambda run: (path, run, args.steps))
    for run, t in times.items():
        base = times[RUNS[0]]
        print(f"step time, {run}: {t * 1e3:.1f} ms ({t / base:.3f}x; median of {args.rounds} alternating rounds "
              f"of {args.steps} steps)")


if __name__ == "__main__":
    main()
