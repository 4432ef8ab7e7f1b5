"""How long ``auto_plan`` searches, and whether a change to the planner changed any answer.

    python benchmarks/planner_speed.py --json new.json                 # every case: time, choice, ranked list
    python benchmarks/planner_speed.py --json old.json --cases llama-8 # some cases (names below)
    python benchmarks/planner_speed.py --compare old.json new.json     # every candidate the same?
    python benchmarks/planner_speed.py --json all.json --exhaustive    # every candidate priced

To compare two versions of the planner, run the first with the other checkout on ``PYTHONPATH`` (a
``git worktree add /tmp/old <commit>``), then this one, and ``--compare``: every feasible candidate's
configuration, micro-batch size, predicted time and peak, the choice, the runner-up's reason and the
no-fit message must be identical (the speed-ups of docs/auto.md were checked so). A search that left
shapes unpriced (the default; ``--exhaustive`` prices all) is compared on what it must agree on with
one that did not: the choice, the runner-up's reason, the no-fit message, and every candidate ranked
up to the runner-up (those no faster than it, in order). The cases are small
(8 to 64 GPUs, dense and MoE, mixed layer kinds, one where nothing fits) so that an old, slow planner
answers them too; ``qn-hf-plan benchmarks/configs/<model> --gpus 1024 ... --auto`` times the large ones.
"""

from __future__ import annotations

import argparse
import json
import sys
import time

from transformers import Gemma3TextConfig, LlamaConfig, MixtralConfig, Qwen3MoeConfig

from qn_hf.planner.auto import auto_plan

GIB = 2**30


def cases():
    llama = LlamaConfig(hidden_size=1024, intermediate_size=2816, num_hidden_layers=8, num_attention_heads=16,
                        num_key_value_heads=4, vocab_size=32000)
    deep = LlamaConfig(hidden_size=1024, intermediate_size=2816, num_hidden_layers=16, num_attention_heads=16,
                       num_key_value_heads=8, vocab_size=32000)
    mixtral = MixtralConfig(hidden_size=512, intermediate_size=1024, num_hidden_layers=4, num_attention_heads=8,
                            num_key_value_heads=4, num_local_experts=4, num_experts_per_tok=2, vocab_size=8000)
    deep_moe = MixtralConfig(hidden_size=512, intermediate_size=1024, num_hidden_layers=10, num_attention_heads=8,
                             num_key_value_heads=4, num_local_experts=8, num_experts_per_tok=2, vocab_size=8000)
    qwen = Qwen3MoeConfig(hidden_size=512, intermediate_size=1024, moe_intermediate_size=256, num_hidden_layers=4,
                          num_attention_heads=8, num_key_value_heads=4, head_dim=64, num_experts=8,
                          num_experts_per_tok=2, vocab_size=8000)
    gemma = Gemma3TextConfig(hidden_size=512, intermediate_size=1024, num_hidden_layers=12, num_attention_heads=8,
                             num_key_value_heads=4, head_dim=64, vocab_size=16000, sliding_window=512)
    bf16 = {"mixed_precision": "bf16"}
    return {
        "llama-nofit": (llama, dict(global_batch=16, seq_len=2048, world_size=8, device_memory=GIB // 16)),
        "llama-8": (llama, dict(global_batch=16, seq_len=2048, world_size=8, device_memory=4 * GIB)),
        "llama-16": (llama, dict(global_batch=32, seq_len=4096, world_size=16, device_memory=3 * GIB, fixed=bf16)),
        "llama-32": (llama, dict(global_batch=64, seq_len=1024, world_size=32, device_memory=GIB, fixed=bf16)),
        "deep-64": (deep, dict(global_batch=256, seq_len=2048, world_size=64, device_memory=GIB, fixed=bf16)),
        "deep-32-fp32": (deep, dict(global_batch=128, seq_len=4096, world_size=32, device_memory=2 * GIB)),
        "mixtral-16": (mixtral, dict(global_batch=32, seq_len=1024, world_size=16, device_memory=GIB // 2)),
        "mixtral-64": (mixtral, dict(global_batch=128, seq_len=2048, world_size=64, device_memory=GIB // 2,
                                     fixed=bf16)),
        "deep-moe-32": (deep_moe, dict(global_batch=64, seq_len=2048, world_size=32, device_memory=GIB // 2,
                                       fixed=bf16)),
        "qwen-16": (qwen, dict(global_batch=16, seq_len=2048, world_size=16, device_memory=GIB, fixed=bf16)),
        "gemma-32": (gemma, dict(global_batch=64, seq_len=2048, world_size=32, device_memory=GIB // 2, fixed=bf16)),
    }


def run(names: list[str], *, exhaustive: bool) -> dict:
    out = {}
    for name, (config, keywords) in cases().items():
        if names and name not in names:
            continue
        start = time.perf_counter()
        try:
            choice = auto_plan(config, **keywords, exhaustive=exhaustive)
            answer = {"chosen": [choice.config.keywords(), choice.micro_batch_size], "why": choice.why,
                      "ranked": [[c.estimate.parallel.keywords(), c.estimate.micro_batch_size, c.time.seconds,
                                  c.peak_bytes] for c in choice.feasible], "exhaustive": exhaustive}
        except ValueError as e:
            answer = {"error": str(e)}
        answer["seconds"] = round(time.perf_counter() - start, 1)
        out[name] = answer
        print(f"{name}: {answer['seconds']} s, "
              + (f"{len(answer['ranked'])} feasible" if "ranked" in answer else "nothing fits"), flush=True)
    return out


def compare(old: dict, new: dict) -> int:
    """The cases both ran whose answers differ (timings aside), printed."""
    differ = 0
    for name in sorted(old.keys() & new.keys()):
        a, b = ({k: v for k, v in x[name].items() if k not in ("seconds", "exhaustive")} for x in (old, new))
        if "ranked" in a and "ranked" in b and not (old[name].get("exhaustive", True) and new[name]["exhaustive"]):
            a["ranked"], b["ranked"] = _to_runner_up(a["ranked"]), _to_runner_up(b["ranked"])
        if a != b:
            differ += 1
            print(f"{name}: different")
    print(f"{len(old.keys() & new.keys())} cases compared, {differ} different")
    return differ


def _to_runner_up(ranked: list) -> list:
    """The candidates ranked up to the runner-up (its time or less): what a search leaving shapes
    unpriced must agree on with one pricing all."""
    return ranked[:2] + [r for r in ranked[2:] if r[2] <= ranked[1][2]] if len(ranked) > 1 else ranked


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", help="write every case's answer and time here")
    parser.add_argument("--cases", nargs="*", default=[], help=f"some of: {', '.join(cases())}")
    parser.add_argument("--compare", nargs=2, metavar=("OLD", "NEW"))
    parser.add_argument("--exhaustive", action="store_true", help="price every candidate (auto_plan's exhaustive)")
    args = parser.parse_args()
    if args.compare:
        with open(args.compare[0]) as f, open(args.compare[1]) as g:
            sys.exit(1 if compare(json.load(f), json.load(g)) else 0)
    out = run(args.cases, exhaustive=args.exhaustive)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(out, f, default=str)


if __name__ == "__main__":
    main()
