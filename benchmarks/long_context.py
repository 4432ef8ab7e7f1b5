"""Long context within memory: peak memory per rank and step time against sequence length, for a model with a
128k vocabulary, with and without qn_hf's options, beside transformers' own gradient checkpointing.

    python benchmarks/long_context.py                           # the table and the 4 GiB search, cp=1 and cp=2
    python benchmarks/long_context.py --lengths 2048 4096 --budget-gib 4 --longest 32768 --json results/long_context.json

Model: a Llama of ``--layers`` blocks, hidden ``--hidden``, a vocabulary of 131,072 (Llama 3's), float32, one
sequence a step (batch 1), seeded random weights; the step is ``train_step`` (or the plain model's forward with
labels and its backward), no optimizer. Runs, each in a fresh world of cp gloo ranks, one thread per rank:

* ``qn_hf``: ``parallelize(model, cp=cp)``, what qn_hf did before these options;
* ``recompute``: ``recompute="full"``;
* ``chunks``: ``loss_chunk_tokens=--chunk`` (the loss a chunk of tokens at a time: step/loss_chunks.py);
* ``both``: ``recompute="full"``, ``offload="activations"``, ``loss_chunk_tokens=--chunk``. On a CPU the host
  memory an offload moves to is the memory it moves from, so this run costs the same memory as recompute and
  chunks alone plus the offload's copies: it measures what offload costs, not what it saves (a GPU's figure);
* ``hf checkpointing`` (cp=1): the plain model with transformers' ``gradient_checkpointing_enable``, its
  activations offloaded to pinned host memory where CUDA is there (``offload=True`` needs pinned memory, which
  a CPU-only torch refuses), its own loss over the whole logits.

Memory: per rank, the high-water mark of the resident set during the measured step (``VmHWM``, reset just
before it; glibc returns every freed allocation above 64 KiB to the system, so the mark follows the tensors
alive, kernels' scratch included), in all and as the rise above what the process held just before the step
(weights, the previous step's gradients). The largest rank counts. Time: median wall seconds of ``--steps``
steps after one warm-up step, the slowest rank.

``--budget-gib``: at cp=2, the longest sequence (doubling from the shortest length) whose step stays within that
many GiB per rank in all, for ``qn_hf`` (today) and ``both``, stopping at ``--longest`` (``--no-search``: not run).

``--cap-gib``: a rank whose resident set passes that many GiB is stopped there (a thread reads it every 2 ms),
and its run is reported as needing more than the cap: a run that would not fit this machine's memory gives a
lower bound rather than taking the machine down.

The rise is measured twice: in the resident set (``VmHWM`` less what was resident before), and in the tensors
themselves (``StepPeak``: the most bytes of storages made during one more, untimed, step alive at once). Beside each
qn_hf run, the planner's figure for the same settings (``Planner.estimate``): the activations it keeps on the device
at their peak and on the host (offload: the same memory on a CPU) and what the loss's backward holds for a moment
(the gradients replace the last step's, which were held before the step).
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import statistics
import tempfile
import threading
import time

import torch
from world import StepPeak, reset_high_water, run_world, save_tiny_llama, status_kib

from qn_hf.local_world import WorldFailure

RUNS = ("qn_hf", "recompute", "chunks", "both", "hf checkpointing")
VOCAB = 131_072


def _options(run: str, chunk: int) -> dict:
    return {"qn_hf": {}, "recompute": {"recompute": "full"}, "chunks": {"loss_chunk_tokens": chunk},
            "both": {"recompute": "full", "offload": "activations", "loss_chunk_tokens": chunk}}[run]


def _stop_over(cap_kib: int, marker: str) -> None:
    """Stop this process once its resident set passes ``cap_kib`` (read every 2 ms, from a daemon thread), leaving
    ``marker`` behind to say why."""
    def watch() -> None:
        while status_kib("VmRSS") <= cap_kib:
            time.sleep(0.002)
        with open(marker, "w") as f:
            f.write("over the cap")
        os._exit(3)

    threading.Thread(target=watch, daemon=True).start()


def long_worker(rank: int, world: int, model_dir: str, run: str, seq: int, chunk: int, steps: int,
                cap_kib: int, marker: str) -> list[dict]:
    import torch.distributed as dist
    from transformers import AutoModelForCausalLM

    import qn_hf

    torch.set_num_threads(1)
    _stop_over(cap_kib, marker)
    model = AutoModelForCausalLM.from_pretrained(model_dir)
    ids = torch.randint(3, VOCAB, (1, seq), generator=torch.Generator().manual_seed(0))
    batch = {"input_ids": ids, "labels": ids.clone()}
    if run == "hf checkpointing":
        model.train()
        offload = torch.cuda.is_available()
        extra = {"offload": True} if offload else {}
        if hasattr(model, "activation_checkpointing_enable"):  # transformers 5.24 (the older name deprecated)
            model.activation_checkpointing_enable(activation_checkpointing_kwargs={"use_reentrant": False}, **extra)
        else:
            model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False}, **extra)

        def step() -> float:
            model.zero_grad(set_to_none=True)
            loss = model(**batch, use_cache=False).loss
            loss.backward()
            return loss.item()
    else:
        pm = qn_hf.parallelize(model, cp=world, **_options(run, chunk))

        def step() -> float:
            pm.module.zero_grad(set_to_none=True)
            return pm.train_step(batch).item()

    times, rises, peaks, loss = [], [], [], 0.0
    for i in range(steps + 1):
        gc.collect()
        dist.barrier()
        before = status_kib("VmRSS")
        reset_high_water()
        start = time.perf_counter()
        loss = step()
        elapsed = time.perf_counter() - start
        if i:  # the first step makes the gradients: a warm-up
            times.append(elapsed)
            peaks.append(status_kib("VmHWM") * 1024)
            rises.append(peaks[-1] - before * 1024)
    with StepPeak(model) as tensors:  # one more step, untimed: the rise counted in the tensors themselves
        step()
    mine = {"rank": rank, "times": times, "peak": max(peaks), "rise": max(rises), "loss": loss,
            "tensor_rise": tensors.bytes}
    everyone: list = [None] * world
    dist.all_gather_object(everyone, mine)
    return everyone


def measure(model_dir: str, run: str, *, cp: int, seq: int, chunk: int, steps: int, cap_gib: float) -> dict:
    with tempfile.TemporaryDirectory(prefix="long_context_cap_") as folder:
        marker = os.path.join(folder, "over")
        try:
            ranks = run_world(long_worker, world=cp, extra=(model_dir, run, seq, chunk, steps, int(cap_gib * 2**20),
                                                            marker))
        except WorldFailure:
            if not os.path.exists(marker):
                raise
            return {"run": run, "cp": cp, "seq": seq, "over_cap_bytes": int(cap_gib * 2**30)}
    return {"run": run, "cp": cp, "seq": seq, "step_s": statistics.median(max(r["times"][i] for r in ranks)
                                                                       for i in range(steps)),
            "peak_bytes": max(r["peak"] for r in ranks), "rise_bytes": max(r["rise"] for r in ranks),
            "tensor_rise_bytes": max(r["tensor_rise"] for r in ranks), "loss": ranks[0]["loss"]}


def planned(model_dir: str, run: str, *, cp: int, seq: int, chunk: int) -> dict | None:
    """The planner's figures for a qn_hf run (None for transformers' own): the peak activations on the device
    and on the host, and the gradients, per rank."""
    if run not in RUNS[:4]:
        return None
    from transformers import AutoConfig

    from qn_hf.config.parallel_config import ParallelConfig
    from qn_hf.planner.estimate import Planner

    est = Planner(AutoConfig.from_pretrained(model_dir), seq_len=seq, micro_batch_size=1).estimate(
        ParallelConfig.from_keywords(cp=cp, **_options(run, chunk)))
    stage = est.stages[0]
    return {"activation_bytes": stage.activation_bytes, "host_bytes": stage.host_bytes, "grad_bytes": stage.grad_bytes,
            "transient_bytes": stage.transient_bytes}


def planned_bytes(plan: dict) -> int:
    """The planner's figure for a step's rise on a CPU: the activations kept on the device and on the host (the
    same memory there) and the loss's backward's moment (the gradients replace the last step's, held before)."""
    return plan["activation_bytes"] + plan["host_bytes"] + plan["transient_bytes"]


def _row(r: dict) -> str:
    plan = r.get("planned")
    planner = f"{planned_bytes(plan) / 2**30:.2f}" if plan else "-"
    if "over_cap_bytes" in r:
        return (f"| {r['cp']} | {r['seq']:,} | {r['run']} | > {r['over_cap_bytes'] / 2**30:.1f} (stopped) | - | - "
                f"| {planner} | - | - |")
    return (f"| {r['cp']} | {r['seq']:,} | {r['run']} | {r['peak_bytes'] / 2**30:.2f} | {r['rise_bytes'] / 2**30:.2f} | "
            f"{r['tensor_rise_bytes'] / 2**30:.2f} | {planner} | {r['step_s']:.2f} | {r['loss']:.4f} |")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--hidden", type=int, default=64)
    parser.add_argument("--lengths", type=int, nargs="+", default=[1024, 2048, 4096])
    parser.add_argument("--chunk", type=int, default=1024, help="loss_chunk_tokens of the chunks and both runs")
    parser.add_argument("--steps", type=int, default=2)
    parser.add_argument("--budget-gib", type=float, default=4.0)
    parser.add_argument("--longest", type=int, default=32768)
    parser.add_argument("--json", default=None, help="write the figures here")
    parser.add_argument("--cps", type=int, nargs="+", default=[1, 2], help="the cp degrees of the table")
    parser.add_argument("--runs", nargs="+", choices=RUNS, default=list(RUNS))
    parser.add_argument("--cap-gib", type=float, default=20.0, help="per rank: a run past it is stopped there")
    parser.add_argument("--no-search", action="store_true", help="the table alone, without the budget's search")
    args = parser.parse_args()
    os.environ["MALLOC_MMAP_THRESHOLD_"] = str(64 * 1024)  # read by glibc when the ranks start
    heads = max(1, args.hidden // 32)
    model_dir = save_tiny_llama(dict(hidden_size=args.hidden, intermediate_size=2 * args.hidden,
                                     num_hidden_layers=args.layers, num_attention_heads=heads,
                                     num_key_value_heads=heads, vocab_size=VOCAB, tie_word_embeddings=False,
                                     max_position_embeddings=2 * args.longest), prefix="long_context_")
    print(f"Llama, {args.layers} blocks, hidden {args.hidden}, vocabulary {VOCAB:,}, float32, batch 1, torch "
          f"{torch.__version__}, {os.cpu_count()} cores, one thread per rank; chunks of {args.chunk} tokens")
    print("| cp | tokens | run | peak GiB / rank | rise in the step GiB | rise in tensors GiB | planner: activations, "
          "host, loss's backward GiB | step s | loss |")
    print("|---|---|---|---|---|---|---|---|---|")
    results = []
    for cp in args.cps:
        for seq in args.lengths:
            for run in args.runs:
                if run == "hf checkpointing" and cp > 1:
                    continue
                r = measure(model_dir, run, cp=cp, seq=seq * cp, chunk=args.chunk, steps=args.steps,
                            cap_gib=args.cap_gib)
                r["planned"] = planned(model_dir, run, cp=cp, seq=seq * cp, chunk=args.chunk)
                results.append(r)
                print(_row(r), flush=True)
    if args.no_search:
        if args.json:
            with open(args.json, "w") as f:
                json.dump({"args": vars(args), "results": results}, f, indent=1)
        return
    budget = args.budget_gib * 2**30
    longest: dict[str, int] = {}
    for run in ("qn_hf", "both"):
        seq, longest[run] = min(args.lengths) * 2, 0
        while seq <= args.longest:
            r = measure(model_dir, run, cp=2, seq=seq, chunk=args.chunk, steps=1, cap_gib=args.cap_gib)
            results.append({**r, "search": True})
            if "over_cap_bytes" in r:
                print(f"cp=2, {seq:,} tokens, {run}: over the cap of {args.cap_gib:g} GiB per rank", flush=True)
                break
            print(f"cp=2, {seq:,} tokens, {run}: peak {r['peak_bytes'] / 2**30:.2f} GiB per rank, step "
                  f"{r['step_s']:.1f} s", flush=True)
            if r["peak_bytes"] > budget:
                break
            longest[run], seq = seq, seq * 2
    print(f"longest sequence within {args.budget_gib:g} GiB per rank at cp=2: qn_hf without the options "
          f"{longest['qn_hf']:,} tokens, with both {longest['both']:,}"
          + (" (the longest tried)" if longest["both"] >= args.longest else "")
          + (f": x{longest['both'] / longest['qn_hf']:.0f}" if longest["qn_hf"] else ""))
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"args": vars(args), "results": results, "longest": longest}, f, indent=1)


if __name__ == "__main__":
    main()
