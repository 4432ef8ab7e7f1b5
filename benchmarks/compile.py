"""Step time with each block compiled (``parallelize(compile=True)``, inductor) against eager, at each
dimension, on CPU, with the graph breaks and recompilations counted.

    python benchmarks/compile.py                                  # the meshes below, one round each
    python benchmarks/compile.py --mesh tp=2 cp=2 --rounds 3
    python benchmarks/compile.py --mesh dp=2,ep=2 pp=2,schedule=zb_h1,microbatches=2

A small Llama (hidden 256, 4 blocks, 8 heads over 4 KV heads, SDPA attention, vocabulary 2,000; with
``ep`` in the mesh a Qwen3-MoE of the same widths, 8 experts, 2 a token), float32, SGD, batches of 4 x 256
tokens per step on every dp rank. Each round of a mesh is a fresh world (``cores // world`` threads a
rank) holding both models, eager and compiled, built from the same weights: they take one step each in
turn on the same batch (alternating which goes first), so a change in the machine's load hits both
alike. ``--warmup`` steps (compilation) are excluded; the step times are medians over ``--steps`` steps
on rank 0, "ratio" the ratio of the medians, "pairwise" the median of the per-step ratios. "breaks" is
the graph breaks dynamo counted in the compiled model's warm-up (each a point where a block's graph is
split: ring attention, the experts' call and ZB-H1's projections run eagerly there, step/compile.py),
"graphs" the graphs it compiled, "recompiled" the graphs compiled after the warm-up (0: every later step
reused them). The losses after the last step show both train the same model.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import tempfile
import time

import torch
from world import run_world

LLAMA = dict(hidden_size=256, intermediate_size=704, num_hidden_layers=4, num_attention_heads=8, num_key_value_heads=4,
             vocab_size=2000, max_position_embeddings=512, bos_token_id=1, eos_token_id=2)
MOE = dict(LLAMA, moe_intermediate_size=176, num_experts=8, num_experts_per_tok=2, head_dim=32)
MESHES = ("tp=1", "tp=2", "dp=2", "cp=2", "dp=2,ep=2", "pp=2,schedule=zb_h1,microbatches=2")


def parse_mesh(text: str) -> dict:
    """``"dp=2,ep=2"`` -> {"dp": 2, "ep": 2}; a value that is no number stays a string (the schedule)."""
    pairs = (part.split("=") for part in text.split(",") if part)
    return {k: int(v) if v.isdigit() else v for k, v in pairs}


def world_of(mesh: dict) -> int:
    return mesh.get("dp", 1) * mesh.get("tp", 1) * mesh.get("pp", 1) * mesh.get("cp", 1)


def _model(path: str, compile: bool, mesh: dict):
    from transformers import AutoModelForCausalLM

    import qn_hf

    pm = qn_hf.parallelize(AutoModelForCausalLM.from_pretrained(path, attn_implementation="sdpa"), compile=compile,
                           seed=0, **mesh)
    return pm, qn_hf.optimizer(pm, torch.optim.SGD, lr=1e-3)


def worker(rank: int, world: int, path: str, mesh: dict, args: argparse.Namespace) -> dict:
    """Both models in this world, one step each in turn, on the same batches."""
    from torch._dynamo.utils import counters

    torch._dynamo.reset()
    counters.clear()
    runs = {c: _model(path, c, mesh) for c in (False, True)}
    gen = torch.Generator().manual_seed(1)
    times: dict[bool, list[float]] = {False: [], True: []}
    losses, counted = {}, {}
    for step in range(args.warmup + args.steps):
        if step == args.warmup:
            counted = {"breaks": sum(counters["graph_break"].values()), "graphs": counters["stats"]["unique_graphs"]}
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
            "warmup": sum(times[True][: args.warmup]), "eager_loss": losses[False], "compiled_loss": losses[True],
            **counted, "recompiled": counters["stats"]["unique_graphs"] - counted["graphs"]}


def _load() -> str:
    return "/".join(f"{x:.1f}" for x in os.getloadavg())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--mesh", nargs="+", default=list(MESHES), help="meshes as dp=2,ep=2 (default: %(default)s)")
    parser.add_argument("--rounds", type=int, default=1)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--rows", type=int, default=4)
    parser.add_argument("--seq", type=int, default=256)
    parser.add_argument("--json", default=None, help="also write the rows here")
    args = parser.parse_args()
    from transformers import AutoConfig, AutoModelForCausalLM

    paths = {}
    for kind, sizes in (("llama", LLAMA), ("qwen3_moe", MOE)):
        paths[kind] = tempfile.mkdtemp(prefix=f"qn_hf_compile_{kind}_")
        torch.manual_seed(0)
        AutoModelForCausalLM.from_config(AutoConfig.for_model(kind, **sizes)).save_pretrained(paths[kind])
    print(f"hidden {LLAMA['hidden_size']}, {LLAMA['num_hidden_layers']} blocks, {args.rows} x {args.seq} tokens a dp "
          f"rank, float32, SGD; {os.cpu_count()} cores; medians of {args.steps} steps each after {args.warmup} warm-up "
          f"steps; load average (1/5/15 min) per round")
    print(f"{'mesh':<36}{'round':>6}{'eager s':>9}{'compiled s':>11}{'ratio':>7}{'pairwise':>9}{'breaks':>7}"
          f"{'graphs':>7}{'recompiled':>11}{'warm-up s':>10}{'eager loss':>11}{'compiled loss':>14}   load")
    rows = []
    for text in args.mesh:
        mesh = parse_mesh(text)
        kind = "qwen3_moe" if mesh.get("ep", 1) > 1 else "llama"
        for round_ in range(args.rounds):
            before = _load()
            r = run_world(worker, world=world_of(mesh), extra=(paths[kind], mesh, args))
            r.update(mesh=text, model=kind, round=round_, ratio=r["compiled"] / r["eager"])
            rows.append(r)
            print(f"{text:<36}{round_:>6}{r['eager']:>9.4f}{r['compiled']:>11.4f}{r['ratio']:>7.3f}{r['pairs']:>9.3f}"
                  f"{r['breaks']:>7}{r['graphs']:>7}{r['recompiled']:>11}{r['warmup']:>10.1f}{r['eager_loss']:>11.6f}"
                  f"{r['compiled_loss']:>14.6f}   {before} -> {_load()}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"cores": os.cpu_count(), "torch": torch.__version__, "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
