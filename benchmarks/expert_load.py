"""``python benchmarks/experts.py load``: the load on each ep rank while tiny-qwen3-moe trains at dp=2
ep=2 on the LM results config's data and schedule (configs/llama_tiny.yaml: Python's reference manual
as bytes, global batch 16 x 128, AdamW with warm-up and cosine decay), its mesh replaced.

A forward pre-hook on every experts module counts the (token, expert) pairs the router sends to
each expert, per step and layer, on each dp rank; their sum over the dp ranks, grouped by the ep
rank owning each expert, is the number of rows that rank's experts run and the all-to-all waits
for. The model has no load-balancing loss (qn_hf's loss does not compute transformers' auxiliary
one), so nothing keeps the routers even. Plotted to results/expert_load.png.
"""

from __future__ import annotations

import argparse
import os

import torch
import torch.distributed as dist
from world import run_world


def route_counter(pm, *, experts: int) -> list[torch.Tensor]:
    """One ``[experts]`` count per experts module of the (token, expert) pairs its forward sees, by a
    forward pre-hook: the router's choices in global expert ids, before any dispatch."""
    from qn_hf.expert_parallel.apply import experts_modules

    counts = []
    for module in experts_modules(pm.module).values():
        count = torch.zeros(experts, dtype=torch.int64)

        def hook(_module, args, count=count):
            count.add_(torch.bincount(args[1].reshape(-1), minlength=count.numel()))

        counts.append(count)
        module.register_forward_pre_hook(hook)
    return counts


def load_worker(rank: int, world: int, args: argparse.Namespace) -> dict:
    from transformers import AutoModelForCausalLM

    import qn_hf
    from qn_hf.training.config import make_config, read_yaml, task_defaults
    from qn_hf.training.lr import warmup_cosine
    from qn_hf.training.sampler import GlobalBatches
    from qn_hf.training.tasks import LmTask

    # the LM results config's data, batches and schedule; the MoE preset at dp=2 ep=2 instead of its mesh
    values = {**task_defaults("lm"), **read_yaml(args.config), "model": "tiny-qwen3-moe", "mesh": [2, 1, 1],
              "ep": 2, "steps": args.steps}
    cfg = make_config(values)
    task = LmTask()
    if rank != 0:
        dist.barrier()  # rank 0 tokenizes first, as the training loop does
    prepared = task.prepare(cfg, None)
    if rank == 0:
        dist.barrier()
    config = prepared.config  # the preset sized to the data (vocabulary, sequence)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(cfg.seed)  # the initial weights the training script would build
        model = AutoModelForCausalLM.from_config(config)
    dp, ep = cfg.mesh[0], cfg.ep
    pm = qn_hf.parallelize(model, dp=dp, ep=ep, microbatches=cfg.microbatches, seed=cfg.seed)
    decay = [p for p in pm.parameters() if p.requires_grad and p.dim() >= 2]
    keep = [p for p in pm.parameters() if p.requires_grad and p.dim() < 2]
    opt = qn_hf.optimizer(pm, torch.optim.AdamW, lr=cfg.lr, param_groups=[
        {"params": decay, "weight_decay": cfg.weight_decay}, {"params": keep, "weight_decay": 0.0}])
    sampler = GlobalBatches(examples=len(prepared.train), batch_size=cfg.batch_size, seed=cfg.seed)
    counts = route_counter(pm, experts=config.num_experts)
    per_step, losses = [], []
    for step in range(1, cfg.steps + 1):
        for group in opt.param_groups:
            group["lr"] = warmup_cosine(step, lr=cfg.lr, warmup_steps=cfg.warmup_steps, total_steps=cfg.steps,
                                        min_lr_ratio=cfg.min_lr_ratio)
        for c in counts:
            c.zero_()
        opt.zero_grad(set_to_none=True)
        losses.append(pm.train_step(task.batch(prepared.train[sampler.local_indices(step, dp_rank=pm.coords["dp"],
                                                                                   dp=dp)])).item())
        qn_hf.clip_grad_norm_(pm, cfg.grad_clip)
        opt.step()
        per_step.append(torch.stack(counts).clone())
    routed = torch.stack(per_step)  # [step, layer, expert] on this dp rank
    dist.all_reduce(routed)  # both dp ranks' tokens
    # plain lists: a tensor in the result queue would be shared memory of a process about to exit
    return {"routed": routed.tolist(), "losses": losses, "cfg": cfg, "layers": config.num_hidden_layers, "ep": ep}


