"""``make gpu-check``: what qn_hf does on this machine's GPUs, in about five minutes, as one table.

Each section (gpu_checks/) runs in processes of its own (spawned; NCCL on CUDA, gloo on the CPU) with qn_hf
imported from this checkout; nothing is installed or downloaded. On one GPU (docs/gpu-check.md says more):

* speed: a 0.9B-parameter Llama (hidden 2048, 16 blocks, 16 heads over 8 KV heads, vocabulary 32000) at tp=1 on
  4 rows of 2048 tokens: qn_hf (``mixed_precision="bf16"``: bf16 weights, float32 masters in ``qn_hf.optimizer``)
  against the plain model as a user trains it (float32 weights under ``torch.autocast(bfloat16)``), both with
  torch's fused AdamW: tokens/s, their ratio, MFU and peak memory; the four runs' first losses must agree;
* compile: the same with every block compiled (``parallelize(compile=True)``; the plain model's blocks with
  ``block.compile()``, as torchtitan does), with dynamo's graph breaks and graphs per side; a graph break that
  qn_hf's own hooks cause fails;
* host syncs: the host's waits for the GPU in one steady step (zero_grad, forward and backward, clip, step), each
  charged to its Python site by CUDA's sync debug mode, batch on the host or the device, with and without an
  attention mask, for qn_hf and for the plain model;
* ring kernels: context parallelism's per-block attention kernels and log-sum-exp merge, forward and backward, on a
  simulated cp=2 and cp=4 ring in one process, against float32 attention of the whole sequence (causal, packed
  documents with padding, a sliding window) in bf16, fp16 and fp32;
* dp_shard: qn_hf's FSDP2 groups on a one-rank mesh against the plain model (``parallelize`` takes dp_shard > 1
  only with dp >= 2 ranks);
* long: offload's CUDA path and the loss in chunks against the plain model, the device's peak at a long sequence
  through a 128k vocabulary with each beside the planner's, and the host copies' bandwidth;
* parity: one SGD step of a tiny Llama at every mesh that fits the GPUs (NCCL) against the plain model.

Without a GPU each section runs small on gloo worlds of at most ``--cpu-world`` processes (CPU kernels, syncs
counted by dispatch), so that the test suite keeps this script working. One ``GPU_CHECK_JSON {...}`` line per
row as it is measured, the table at the end, then what this machine could not test. Exit status 0 when every
case that ran is equal or within its tolerance, 1 otherwise.

    python scripts/gpu_check.py [--quick] [--json FILE] [--budget SECONDS] [--sections speed,compile,...]
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
# qn_hf from this checkout, installed or not (the spawned ranks get this sys.path; main() puts the root on
# PYTHONPATH too, for whatever they start in turn), and the sections, gpu_checks/
sys.path[:0] = [str(ROOT), str(ROOT / "scripts")]

import argparse  # noqa: E402
import collections  # noqa: E402
import copy  # noqa: E402
import datetime  # noqa: E402
import json  # noqa: E402
import queue  # noqa: E402
import socket  # noqa: E402
import time  # noqa: E402
import traceback  # noqa: E402
from collections.abc import Callable  # noqa: E402
from dataclasses import dataclass, field  # noqa: E402

import torch  # noqa: E402
import torch.multiprocessing as mp  # noqa: E402
from gpu_checks import checkpoints, long_context, ring, sharded, speed, syncs  # noqa: E402
from gpu_checks.common import LOSS_RTOL, WEIGHT_ATOL, row  # noqa: E402
from gpu_checks.common import device as this_device  # noqa: E402

FAILING = {"different", "failed", "error"}


@dataclass(frozen=True)
class Case:
    name: str
    procs: int
    mesh: dict = field(default_factory=dict)
    model: str = "llama"


CASES = [
    Case("plain mesh (1 process)", 1),
    Case("tp=2", 2, dict(tp=2)),
    Case("tp=2 + sequence parallel", 2, dict(tp=2, sequence_parallel=True)),
    Case("dp=2", 2, dict(dp=2)),
    Case("pp=2 1f1b", 2, dict(pp=2, microbatches=4)),
    Case("pp=2 interleaved V=2", 2, dict(pp=2, schedule="interleaved_1f1b", virtual_stages=2, microbatches=2)),
    Case("pp=2 zb_h1", 2, dict(pp=2, schedule="zb_h1", microbatches=4)),
    Case("cp=2 (ring attention)", 2, dict(cp=2)),
    Case("dp=2 ep=2 (MoE)", 2, dict(dp=2, ep=2), model="qwen3_moe"),
    Case("dp=2 x tp=2", 4, dict(dp=2, tp=2)),
    Case("tp=2 x pp=2", 4, dict(tp=2, pp=2, microbatches=4)),
    Case("dp=2 x tp=2 x pp=2", 8, dict(dp=2, tp=2, pp=2, microbatches=4)),
]
QUICK = {"plain mesh (1 process)", "tp=2", "cp=2 (ring attention)"}

# What one GPU cannot tell: everything that needs two ranks to talk over NCCL.
NOT_ON_ONE_GPU = [
    "tp and sequence parallelism: NCCL all-reduce / all-gather / reduce-scatter inside the blocks, their cost and "
    "overlap",
    "pp: NCCL point-to-point between stages under every schedule (1f1b, gpipe, interleaved, zb_h1), and the "
    "pipeline's first-use warm-up (NCCL's communicators for send/recv made at the first transfer)",
    "dp and ZeRO-1: the gradient buckets' all-reduce / reduce-scatter overlapping backward, the weights' all-gather",
    "dp_shard at >= 2 ranks: FSDP2's real all-gathers, reduce-scatters and prefetching (one rank only runs its hooks "
    "and dtypes)",
    "cp: ring attention's point-to-point transfers and their overlap with the kernels (the kernels and merges are "
    "checked in one process)",
    "ep: the all-to-all token exchange of expert parallelism",
    "throughput and memory at more than one GPU; NCCL timeouts and the failure handling around them",
]
NOT_ON_CPU = [
    "everything CUDA: the kernels run are the CPU's (math / CPU flash), tokens/s and memory mean nothing for a GPU",
    "host syncs: CUDA's sync debug mode needs a GPU; the CPU run counts the aten ops that would sync "
    "(benchmarks/host_syncs.py), which cannot see device<->host copies",
    "NCCL: gloo stands in for every collective",
]


def tiny_config(model: str):
    from transformers import AutoConfig

    common = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=4, num_attention_heads=4,
                  num_key_value_heads=2, head_dim=16, vocab_size=128, max_position_embeddings=64,
                  bos_token_id=1, eos_token_id=2, pad_token_id=0)
    if model == "qwen3_moe":
        return AutoConfig.for_model("qwen3_moe", **common, num_experts=4, num_experts_per_tok=2,
                                    moe_intermediate_size=32, decoder_sparse_step=1, mlp_only_layers=[])
    return AutoConfig.for_model("llama", **common)


def _parity(case: Case, *, quick: bool) -> list[dict]:
    """One rank of a parity case; rank 0's rows are the case's."""
    from transformers import AutoModelForCausalLM

    import qn_hf

    device = this_device()
    torch.backends.cuda.matmul.allow_tf32 = False  # float32 parity: no TF32 rounding on either side
    torch.backends.cudnn.allow_tf32 = False
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(tiny_config(case.model)).float()
    ref = copy.deepcopy(model).to(device)
    mesh = {"microbatches": 2, **case.mesh}
    pm = qn_hf.parallelize(model, device=device, **mesh)
    dp = mesh.get("dp", 1)
    gen = torch.Generator().manual_seed(1)
    ids = torch.randint(3, 128, (2 * dp * mesh["microbatches"], 32), generator=gen)
    rows = ids.shape[0] // dp
    local = ids[pm.coords["dp"] * rows : (pm.coords["dp"] + 1) * rows]
    loss = pm.train_step({"input_ids": local, "labels": local})
    ref_loss = ref(input_ids=ids.to(device), labels=ids.to(device), use_cache=False).loss
    ref_loss.backward()
    opts = [torch.optim.SGD(list(pm.parameters()), lr=1.0), torch.optim.SGD(list(ref.parameters()), lr=1.0)]
    for opt in opts:
        opt.step()
    whole = pm.state_dict()
    err = max((whole[n].float() - p.detach().float().cpu()).abs().max().item()
              for n, p in ref.named_parameters() if n in whole)
    waits, sites = None, collections.Counter()
    if device.type == "cuda":  # a steady step: how often the host waits for the device, and where
        pm.train_step({"input_ids": local, "labels": local})
        torch.cuda.synchronize()
        with syncs.counted_syncs(opts[0], device) as sites:
            pm.train_step({"input_ids": local, "labels": local})
        waits = sum(sites.values())
    loss_err = abs(loss.item() - ref_loss.item()) / abs(ref_loss.item())
    equal = loss_err <= LOSS_RTOL and err <= WEIGHT_ATOL
    detail = f"loss rel {loss_err:.1e}, max weight diff {err:.1e}" + (f"; syncs {syncs.top(sites, 2)}" if sites else "")
    return [row("parity", case.name, "equal" if equal else "different", detail, procs=case.procs, syncs=waits,
                loss_err=loss_err, weight_err=err, sites=dict(sites))]


# ---------------------------------------------------------------- processes


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _rank(rank: int, world: int, port: int, job: Callable, kwargs: dict, results) -> None:
    import torch.distributed as dist
    import transformers

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world),
                      LOCAL_RANK=str(rank), LOCAL_WORLD_SIZE=str(world))
    transformers.logging.set_verbosity_error()
    device = this_device()
    if device.type == "cuda":
        torch.cuda.set_device(device)
    elif "OMP_NUM_THREADS" not in os.environ:  # the test suite asks for one thread per process
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // world))
    try:
        dist.init_process_group("nccl" if device.type == "cuda" else "gloo", timeout=datetime.timedelta(minutes=5),
                                **({"device_id": device} if device.type == "cuda" else {}))
        out = {"rank": rank, "rows": job(**kwargs)}
    except BaseException as e:  # noqa: BLE001 - the table reports it
        out = {"rank": rank, "error": f"{type(e).__name__}: {e}".splitlines()[0][:200], "trace": traceback.format_exc()}
    results.put(out)
    if dist.is_initialized():
        dist.destroy_process_group()


def run_world(job: Callable, *, procs: int, timeout: float, **kwargs) -> tuple[list[dict], str | None]:
    """Run ``job(**kwargs)`` on ``procs`` spawned ranks; rank 0's rows, or an error (a rank failed, died or ran
    past ``timeout`` seconds: then every rank is killed)."""
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    port = _free_port()
    ranks = [ctx.Process(target=_rank, args=(r, procs, port, job, kwargs, results)) for r in range(procs)]
    for p in ranks:
        p.start()
    deadline, outs, error = time.monotonic() + timeout, {}, None
    while len(outs) < procs and error is None:
        try:
            out = results.get(timeout=1.0)
            outs[out["rank"]] = out
        except queue.Empty:
            dead = [r for r, p in enumerate(ranks) if p.exitcode not in (None, 0) and r not in outs]
            if dead:
                error = f"rank {dead[0]} died (exit code {ranks[dead[0]].exitcode}) without reporting"
            elif time.monotonic() > deadline:
                error = f"did not finish within {timeout:.0f} s (killed)"
    for p in ranks:
        p.join(timeout=30 if error is None else 1)
        if p.is_alive():
            p.kill()
            p.join()
    failed = [o for o in outs.values() if "error" in o]
    if failed:
        print(failed[0]["trace"], file=sys.stderr)
        error = f"rank {failed[0]['rank']}: {failed[0]['error']}"
    return (outs.get(0) or {}).get("rows", []), error


@dataclass(frozen=True)
class Section:
    name: str
    job: Callable
    budget_s: float  # on one H100 at full size, with room; the CPU's small run takes far less


SECTIONS = [  # the open questions first (issue 67: what a save keeps and orders, the host's waits per step)
    Section("checkpoint", checkpoints.async_save, 90),
    Section("syncs", syncs.host_syncs, 90),
    Section("ring", ring.ring_kernels, 90),
    Section("dp_shard", sharded.sharded_one_rank, 60),
    Section("long", long_context.offload_and_chunks, 90),
    Section("speed", speed.eager, 150),
    Section("compile", speed.compiled, 240),
]


def parity_cases(fits: int, *, quick: bool, unit: str) -> list[tuple[Case, str | None]]:
    """The parity cases to list, each with why it cannot run here (None: it runs)."""
    cases = [c for c in CASES if not quick or c.name in QUICK]
    return [(c, f"needs {c.procs} {unit}" if c.procs > fits else None) for c in cases]


def _print_row(r: dict) -> None:
    print("GPU_CHECK_JSON " + json.dumps(r, default=str), flush=True)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--cpu-world", type=int, default=2, help="without GPUs: the largest gloo world (default 2)")
    parser.add_argument("--quick", action="store_true", help="small sizes, a few parity cases (the test suite's run)")
    parser.add_argument("--json", help="also write every row to this file")
    parser.add_argument("--budget", type=float, default=450.0,
                        help="seconds for the whole run (default 450); a section past it is killed and fails")
    names = ["parity", *(s.name for s in SECTIONS)]
    parser.add_argument("--sections", default=",".join(names), help=f"which to run, of {','.join(names)}")
    args = parser.parse_args(argv)
    os.environ["PYTHONPATH"] = os.pathsep.join([str(ROOT), *filter(None, [os.environ.get("PYTHONPATH")])])
    for key in ("HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE", "HF_DATASETS_OFFLINE"):  # nothing is downloaded
        os.environ.setdefault(key, "1")
    os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
    chosen = set(args.sections.split(","))
    if chosen - set(names):
        parser.error(f"unknown sections {sorted(chosen - set(names))}; choose among {names}")
    import transformers

    import qn_hf

    gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
    fits = gpus if gpus else args.cpu_world
    where = f"{gpus} x {torch.cuda.get_device_name(0)}, NCCL" if gpus else f"CPU, gloo, worlds of up to {fits}"
    environment = {"device": torch.cuda.get_device_name(0) if gpus else "cpu", "gpus": gpus, "torch": torch.__version__,
                   "cuda": torch.version.cuda, "transformers": transformers.__version__, "quick": args.quick,
                   "qn_hf": str(Path(qn_hf.__file__).resolve().parent), "python": sys.executable}
    print(f"qn_hf gpu-check on {where}; torch {torch.__version__}, transformers {transformers.__version__}", flush=True)
    began = time.monotonic()
    table: list[dict] = []

    def section(name: str, job: Callable, budget: float, *, procs: int = 1, **kwargs) -> None:
        left = args.budget - (time.monotonic() - began)
        if left < 10:
            table.append(row(name, name, "skipped", f"not run: the --budget of {args.budget:.0f} s was spent",
                             procs=procs))
            _print_row(table[-1])
            return
        started = time.monotonic()
        rows, error = run_world(job, procs=procs, timeout=min(budget, left), quick=args.quick, **kwargs)
        if error:
            rows = [*rows, row(name, name, "error", error[:200], procs=procs)]
        for r in rows:
            r["metrics"]["section_s"] = round(time.monotonic() - started, 1)
            table.append(r)
            _print_row(r)
        print(f"  {name}: {', '.join(sorted({r['result'] for r in rows}))} ({time.monotonic() - started:.0f} s)",
              flush=True)

    if "parity" in chosen:
        for case, needs in parity_cases(fits, quick=args.quick, unit="GPUs" if gpus else "processes"):
            if needs:
                table.append(row("parity", case.name, "skipped", needs, procs=case.procs))
                _print_row(table[-1])
            else:
                section("parity", _parity, 120, procs=case.procs, case=case)
                table[-1]["case"] = case.name  # an error row is named for its case
    for s in SECTIONS:
        if s.name in chosen:
            section(s.name, s.job, s.budget_s)
    agree = speed.first_losses_agree(table)
    if agree is not None:
        table.append(agree)
        _print_row(agree)
    width = max(len(r["case"]) for r in table)
    print(f"\n{'section':<12} {'case':<{width}}  procs  {'result':<9} syncs/step  detail")
    for r in table:
        waits = "-" if r["syncs"] is None else r["syncs"]
        print(f"{r['section']:<12} {r['case']:<{width}}  {r['procs']:>5}  {r['result']:<9} {waits:>10}  {r['detail']}")
    missing = NOT_ON_CPU if not gpus else NOT_ON_ONE_GPU if gpus < 2 else []
    if missing:
        print(f"\nWhat {'this CPU run' if not gpus else 'one GPU'} could not test:")
        for line in missing:
            print(f"  - {line}")
    bad = [r for r in table if r["result"] in FAILING]
    verdict = f"{len(bad)} failed: {', '.join(r['case'] for r in bad)}" if bad else "all equal or within tolerance"
    print(f"\n{len(table)} rows in {time.monotonic() - began:.0f} s; {verdict}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"environment": environment, "rows": table, "not_tested": missing}, f, indent=1, default=str)
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
