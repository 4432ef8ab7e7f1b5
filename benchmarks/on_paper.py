"""Published H100 training runs beside the planner's prediction for the same configuration, on paper
(issue 48 item 3; docs/planner-on-paper.md reads this script's output).

    python benchmarks/on_paper.py [--only llama8 llama64 mixtral mixtral_auto] [--json results/on_paper.json]

No GPU and no download: each model is built on the meta device from a transformers config class with
the published shapes (Llama-3.1-8B, a Mixtral-8x7B-shaped model), ``Planner.estimate`` gives the
per-rank memory and ``cost.step_time`` the step at ``Hardware()``'s stated H100 figures (no H100
calibration exists yet, so every timing figure is assumed: ``StepTime.assumed`` names them), and
``auto_plan`` the configuration it would choose at the same global batch on 80 GiB devices.

Sections: "llama8", torchtitan's FSDP run of Llama-3.1-8B on 8 H100s (and the same at full
recomputation, which brackets torchtitan's own selective policy); "llama64", the same model on 64
H100s, FSDP at 64 and at 128 (torchtitan published 128, not 64) and auto's choice; "mixtral", NeMo's
H100 recipe mesh for Mixtral-8x7B against Megatron-Core's published bf16 throughput; "mixtral_auto"
(not run by default: 6 to 10 minutes), auto's choice for that shape. Each prints a markdown table;
``--json`` writes every figure. The default sections take about 1.5 minutes on a 2-core machine,
most of it the two Llama auto searches.

Model FLOPs per token are counted as torchtitan and Megatron-LM count them, 6 x (active parameters
less the input embedding) + 12 x layers x hidden x seq_len; qn_hf's ``flops_per_step`` also counts
the input embedding at 6 FLOPs per parameter (its ``StepTime.utilization`` inherits that).
"""

from __future__ import annotations

import argparse
import json
import os
import time
from dataclasses import asdict

import torch
from transformers import LlamaConfig, MixtralConfig

from qn_hf.config.parallel_config import ParallelConfig
from qn_hf.planner.auto import auto_plan, describe
from qn_hf.planner.cost import GIB, Hardware, links, machine, step_time
from qn_hf.planner.estimate import Planner
from qn_hf.planner.results import MeshEstimate

H100 = Hardware()  # 80 GiB, 8 per node, 400 TFLOP/s, NVLink 450 GB/s, IB 50 GB/s per GPU: all stated, not measured
H100_BF16_PEAK = 989.5  # dense bf16 TFLOP/s of an H100 SXM5 (NVIDIA's datasheet, without sparsity)

TORCHTITAN = "https://github.com/pytorch/torchtitan/blob/main/benchmarks/llama3_h100_202412_torchtitan.md"
MCORE_MOE = "https://github.com/NVIDIA/Megatron-LM/blob/main/megatron/core/transformer/moe/README.md"
NEMO_H100 = ("https://github.com/NVIDIA/NeMo/blob/main/scripts/performance/recommended_model_configs/"
             "model_configs_h100.csv")


def llama_3_1_8b() -> LlamaConfig:
    """Meta's published shape (the HF config.json of meta-llama/Llama-3.1-8B, rope scaling aside)."""
    return LlamaConfig(hidden_size=4096, num_hidden_layers=32, num_attention_heads=32, num_key_value_heads=8,
                       intermediate_size=14336, vocab_size=128256, tie_word_embeddings=False, rope_theta=500000.0,
                       max_position_embeddings=131072, architectures=["LlamaForCausalLM"])


def mixtral_8x7b() -> MixtralConfig:
    """mistralai/Mixtral-8x7B-v0.1's shape. ``architectures`` names the causal LM: without it the
    planner would build the base model (no head, no loss)."""
    return MixtralConfig(hidden_size=4096, num_hidden_layers=32, num_attention_heads=32, num_key_value_heads=8,
                         intermediate_size=14336, num_local_experts=8, num_experts_per_tok=2, vocab_size=32000,
                         tie_word_embeddings=False, rope_theta=1e6, max_position_embeddings=32768,
                         output_router_logits=False, architectures=["MixtralForCausalLM"])


