"""``make gpu-check``: what qn_hf does on this machine's accelerators, in minutes, as one table.

On a machine with N >= 1 CUDA GPUs (NCCL, one GPU per process):

* parity: one training step (SGD, float32, TF32 off) of a tiny Llama (Qwen3-MoE for ep) at every mesh
  that fits N GPUs against the plain model on the same device: the loss and every weight after the
  step (``pm.state_dict()`` against the reference), plus the host synchronizations of a second,
  steady step counted by CUDA's sync debug mode;
* throughput: a ~0.5B-parameter Llama in bf16 at tp=1 on one GPU, qn_hf (``mixed_precision="bf16"``,
  float32 masters, ``qn_hf.optimizer`` AdamW) against the plain model as a user would train it
  (float32 weights under ``torch.autocast(bfloat16)``, torch's fused AdamW): tokens/s, their ratio,
  MFU against the GPU's dense bf16 peak, and peak memory.

Without a GPU it runs the same cases that fit on gloo worlds of at most ``--cpu-world`` processes
(float32, tiny throughput model, no MFU), so the test suite keeps this script working. Exit status
0 when every case that ran is equal, 1 otherwise.

    python scripts/gpu_check.py [--cpu-world 2] [--quick] [--json FILE]
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
import traceback
from dataclasses import dataclass, field

import torch
import torch.multiprocessing as mp

LOSS_RTOL, WEIGHT_ATOL = 1e-5, 2e-5
# dense bf16 peak FLOP/s by device name (vendor data sheets); others report no MFU
PEAK_BF16 = {"H100 SXM": 989e12, "H100 80GB HBM3": 989e12, "H100 PCIe": 756e12, "H100": 989e12, "H200": 989e12,
             "A100": 312e12, "L40S": 362e12, "A10G": 70e12, "L4": 121e12}


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
QUICK = {"plain mesh (1 process)", "tp=2", "pp=2 1f1b", "cp=2 (ring attention)"}


def tiny_config(model: str):
    from transformers import AutoConfig

    common = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=4, num_attention_heads=4,
                  num_key_value_heads=2, head_dim=16, vocab_size=128, max_position_embeddings=64,
                  bos_token_id=1, eos_token_id=2, pad_token_id=0)
    if model == "qwen3_moe":
        return AutoConfig.for_model("qwen3_moe", **common, num_experts=4, num_experts_per_tok=2,
                                    moe_intermediate_size=32, decoder_sparse_step=1, mlp_only_layers=[])
    return AutoConfig.for_model("llama", **common)


def _device() -> torch.device:
    if torch.cuda.is_available():
        return torch.device("cuda", int(os.environ["LOCAL_RANK"]))
    return torch.device("cpu")


def _parity(case: Case) -> dict:
    """One rank of a parity case; rank 0's dict is the row."""
    import copy

    import torch.distributed as dist
    from transformers import AutoModelForCausalLM

    import qn_hf

    device = _device()
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
    for params in (list(pm.parameters()), list(ref.parameters())):
        torch.optim.SGD(params, lr=1.0).step()
    whole = pm.state_dict()
    err = max((whole[n].float() - p.detach().float().cpu()).abs().max().item()
              for n, p in ref.named_parameters() if n in whole)
    syncs = None
    if device.type == "cuda":  # a steady step: how often the host waits for the device
        pm.train_step({"input_ids": local, "labels": local})
        torch.cuda.synchronize()
        import warnings

        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            torch.cuda.set_sync_debug_mode("warn")
            try:
                pm.train_step({"input_ids": local, "labels": local})
            finally:
                torch.cuda.set_sync_debug_mode("default")
        syncs = sum("synchroniz" in str(w.message) for w in caught)
    loss_err = abs(loss.item() - ref_loss.item()) / abs(ref_loss.item())
    equal = loss_err <= LOSS_RTOL and err <= WEIGHT_ATOL
    return {"rank": dist.get_rank(), "verdict": "equal" if equal else "different",
            "detail": f"loss rel {loss_err:.1e}, max weight diff {err:.1e}", "syncs": syncs}


