"""Step time with each block compiled (``parallelize(compile=True)``, inductor) against eager, on CPU.

    python benchmarks/compile.py                    # tp=1 (one process, all cores) and tp=2 (2 processes)
    python benchmarks/compile.py --tp 2 --rounds 3 --recompute selective
    python benchmarks/compile.py --no-rng-hooks     # diagnostic: what the random streams' graph breaks cost

A small Llama (hidden 256, 4 blocks, 8 heads over 4 KV heads, SDPA attention, vocabulary 2,000), float32,
SGD, batches of 4 x 256 tokens per step. Each round is a fresh world of ``tp`` ranks (``cores // tp`` threads
each) holding both models, eager and compiled, built from the same weights: they take one step each in turn
on the same batch (alternating which goes first), so a change in the machine's load hits both alike.
``--warmup`` steps (compilation, and any recompilation) are excluded; the step times reported are medians
over ``--steps`` steps on rank 0 (every step ends in a collective, so the ranks agree), "ratio" the ratio of
the medians, "pairwise" the median of the per-step ratios; with the load average before and after each
round. The losses after the last step are printed to show both train the same model.

``--no-rng-hooks`` removes the random streams' hooks (rng.py) before compiling, so that no graph break splits
a block: a diagnostic of what those breaks cost, valid only for models without dropout (dropout in the tp
regions would then draw from the wrong stream); it is not something qn_hf offers.
"""

from __future__ import annotations

import argparse
import inspect
import os
import statistics
import tempfile
import time

import torch
from world import run_world

LLAMA = dict(hidden_size=256, intermediate_size=704, num_hidden_layers=4, num_attention_heads=8, num_key_value_heads=4,
             vocab_size=2000, max_position_embeddings=512, bos_token_id=1, eos_token_id=2)


def _parallelize(model, *, compile: bool, **kwargs):
    import qn_hf

    if "compile" in inspect.signature(qn_hf.parallelize).parameters:
        return qn_hf.parallelize(model, compile=compile, **kwargs)
    from qn_hf.step.compile import apply_compile

    pm = qn_hf.parallelize(model, **kwargs)  # until parallelize takes compile=: the same pass, by hand
    if compile:
        apply_compile(pm.module, layers=pm.stage.plan.layers)
    return pm


def _drop_rng_hooks(pm) -> int:
    """Remove the random streams' region hooks (the diagnostic of ``--no-rng-hooks``); return how many."""
    removed = 0
    for name in (*pm.plan.tp_rng_regions, *pm.plan.shared_rng_regions):
        module = pm.module.get_submodule(name)
        for hooks in (module._forward_pre_hooks, module._forward_hooks):
            for key in [k for k, h in hooks.items() if "RngStreams.hook_module" in getattr(h, "__qualname__", "")]:
                del hooks[key]
                removed += 1
    return removed


def _model(path: str, compile: bool, world: int, args: argparse.Namespace):
    from transformers import LlamaForCausalLM

    import qn_hf

    pm = _parallelize(LlamaForCausalLM.from_pretrained(path, attn_implementation="sdpa"), compile=compile, tp=world,
                      seed=0, recompute=args.recompute, sequence_parallel=args.sequence_parallel)
    if args.no_rng_hooks:
        _drop_rng_hooks(pm)
    return pm, qn_hf.optimizer(pm, torch.optim.SGD, lr=1e-3)


def worker(rank: int, world: int, path: str, args: argparse.Namespace) -> dict:
    """Both models in this world, one step each in turn, on the same batches."""
    runs = {c: _model(path, c, world, args) for c in (False, True)}
    gen = torch.Generator().manual_seed(1)
    times: dict[bool, list[float]] = {False: [], True: []}
    losses = {}
    for step in range(args.warmup + args.steps):
        ids = torch.randint(3, LLAMA["vocab_size"], (args.rows, args.seq), generator=gen)
        for c in ((False, True) if step % 2 == 0 else (True, False)):  # alternate which goes first
            pm, opt = runs[c]
            start = time.perf_counter()
            opt.zero_grad()
            losses[c] = pm.train_step({"input_ids": ids, "labels": ids}).item()
            opt.step()
            times[c].append(time.perf_counter() - start)
    timed = {c: t[args.warmup :] for c, t in times.items()}
    return {"eager": statistics.median(timed[False]), "compiled": statistics.median(timed[True]),
            "pairs": statistics.median(b / a for a, b in zip(timed[False], timed[True])),
            "warmup": sum(times[True][: args.warmup]), "eager_loss": losses[False], "compiled_loss": losses[True]}


def _load() -> str:
    return "/".join(f"{x:.1f}" for x in os.getloadavg())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tp", type=int, nargs="+", default=[1, 2])
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--rows", type=int, default=4)
    parser.add_argument("--seq", type=int, default=256)
    parser.add_argument("--recompute", choices=["full", "selective"], default=None)
    parser.add_argument("--sequence-parallel", action="store_true")
    parser.add_argument("--no-rng-hooks", action="store_true")
    args = parser.parse_args()
    from transformers import LlamaConfig, LlamaForCausalLM

    path = tempfile.mkdtemp(prefix="qn_hf_compile_")
    torch.manual_seed(0)
    LlamaForCausalLM(LlamaConfig(**LLAMA)).save_pretrained(path)
    print(f"Llama hidden {LLAMA['hidden_size']}, {LLAMA['num_hidden_layers']} blocks, {args.rows} x {args.seq} tokens, "
          f"float32, SGD; recompute={args.recompute}, sequence_parallel={args.sequence_parallel}, "
          f"rng hooks {'removed' if args.no_rng_hooks else 'kept'}; {os.cpu_count()} cores; medians of {args.steps} "
          f"steps each after {args.warmup} warm-up steps; load average (1/5/15 min) per round")
    print(f"{'tp':>3}{'round':>6}{'eager s':>10}{'compiled s':>12}{'ratio':>8}{'pairwise':>10}{'warm-up s':>11}"
          f"{'eager loss':>12}{'compiled loss':>15}   load before -> after")
    for tp in args.tp:
        ratios = []
        for round_ in range(args.rounds):
            before = _load()
            r = run_world(worker, world=tp, extra=(path, args))
            ratios.append(r["compiled"] / r["eager"])
            print(f"{tp:>3}{round_:>6}{r['eager']:>10.4f}{r['compiled']:>12.4f}{ratios[-1]:>8.3f}{r['pairs']:>10.3f}"
                  f"{r['warmup']:>11.1f}{r['eager_loss']:>12.6f}{r['compiled_loss']:>15.6f}   {before} -> {_load()}")
        print(f"{tp:>3}{'all':>6}{'':>22}{statistics.median(ratios):>8.3f}   median compiled/eager over "
              f"{args.rounds} rounds")


if __name__ == "__main__":
    main()