def model_flops_per_token(est: MeshEstimate, config) -> float:
    """torchtitan's and Megatron's count: qn_hf's per-token FLOPs less the input embedding's 6 x V x h
    (a lookup; Megatron also leaves out the router, 6 x layers x h x E, under 0.01% here)."""
    tokens = est.tokens_per_microbatch * est.microbatches * est.dp
    return est.flops_per_step / tokens - 6 * config.vocab_size * config.hidden_size


def prediction(est: MeshEstimate, config, *, hw: Hardware = H100) -> dict:
    """Memory of the fullest rank and the step's parts at ``hw``'s figures."""
    st = step_time(est, hw)
    s = max(est.stages, key=lambda s: s.total_bytes)
    world = est.world_size
    per_gpu = st.tokens_per_s / world
    tflops = per_gpu * model_flops_per_token(est, config) / 1e12
    degrees = {"dp_shard": est.dp_shard, "ep": est.ep, "pp": est.pp}
    return {"config": describe(est.parallel, est.micro_batch_size), "world": world, "zero": est.zero,
            "global_batch": est.global_batch, "seq_len": est.seq_len, "total_params": est.total_params,
            "peak_gib": s.total_bytes / GIB, "weights_gib": s.weight_bytes / GIB, "grads_gib": s.grad_bytes / GIB,
            "optimizer_gib": s.optimizer_bytes / GIB, "activations_gib": s.activation_bytes / GIB,
            "unsharded_gib": s.unsharded_bytes / GIB, "step_s": st.seconds, "tokens_per_s_per_gpu": per_gpu,
            "model_tflops_per_gpu": tflops, "mfu_of_sxm_peak": tflops / H100_BF16_PEAK,
            "planner_utilization": st.utilization, "bubble": est.bubble,
            "parts_s": {p: getattr(st, p) for p in ("compute", "tp", "pp", "dp", "cp", "ep", "optimizer")},
            "traffic_gb": {g: t.nbytes / 1e9 for g, t in s.comm.items() if t.nbytes >= 1e6},
            "links": {g: kind for g, kind in links(est, hw).items() if degrees.get(g, 1) > 1},
            "assumed": list(st.assumed)}


def implied_tflops(est: MeshEstimate, tokens_per_gpu: float) -> float:
    """The matmul rate (TFLOP/s, every other stated figure kept) at which the planner predicts the
    published tokens/s per GPU: bisection, the predicted step falling as the rate rises."""
    lo, hi = 10.0, 10000.0
    for _ in range(60):
        mid = (lo * hi) ** 0.5
        got = step_time(est, Hardware(tflops=mid)).tokens_per_s / est.world_size
        lo, hi = (mid, hi) if got < tokens_per_gpu else (lo, mid)
    return (lo * hi) ** 0.5


def auto(config, *, global_batch: int, seq_len: int, world: int) -> dict:
    """``auto_plan`` on ``world`` devices of 80 GiB, bf16 mixed precision kept (as the published runs)."""
    t = time.perf_counter()
    choice = auto_plan(config, global_batch=global_batch, seq_len=seq_len, world_size=world, device_memory=80 * GIB,
                       fixed={"mixed_precision": "bf16"}, gpus_per_node=H100.gpus_per_node)
    chosen = prediction(choice.feasible[0].estimate, config)
    runner = choice.runner_up
    return {**chosen, "search_s": time.perf_counter() - t, "feasible": len(choice.feasible), "unpriced": choice.unpriced,
            "runner_up": None if runner is None else describe(runner.estimate.parallel, runner.estimate.micro_batch_size),
            "runner_up_tokens_per_s_per_gpu": None if runner is None else runner.time.tokens_per_s / world,
            "why": choice.why}


def fsdp(planner: Planner, config, *, world: int, recompute: str = "selective") -> tuple[MeshEstimate, dict]:
    """torchtitan's 1D FSDP: every rank one data-parallel shard, one microbatch, bf16 compute over
    float32 shards (FSDP2's MixedPrecisionPolicy(param_dtype=bf16, reduce_dtype=fp32))."""
    est = planner.estimate(ParallelConfig.from_keywords(dp=world, dp_shard=world, microbatches=1,
                                                        mixed_precision="bf16", recompute=recompute))
    return est, prediction(est, config)