def _throughput(_case: Case, *, quick: bool) -> dict:
    """tokens/s of qn_hf (bf16 + float32 masters) and of the plain model (autocast bf16), one process."""
    from transformers import AutoConfig, AutoModelForCausalLM

    import qn_hf

    device = _device()
    gpu = device.type == "cuda"
    if gpu:
        shape = dict(hidden_size=1536, intermediate_size=4096, num_hidden_layers=16, num_attention_heads=12,
                     num_key_value_heads=4, vocab_size=32000)
        seq, rows, steps = 2048, 4, 10
    else:
        shape = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                     num_key_value_heads=2, vocab_size=256)
        seq, rows, steps = 64, 2, 2 if quick else 4
    config = AutoConfig.for_model("llama", **shape, max_position_embeddings=seq, bos_token_id=1, eos_token_id=2)
    ids = torch.randint(3, config.vocab_size, (rows, seq), generator=torch.Generator().manual_seed(0))
    batch = {"input_ids": ids.to(device), "labels": ids.to(device)}

    def timed(step) -> float:
        step()  # warm-up
        if gpu:
            torch.cuda.synchronize()
        start = time.perf_counter()
        for _ in range(steps):
            step()
        if gpu:
            torch.cuda.synchronize()
        return (time.perf_counter() - start) / steps

    torch.manual_seed(0)
    plain = AutoModelForCausalLM.from_config(config).float().to(device)
    params = sum(p.numel() for p in plain.parameters())
    opt = torch.optim.AdamW(plain.parameters(), lr=1e-4, fused=gpu)

    def plain_step() -> None:
        with torch.autocast(device.type, dtype=torch.bfloat16):
            loss = plain(**batch).loss
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)

    if gpu:
        torch.cuda.reset_peak_memory_stats()
    plain_s = timed(plain_step)
    plain_peak = torch.cuda.max_memory_allocated() if gpu else None
    del plain, opt
    torch.manual_seed(0)
    pm = qn_hf.parallelize(AutoModelForCausalLM.from_config(config).float(), device=device, mixed_precision="bf16")
    qopt = qn_hf.optimizer(pm, torch.optim.AdamW, lr=1e-4)

    def qn_step() -> None:
        pm.train_step(batch)
        qopt.step()
        qopt.zero_grad()

    if gpu:
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()
    qn_s = timed(qn_step)
    qn_peak = torch.cuda.max_memory_allocated() if gpu else None
    tokens = rows * seq
    flops = 6 * params * tokens + 12 * config.num_hidden_layers * config.hidden_size * seq * tokens  # + attention
    name = torch.cuda.get_device_name(device) if gpu else "cpu"
    peak = next((v for k, v in PEAK_BF16.items() if k in name), None) if gpu else None
    mfu = f", MFU {flops / qn_s / peak:.0%} (plain {flops / plain_s / peak:.0%})" if peak else ""
    memory = f", peak {qn_peak / 2**30:.1f} GiB (plain {plain_peak / 2**30:.1f})" if gpu else ""
    return {"rank": 0, "verdict": "measured",
            "detail": f"{params / 1e6:.0f}M params, {tokens / qn_s:,.0f} tokens/s vs plain {tokens / plain_s:,.0f} "
                      f"(x{plain_s / qn_s:.2f}){mfu}{memory}", "syncs": None}


def _rank(rank: int, world: int, port: int, case: Case, kind: str, quick: bool, results) -> None:
    import datetime

    import torch.distributed as dist
    import transformers

    from qn_hf.mesh import backend_for

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world),
                      LOCAL_RANK=str(rank), LOCAL_WORLD_SIZE=str(world))
    transformers.logging.set_verbosity_error()
    if not torch.cuda.is_available():
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // world))
    device = _device()
    if device.type == "cuda":
        torch.cuda.set_device(device)
    try:
        dist.init_process_group(backend_for(device), timeout=datetime.timedelta(minutes=5),
                                **({"device_id": device} if device.type == "cuda" else {}))
        row = _parity(case) if kind == "parity" else _throughput(case, quick=quick)
    except BaseException as e:  # noqa: BLE001 - the table reports it
        row = {"rank": rank, "verdict": "error", "detail": f"{type(e).__name__}: {e}".splitlines()[0][:160],
               "trace": traceback.format_exc(), "syncs": None}
    results.put(row)
    if dist.is_initialized():
        dist.destroy_process_group()


def run(case: Case, *, kind: str, quick: bool) -> dict:
    from qn_hf.mesh import free_local_port

    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    port = free_local_port()
    procs = [ctx.Process(target=_rank, args=(r, case.procs, port, case, kind, quick, results)) for r in range(case.procs)]
    for p in procs:
        p.start()
    rows = []
    try:
        for _ in procs:
            rows.append(results.get(timeout=600))
    except Exception:  # noqa: BLE001 - a rank died without reporting
        rows.append({"rank": -1, "verdict": "error", "detail": "a rank did not report within 600 s", "syncs": None})
    for p in procs:
        p.join(timeout=30)
        if p.is_alive():
            p.terminate()
    bad = [r for r in rows if r["verdict"] in ("error", "different")]
    return bad[0] if bad else next(r for r in rows if r["rank"] == 0)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--cpu-world", type=int, default=2, help="without GPUs: largest gloo world to start (default 2)")
    parser.add_argument("--quick", action="store_true", help="a few cases only (the test suite's run)")
    parser.add_argument("--json", help="also write the rows to this file")
    args = parser.parse_args(argv)
    gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
    fits = gpus if gpus else args.cpu_world
    where = f"{gpus} x {torch.cuda.get_device_name(0)}, NCCL" if gpus else f"CPU, gloo, worlds of up to {fits}"
    print(f"qn_hf gpu-check on {where}; torch {torch.__version__}", flush=True)
    table = []
    for case in [c for c in CASES if not args.quick or c.name in QUICK]:
        if case.procs > fits:
            table.append((case.name, case.procs, "skipped", f"needs {case.procs} {'GPUs' if gpus else 'processes'}", None))
            continue
        row = run(case, kind="parity", quick=args.quick)
        table.append((case.name, case.procs, row["verdict"], row["detail"], row["syncs"]))
        if row["verdict"] == "error":
            print(row.get("trace", ""), file=sys.stderr)
        print(f"  {case.name}: {row['verdict']}", flush=True)
    row = run(Case("throughput bf16 tp=1", 1), kind="throughput", quick=args.quick)
    table.append(("throughput bf16 tp=1", 1, row["verdict"], row["detail"], None))
    width = max(len(r[0]) for r in table)
    print(f"\n{'case':<{width}}  procs  {'result':<9} syncs/step  detail")
    for name, procs, verdict, detail, syncs in table:
        print(f"{name:<{width}}  {procs:>5}  {verdict:<9} {'-' if syncs is None else syncs:>10}  {detail}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump([dict(zip(("case", "procs", "result", "detail", "syncs"), r)) for r in table], f, indent=1)
    return 0 if all(r[2] in ("equal", "skipped", "measured") for r in table) else 1


if __name__ == "__main__":
    sys.exit(main())
