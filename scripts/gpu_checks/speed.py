"""Training speed at tp=1 on one device: qn_hf against the plain model as a user trains it, eager or compiled.

qn_hf: ``parallelize(model, mixed_precision="bf16")`` (bf16 weights, float32 gradients, float32 masters in
``qn_hf.optimizer``). The plain model: float32 weights under ``torch.autocast(bfloat16)``, the way a user
trains it in one process; both step torch's AdamW (fused on a GPU) over float32 weights or masters. Compiled:
``parallelize(compile=True)`` against the plain model's blocks each compiled (``block.compile()``, as
torchtitan does), dynamo's graph breaks counted per side.
"""

from __future__ import annotations

import collections
import functools
import time

import torch

from .common import FIRST_LOSS_RTOL, build, llama_config, release, row, synchronize
from .common import device as this_device

# dense bf16 peak FLOP/s by device name (vendor data sheets), first match wins; others report no MFU
PEAK_BF16 = {"H100 SXM": 989e12, "H100 80GB HBM3": 989e12, "H100 PCIe": 756e12, "H100 NVL": 835e12, "H100": 989e12,
             "H200": 989e12, "A100": 312e12, "L40S": 362e12, "A10G": 70e12, "L4": 121e12}


def break_name(reason: str) -> str:
    """A graph break by its cause: "qn_hf: ..." when qn_hf's own code caused it (the random streams' generator
    swaps, qn_hf/tensor_parallel/rng.py, or a qn_hf file named in the reason), else the reason's first line."""
    swaps = [f for f in ("get_rng_state", "set_rng_state") if f"`{f}`" in reason]
    if swaps or "/qn_hf/" in reason:
        return f"qn_hf: {', '.join(swaps) or reason.splitlines()[0][:160]}"
    return reason.splitlines()[0][:200]


def _side(side: str, *, config, batch: dict, device: torch.device, compile: bool, warmup: int, steps: int) -> dict:
    """One side's run: warm-up steps (compilation, qn_hf's one-off checks), then ``steps`` timed steps with no
    host read inside (the device runs ahead, as in training), one synchronize at the end."""
    from torch._dynamo.utils import counters

    import qn_hf

    torch._dynamo.reset()
    counters.clear()
    release(device)
    gpu = device.type == "cuda"
    fused = {"fused": True} if gpu else {}
    model = build(config, device)
    params = sum(p.numel() for p in model.parameters())
    matmul_params = params - model.get_input_embeddings().weight.numel()  # the lookup does no FLOPs
    if side == "plain":
        if compile:
            for block in model.model.layers:
                block.compile()
        opt = torch.optim.AdamW(model.parameters(), lr=1e-4, **fused)

        def step() -> torch.Tensor:
            opt.zero_grad(set_to_none=True)
            with torch.autocast(device.type, dtype=torch.bfloat16):
                loss = model(**batch).loss
            loss.backward()
            opt.step()
            return loss.detach()
    else:
        pm = qn_hf.parallelize(model, device=device, mixed_precision="bf16", compile=compile)
        opt = qn_hf.optimizer(pm, torch.optim.AdamW, lr=1e-4, **fused)

        def step() -> torch.Tensor:
            opt.zero_grad()
            loss = pm.train_step(batch)
            opt.step()
            return loss

    release(device)  # the peak from here: weights, optimizer and training, not the model's build
    start = time.perf_counter()
    first = step()
    for _ in range(warmup - 1):
        step()
    synchronize(device)
    warm_s = time.perf_counter() - start
    start = time.perf_counter()
    for _ in range(steps):
        step()
    synchronize(device)
    step_s = (time.perf_counter() - start) / steps
    breaks: collections.Counter[str] = collections.Counter()
    for reason, n in counters["graph_break"].items():
        breaks[break_name(reason)] += n
    tokens = batch["input_ids"].numel()
    return dict(step_s=step_s, tokens_s=tokens / step_s, warmup_s=warm_s, first_loss=first.item(),
                peak_gib=torch.cuda.max_memory_allocated(device) / 2**30 if gpu else None,
                graph_breaks=sum(breaks.values()), break_reasons=dict(breaks),
                graphs=counters["stats"]["unique_graphs"], params=params, matmul_params=matmul_params)