def llama8() -> dict:
    """torchtitan Table 1, first row: FSDP on 8 H100s, local batch 2, seq 8192, selective AC, bf16."""
    config = llama_3_1_8b()
    planner = Planner(config, seq_len=8192, micro_batch_size=2, dtype=torch.float32)
    est, selective = fsdp(planner, config, world=8)
    _, full = fsdp(planner, config, world=8, recompute="full")
    published = {"tokens_per_s_per_gpu": 5762, "memory_gib": 82.4, "source": TORCHTITAN,
                 "table": "Table 1, FSDP (no torch.compile, no Float8)"}
    published["model_tflops_per_gpu"] = 5762 * model_flops_per_token(est, config) / 1e12
    return {"published": published, "selective": selective, "full": full,
            "implied_tflops": implied_tflops(est, published["tokens_per_s_per_gpu"]),
            "auto": auto(config, global_batch=16, seq_len=8192, world=8)}


def llama64() -> dict:
    """The same model over 8 nodes: FSDP at 64 (nothing published) and 128 (torchtitan Table 3)."""
    config = llama_3_1_8b()
    planner = Planner(config, seq_len=8192, micro_batch_size=2, dtype=torch.float32)
    _, at64 = fsdp(planner, config, world=64)
    est128, at128 = fsdp(planner, config, world=128)
    published128 = {"tokens_per_s_per_gpu": 5605, "memory_gib": 67.0, "source": TORCHTITAN,
                    "table": "Table 3, FSDP on 128 GPUs (no torch.compile, no Float8)"}
    published128["model_tflops_per_gpu"] = 5605 * model_flops_per_token(est128, config) / 1e12
    return {"fsdp64": at64, "fsdp128": at128, "published128": published128,
            "implied_tflops128": implied_tflops(est128, published128["tokens_per_s_per_gpu"]),
            "auto": auto(config, global_batch=128, seq_len=8192, world=64)}


def mixtral() -> dict:
    """Megatron-Core MoE's bf16 Mixtral-8x7B throughput beside NeMo's H100 bf16 recipe mesh: 64 GPUs,
    seq 4096, tp 1, pp 4, virtual pipeline 8, ep 8, micro-batch 1, global batch 256, no recomputation,
    the distributed optimizer (ZeRO-1 here)."""
    config = mixtral_8x7b()
    planner = Planner(config, seq_len=4096, micro_batch_size=1, dtype=torch.float32)
    mesh = ParallelConfig.from_keywords(dp=16, tp=1, pp=4, ep=8, microbatches=16, schedule="interleaved_1f1b",
                                        virtual_stages=8, mixed_precision="bf16")
    est = planner.estimate(mesh, zero=True)
    flops = model_flops_per_token(est, config)
    published = {"model_tflops_per_gpu": 468.0, "source": MCORE_MOE, "mesh_source": NEMO_H100,
                 "tokens_per_s_per_gpu": 468e12 / flops}
    return {"published": published, "nemo_mesh": prediction(est, config), "model_flops_per_token": flops,
            "implied_tflops": implied_tflops(est, published["tokens_per_s_per_gpu"])}


def mixtral_auto() -> dict:
    """What ``auto_plan`` chooses for the Mixtral run's shape (64 GPUs of 80 GiB, 256 x 4096): about
    6 to 10 minutes on a 2-core machine (every ep and its dispatch traced), so not run by default."""
    return {"auto": auto(mixtral_8x7b(), global_batch=256, seq_len=4096, world=64)}


SECTIONS = {"llama8": llama8, "llama64": llama64, "mixtral": mixtral, "mixtral_auto": mixtral_auto}
DEFAULT = ("llama8", "llama64", "mixtral")


def row(name: str, p: dict) -> str:
    parts = ", ".join(f"{k} {v * 1e3:.0f}" for k, v in p["parts_s"].items() if v >= 5e-4)
    return (f"| {name} | {p['config']} | {p['peak_gib']:.1f} | {p['activations_gib']:.1f} | {p['step_s'] * 1e3:,.0f} "
            f"| {parts} | {p['tokens_per_s_per_gpu']:,.0f} | {p['model_tflops_per_gpu']:.0f} |")