def load(args: argparse.Namespace) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.ticker import MaxNLocator

    out = run_world(load_worker, world=2, extra=(args,))
    routed, cfg, ep = torch.tensor(out["routed"]), out["cfg"], out["ep"]
    steps, layers, experts = routed.shape
    by_rank = routed.view(steps, layers, ep, experts // ep).sum(-1)  # [step, layer, ep rank]
    total = by_rank.sum(1).double()  # [step, ep rank], summed over layers
    ratio = total.max(1).values / total.mean(1)
    per_layer = by_rank.max(2).values / by_rank.double().mean(2)  # [step, layer]
    layer_ratio = per_layer.max(1).values  # the worst layer of each step
    pairs = cfg.batch_size * cfg.seq_len * layers * 2
    print(f"tiny-qwen3-moe ({layers} layers, {experts} experts, top-2, no load-balancing loss) at dp=2 ep={ep} on "
          f"{args.config}'s data and schedule (batch {cfg.batch_size} x {cfg.seq_len}, lr {cfg.lr}, {cfg.microbatches} "
          f"microbatches), {steps} steps; loss {out['losses'][0]:.3f} -> {out['losses'][-1]:.3f} (rank 0)")
    print(f"(token, expert) pairs per step: {pairs:,} (both dp ranks, all layers); even share per ep rank "
          f"{pairs // ep:,}; max/mean = the busiest ep rank's load over the mean, which the all-to-all waits for")
    n = min(5, steps)
    print(f"{'steps':<14}" + "".join(f"{'ep rank ' + str(r):>12}" for r in range(ep)) + f"{'max/mean':>10}"
          f"{'worst layer':>13}")
    for label, sel in ((f"first {n}", slice(0, n)), (f"last {n}", slice(steps - n, steps)), ("all", slice(0, steps))):
        print(f"{label:<14}" + "".join(f"{v:>12,.0f}" for v in total[sel].mean(0).tolist())
              + f"{ratio[sel].mean().item():>10.3f}{layer_ratio[sel].mean().item():>13.3f}")
    worst = int(ratio.argmax())
    print(f"max/mean over the run: mean {ratio.mean().item():.3f}, worst {ratio.max().item():.3f} (step {worst + 1}); "
          f"worst layer of any step {layer_ratio.max().item():.3f}")
    print("max/mean per layer, mean over the run: " + ", ".join(f"layer {i} {v:.3f}" for i, v in
                                                          enumerate(per_layer.mean(0).tolist()))
          + "; last step: " + ", ".join(f"{v:.3f}" for v in per_layer[-1].tolist()))
    share = routed.sum(1).double()
    share = share / share.sum(1, keepdim=True)
    print("expert shares of the pairs (all layers), first / last step: " + ", ".join(f"{a:.3f}/{b:.3f}" for a, b in zip(share[0].tolist(),
                                                                                              share[-1].tolist())))
    fig, (ax, bx) = plt.subplots(1, 2, figsize=(11, 4))
    x = range(1, steps + 1)
    for r in range(ep):
        ax.plot(x, total[:, r].tolist(), lw=1.2, label=f"ep rank {r} (experts {r * experts // ep}-"
                                                        f"{(r + 1) * experts // ep - 1})")
    ax.axhline(pairs / ep, ls="--", color="grey", lw=1, label="even share")
    ax.set(xlabel="step", ylabel="(token, expert) pairs per step, all layers", title="tokens routed to each ep rank")
    bx.plot(x, ratio.tolist(), lw=1.2, label="all layers summed")
    bx.plot(x, layer_ratio.tolist(), "--", lw=1.2, label="worst layer")
    bx.set(xlabel="step", ylabel="busiest ep rank / mean", title="load imbalance")
    for a in (ax, bx):
        a.xaxis.set_major_locator(MaxNLocator(integer=True))
        a.grid(alpha=0.3)
        a.legend(fontsize=8)
    fig.suptitle(f"tiny-qwen3-moe, dp=2 ep={ep}, {os.path.basename(args.config)} data", fontsize=10)
    fig.tight_layout()
    os.makedirs(os.path.dirname(args.out) or ".", exist_ok=True)
    fig.savefig(args.out, dpi=110)
    plt.close(fig)
    print(f"plot {args.out}")