def train_speed(*, quick: bool, compile: bool) -> list[dict]:
    """tokens/s, MFU and peak memory of qn_hf and of the plain model; compiled: graph breaks, graphs, warm-up."""
    device = this_device()
    gpu = device.type == "cuda"
    big = gpu and not quick
    seq, rows, warmup, steps = (2048, 4, 3, 15) if big else (64, 2, 2 if compile else 1, 2)
    backend = "aot_eager" if quick else "inductor"
    if compile and quick:  # dynamo and AOTAutograd decide graphs and breaks; inductor's codegen takes minutes on a CPU
        torch.compile = functools.partial(torch.compile, backend=backend)  # nn.Module.compile and qn_hf call it
    config = llama_config(big=big, seq=seq)
    ids = torch.randint(3, config.vocab_size, (rows, seq), generator=torch.Generator().manual_seed(0)).to(device)
    batch = {"input_ids": ids, "labels": ids}
    run = {side: _side(side, config=config, batch=batch, device=device, compile=compile, warmup=warmup, steps=steps)
           for side in ("plain", "qn_hf")}
    plain, ours = run["plain"], run["qn_hf"]
    tokens = rows * seq
    # 6 FLOPs per matmul weight and token, attention's 12 * layers * hidden * seq per token (PaLM's count)
    flops = 6 * ours["matmul_params"] * tokens + 12 * config.num_hidden_layers * config.hidden_size * seq * tokens
    name = torch.cuda.get_device_name(device) if gpu else "cpu"
    peak = next((v for k, v in PEAK_BF16.items() if k in name), None) if gpu else None
    detail = (f"{ours['params'] / 1e6:.0f}M params, {rows}x{seq} tokens: {ours['tokens_s']:,.0f} tokens/s vs plain "
              f"{plain['tokens_s']:,.0f} (x{plain['step_s'] / ours['step_s']:.2f})")
    if peak:
        detail += f", MFU {flops / ours['step_s'] / peak:.0%} (plain {flops / plain['step_s'] / peak:.0%})"
    if gpu:
        detail += f", peak {ours['peak_gib']:.1f} GiB (plain {plain['peak_gib']:.1f})"
    result = "measured"
    if compile:
        detail += (f"; {backend}: graph breaks {ours['graph_breaks']} (plain {plain['graph_breaks']}), graphs "
                   f"{ours['graphs']} (plain {plain['graphs']}), warm-up {ours['warmup_s']:.0f} s "
                   f"(plain {plain['warmup_s']:.0f} s)")
        ours_breaks = [r for r in ours["break_reasons"] if r.startswith("qn_hf")]
        if ours_breaks:  # tp=1, no dropout: qn_hf adds nothing that splits a block's graph
            result, detail = "failed", detail + f"; qn_hf's own breaks: {ours_breaks[:2]}"
    label = "compiled" if compile else "eager"
    return [row("compile" if compile else "speed", f"bf16 tp=1, {label}, {'fused ' if gpu else ''}AdamW", result,
                detail, tokens_per_step=tokens, mfu=flops / ours["step_s"] / peak if peak else None, backend=backend,
                plain=plain, qn_hf=ours)]


def eager(*, quick: bool) -> list[dict]:
    return train_speed(quick=quick, compile=False)


def compiled(*, quick: bool) -> list[dict]:
    return train_speed(quick=quick, compile=True)


def first_losses_agree(rows: list[dict]) -> dict | None:
    """The first step's losses of the speed rows (the same weights and batch): bf16 runs agree to about 1e-2."""
    losses = {f"{r['section']} {side}": r["metrics"][side]["first_loss"] for r in rows
              if r["section"] in ("speed", "compile") and r["result"] != "error" for side in ("plain", "qn_hf")}
    if len(losses) < 2:
        return None
    ref = losses.get("speed plain", next(iter(losses.values())))
    worst = max(abs(v - ref) / abs(ref) for v in losses.values())
    text = ", ".join(f"{k} {v:.4f}" for k, v in losses.items())
    return row("speed", "first losses agree", "equal" if worst <= FIRST_LOSS_RTOL else "different",
               f"{text}; worst rel {worst:.1e} (tol {FIRST_LOSS_RTOL:.0e})", losses=losses)