def report(results: dict) -> str:
    head = ("| run | configuration | peak GiB/GPU | of which activations | step ms | parts ms | tokens/s/GPU "
            "| model TFLOP/s/GPU |\n|---|---|---|---|---|---|---|---|")
    lines = []
    if "llama8" in results:
        r = results["llama8"]
        pub = r["published"]
        lines += ["## Llama-3.1-8B, FSDP on 8 H100s, local batch 2 x 8192, bf16", "", head,
                  f"| torchtitan (published) | FSDP 8, selective op AC | {pub['memory_gib']} (reserved) | | "
                  f"| | {pub['tokens_per_s_per_gpu']:,} | {pub['model_tflops_per_gpu']:.0f} |",
                  row("planner, selective", r["selective"]), row("planner, full", r["full"]),
                  row("auto (80 GiB)", r["auto"]), "",
                  f"implied matmul rate for the published throughput: {r['implied_tflops']:.0f} TFLOP/s; "
                  f"auto: {r['auto']['feasible']} feasible, runner-up {r['auto']['runner_up']} ({r['auto']['why']}), "
                  f"searched in {r['auto']['search_s']:.0f} s", ""]
    if "llama64" in results:
        r = results["llama64"]
        pub = r["published128"]
        lines += ["## Llama-3.1-8B on 64 (and 128) H100s, local batch 2 x 8192, bf16", "", head,
                  row("planner, FSDP 64", r["fsdp64"]), row("auto, 64 (80 GiB)", r["auto"]),
                  f"| torchtitan, 128 (published) | FSDP 128, selective op AC | {pub['memory_gib']} (reserved) | | "
                  f"| | {pub['tokens_per_s_per_gpu']:,} | {pub['model_tflops_per_gpu']:.0f} |", row("planner, FSDP 128", r["fsdp128"]),
                  "",
                  f"implied matmul rate for torchtitan's 128-GPU throughput: {r['implied_tflops128']:.0f} TFLOP/s; "
                  f"auto at 64: {r['auto']['feasible']} feasible, runner-up {r['auto']['runner_up']} "
                  f"({r['auto']['why']}), searched in {r['auto']['search_s']:.0f} s", ""]
    if "mixtral" in results:
        r = results["mixtral"]
        pub = r["published"]
        p = r["nemo_mesh"]
        lines += ["## Mixtral-8x7B on 64 H100s, global batch 256 x 4096, bf16", "", head,
                  f"| Megatron-Core MoE (published) | mesh not stated | | | | | {pub['tokens_per_s_per_gpu']:,.0f} "
                  f"(from TFLOP/s) | {pub['model_tflops_per_gpu']:.0f} |",
                  row("planner, NeMo H100 mesh, ZeRO-1", p), "",
                  f"model FLOPs per token {r['model_flops_per_token'] / 1e9:.1f} G; links {p['links']}; bubble "
                  f"{p['bubble']:.3f}; implied matmul rate for the published throughput: {r['implied_tflops']:.0f} "
                  f"TFLOP/s", ""]
    if "mixtral_auto" in results:
        r = results["mixtral_auto"]["auto"]
        lines += ["## Mixtral-8x7B, auto's choice on 64 H100s (80 GiB), 256 x 4096, bf16", "", head,
                  row("auto (80 GiB)", r), "",
                  f"{r['feasible']} feasible, runner-up {r['runner_up']} ({r['why']}), searched in "
                  f"{r['search_s']:.0f} s", ""]
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--only", nargs="+", choices=list(SECTIONS), default=list(DEFAULT),
                        help="sections to run (default: %(default)s; mixtral_auto takes 6 to 10 minutes)")
    parser.add_argument("--json", help="write every figure to this file")
    args = parser.parse_args()
    torch.set_num_threads(1)
    results = {name: SECTIONS[name]() for name in args.only}
    print(report(results))
    assumed = machine(H100, None, world_size=8).assumed
    print(f"Every timing figure is assumed, not measured (no H100 calibration): {', '.join(assumed)}; "
          f"stated figures {asdict(H100)}")
    if args.json:
        os.makedirs(os.path.dirname(os.path.abspath(args.json)), exist_ok=True)
        with open(args.json, "w") as f:
            json.dump({"hardware": asdict(H100), "assumed": list(assumed), **results}, f, indent=1)


if __name__ == "__main__":
    main()
