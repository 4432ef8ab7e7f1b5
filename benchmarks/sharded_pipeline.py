"""Sharded data parallelism under a pipeline: a stage's weights gathered once per step and kept
between microbatches (``dp_shard_gather="step"``, the default) against gathered again before each
microbatch's forward and backward (``"microbatch"``), and the unsharded pipeline beside them.

    python benchmarks/sharded_pipeline.py [--rounds 3] [--steps 3]

An 8-layer Llama (hidden 512, vocab 8192, 29.4M parameters, float32) on dp=2 x pp=2 gloo ranks (4
ranks, one intra-op thread each), 1F1B over M=4 microbatches of 2 x 128 tokens, AdamW. Per rank of
stage 0:

* what a step allocates above what the rank holds between steps, at its peak: every storage an op
  creates during the step counted while it lives (``LiveAllocations``) plus the weights FSDP holds
  gathered, sampled after every op — the gathered weights, the gradients accumulated whole until the
  step's reduction, the activations; before the step's reduction and during it;
* what it holds between steps: weights, AdamW moments (its rows of each under dp_shard) and the dp
  buckets' gradient buffers (none under dp_shard: gradients are made in the step and freed by
  ``zero_grad(set_to_none=True)``);
* the dp_shard group's all-gather and reduce-scatter bytes in one step (``CommMeter``);
* step time, the median of ``--steps`` steps, the three runs alternating ``--rounds`` times.
"""

from __future__ import annotations

import torch
from torch.distributed.tensor import DTensor
from world import (
    StepPeak,
    alternating_medians,
    benchmark_parser,
    median_step_seconds,
    run_world,
    save_tiny_llama,
    storage_bytes,
)

CONFIG = dict(hidden_size=512, intermediate_size=1408, num_hidden_layers=8, num_attention_heads=8,
              num_key_value_heads=8, vocab_size=8192, max_position_embeddings=256, bos_token_id=1, eos_token_id=2)
ROWS, SEQ, MICROBATCHES = 2, 128, 4  # per microbatch
RUNS = {"dp=2, no dp_shard": dict(dp_shard=1), "dp_shard=2, gather once per step": dict(dp_shard=2),
        "dp_shard=2, gather per microbatch": dict(dp_shard=2, dp_shard_gather="microbatch")}


def _build(path: str, run: str):
    from transformers import AutoModelForCausalLM

    import qn_hf

    pm = qn_hf.parallelize(AutoModelForCausalLM.from_pretrained(path), dp=2, pp=2, microbatches=MICROBATCHES,
                           seed=0, **RUNS[run])
    opt = torch.optim.AdamW(pm.parameters(), lr=1e-4)

    def step(n: int) -> None:
        ids = torch.randint(3, CONFIG["vocab_size"], (ROWS * MICROBATCHES, SEQ),
                            generator=torch.Generator().manual_seed(pm.coords.dp * 1000 + n))
        opt.zero_grad(set_to_none=True)
        pm.train_step({"input_ids": ids, "labels": ids})
        opt.step()

    return pm, opt, step


def measure_worker(rank: int, world: int, path: str, run: str) -> dict:
    from qn_hf.comm_meter import CommMeter

    pm, opt, step = _build(path, run)
    step(0)  # warm-up: optimizer state exists, FSDP initialized, the pipeline's header sent
    opt.zero_grad(set_to_none=True)  # as the next step starts: what stays is held between steps
    local = [p.to_local() if isinstance(p, DTensor) else p for p in pm.parameters()]
    # the dp buckets' flat gradient buffers stay allocated between steps (the gradients view them)
    grads = [b.buffer for b in pm.buckets.buckets] if pm.buckets is not None else []
    state = [t.to_local() if isinstance(t, DTensor) else t for s in opt.state.values() for t in s.values()
             if isinstance(t, torch.Tensor) and t.dim() > 0]
    held = {"weights": storage_bytes(local), "grads": storage_bytes(grads), "state": storage_bytes(state)}
    peak = StepPeak(pm.module)
    schedule_peak = [0]
    if pm.sharded is not None:  # the peak before the step's one reduction, apart from the peak during it
        finish = pm.sharded.finish_backward

        def finish_after_noting(**kwargs) -> None:
            schedule_peak[0] = peak.bytes
            finish(**kwargs)

        pm.sharded.finish_backward = finish_after_noting
    with peak:
        step(1)
    if pm.sharded is not None:
        pm.sharded.finish_backward = finish
    with CommMeter(pm) as meter:
        step(2)
    traffic = {op: (t.calls, t.nbytes) for (g, op), t in meter.totals().items() if g == "dp_shard"}
    return {"stage": pm.coords.pp, "held": held, "peak": peak.bytes, "schedule_peak": schedule_peak[0] or peak.bytes,
            "traffic": traffic,
            "params": sum(p.numel() for p in pm.parameters())}


def time_worker(rank: int, world: int, path: str, run: str, steps: int) -> float:
    return median_step_seconds(_build(path, run)[2], steps=steps)


def main() -> None:
    parser = benchmark_parser(__doc__, steps=3)
    args = parser.parse_args()
    path = save_tiny_llama(CONFIG, prefix="qn_hf_sharded_pp_")
    mib = 2**20
    print(f"stage 0 of dp=2 x pp=2, 1F1B, M={MICROBATCHES}, float32, AdamW; MiB per rank:")
    print("| run | held: weights | gradient buffers | AdamW moments | step's peak above that (in the schedule) | "
          "peak in all | all-gather (calls, MiB) | reduce-scatter (calls, MiB) |")
    print("|---|---|---|---|---|---|---|---|")
    for run in RUNS:
        r = run_world(measure_worker, world=4, extra=(path, run))
        held, traffic = r["held"], r["traffic"]
        ag = traffic.get("all_gather_into_tensor", (0, 0))
        rs = traffic.get("reduce_scatter_tensor", (0, 0))
        print(f"| {run} | {held['weights'] / mib:.1f} | {held['grads'] / mib:.1f} | {held['state'] / mib:.1f} | "
              f"{r['peak'] / mib:.1f} ({r['schedule_peak'] / mib:.1f}) | {(sum(held.values()) + r['peak']) / mib:.1f} | "
              f"{ag[0]}, {ag[1] / mib:.1f} | {rs[0]}, {rs[1] / mib:.1f} |")
    times = alternating_medians(time_worker, RUNS, world=4, rounds=args.rounds, extra=lambda run: (path, run, args.steps))
    base = times["dp=2, no dp_shard"]
    for run, t in times.items():
        print(f"step time, {run}: {t * 1e3:.0f} ms ({t / base:.2f}x the unsharded pipeline; median of {args.rounds} "
              f"alternating rounds of {args.steps} steps)")


if __name__ == "__main__":
    main()
