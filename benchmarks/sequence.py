"""Long sequences: sequence parallelism at tp=2 and context parallelism (ring attention) at cp = 1, 2, 4.

    python benchmarks/sequence.py sp          # one Llama microbatch at sequence 8,192, tp=2, SP off/on
    python benchmarks/sequence.py cp          # the same microbatch at cp = 1, 2, 4: memory, ring bytes
    python benchmarks/sequence.py ring        # ring attention alone at cp=4: timeline, balanced vs contiguous
    python benchmarks/sequence.py window      # ring attention in a sliding window at cp=4 vs full causal

A tiny-width Llama (2 blocks, hidden 64, 4 heads over 2 KV heads, SDPA attention) runs one
microbatch of 1 x 8,192 tokens, float32, on each tp rank. ``LiveAllocations`` records every
storage an op creates during the forward; what is still alive when the forward returns is what
backward will read (activations and this rank's vocabulary shard of the logits). Storages made inside the modules that run between
the tensor-parallel regions (the norms of each block and the final norm) are filed under
"between", so their share is reported too: under sequence parallelism it should fall to 1/tp.
tp communication per step is counted by ``CommMeter`` (calls and payload bytes by operation).
"""

from __future__ import annotations

import argparse
import os
import tempfile
import time

import torch
from torch import nn
from world import run_world

from qn_hf.comm_meter import CommMeter
from qn_hf.memory.live_allocations import LiveAllocations
from qn_hf.policies.module_kinds import position_wise

LLAMA = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
             vocab_size=128, max_position_embeddings=16384, bos_token_id=1, eos_token_id=2)


def _label_between(pm, tracker: LiveAllocations) -> None:
    """File what the norms outside the tp entries (those of each block, the final norm) allocate
    under "between"."""

    def enter(*_):
        tracker.label = "between"

    def leave(*_):
        tracker.label = ""

    for name, module in pm.module.named_modules():
        inside = any(name.startswith(entry + ".") for entry in pm.plan.tp_entries)
        if position_wise(module) and not isinstance(module, (nn.Dropout, nn.Identity)) and not inside:
            module.register_forward_pre_hook(enter)
            module.register_forward_hook(leave)


def sp_worker(rank: int, world: int, path: str, seq: int, sequence_parallel: bool) -> dict:
    from transformers import LlamaForCausalLM

    import qn_hf

    pm = qn_hf.parallelize(LlamaForCausalLM.from_pretrained(path), tp=world, seed=0, sequence_parallel=sequence_parallel)
    ids = torch.randint(3, LLAMA["vocab_size"], (1, seq), generator=torch.Generator().manual_seed(1))
    batch = {"input_ids": ids, "labels": ids}
    pm.train()
    tracker = LiveAllocations()
    _label_between(pm, tracker)
    with tracker:  # no labels: HF's own loss cannot take vocabulary-sharded logits
        out = pm(input_ids=ids)
    live, between = tracker.alive_bytes(), tracker.alive_bytes("between")
    del out
    with CommMeter(pm) as meter:
        pm.train_step(batch)
    ops: dict[str, list[int]] = {}
    for event in meter.events:
        if event.group == "tp":
            calls, nbytes = ops.setdefault(event.op, [0, 0])
            ops[event.op] = [calls + 1, nbytes + event.nbytes]
    return {"live": live, "between": between, "tp_ops": ops}


def sp(args: argparse.Namespace) -> None:
    from transformers import LlamaConfig, LlamaForCausalLM

    path = tempfile.mkdtemp(prefix="qn_hf_seq_")
    torch.manual_seed(0)
    LlamaForCausalLM(LlamaConfig(**LLAMA)).save_pretrained(path)
    print(f"Llama 2 blocks, hidden 64, one microbatch of 1 x {args.seq} tokens, float32, tp=2; bytes alive after the "
          f"forward on rank 0 (LiveAllocations); 'between' = made inside the norms between the tp regions")
    print(f"{'sequence_parallel':<19}{'activations MiB':>16}{'between MiB':>13}{'vs off':>8}   tp traffic per step (calls, payload MiB)")
    base = None
    for sequence_parallel in (False, True):
        r = run_world(sp_worker, world=2, extra=(path, args.seq, sequence_parallel))
        base = base or r
        traffic = ", ".join(f"{op} {c} x {b / 2**20:.1f}" for op, (c, b) in sorted(r["tp_ops"].items()))
        print(f"{str(sequence_parallel):<19}{r['live'] / 2**20:>16,.1f}{r['between'] / 2**20:>13,.2f}"
              f"{r['between'] / base['between']:>8.2f}   {traffic}")


def cp_worker(rank: int, world: int, path: str, seq: int) -> dict:
    from transformers import LlamaForCausalLM

    import qn_hf

    pm = qn_hf.parallelize(LlamaForCausalLM.from_pretrained(path), cp=world, seed=0)
    ids = torch.randint(3, LLAMA["vocab_size"], (1, seq), generator=torch.Generator().manual_seed(1))
    batch = {"input_ids": ids, "labels": ids}
    tracker = LiveAllocations()
    # the activations one microbatch leaves for backward: measured at the first backward op of the step
    alive: list[int] = []
    handle = torch.autograd.graph.register_multi_grad_hook(
        [p for p in pm.parameters() if p.requires_grad][-1:], lambda _: alive.append(tracker.alive_bytes()), mode="any")
    with tracker:
        pm.train_step(batch)
    handle.remove()
    with CommMeter(pm) as meter:
        pm.train_step(batch)
    sent = [e for e in meter.events if e.group == "cp" and e.op == "send"]
    return {"alive": alive[0] if alive else tracker.alive_bytes(), "sends": len(sent),
            "sent": sum(e.nbytes for e in sent)}


def cp(args: argparse.Namespace) -> None:
    from transformers import LlamaConfig, LlamaForCausalLM

    path = tempfile.mkdtemp(prefix="qn_hf_cp_")
    torch.manual_seed(0)
    config = LlamaConfig(**LLAMA)
    LlamaForCausalLM(config).save_pretrained(path)
    head_dim = config.hidden_size // config.num_attention_heads
    print(f"Llama 2 blocks, hidden 64, one microbatch of 1 x {args.seq} tokens, float32; cp=1 runs transformers' SDPA, "
          f"cp>1 ring attention; activations = bytes alive when backward starts, rank 0 (LiveAllocations)")
    print(f"{'cp':>3}{'activations MiB':>17}{'x cp':>8}{'cp sends':>10}{'sent MiB':>10}{'theory MiB':>12}")
    for size in args.cps:
        r = run_world(cp_worker, world=size, extra=(path, args.seq))
        block = 2 * config.num_key_value_heads * (args.seq // size) * head_dim * 4  # k and v of one rank, float32
        # per layer and step: forward (cp-1) blocks; backward (cp-1) blocks and cp gradient blocks
        theory = config.num_hidden_layers * (2 * (size - 1) + size) * block if size > 1 else 0
        print(f"{size:>3}{r['alive'] / 2**20:>17,.1f}{r['alive'] * size / 2**20:>8,.0f}{r['sends']:>10}"
              f"{r['sent'] / 2**20:>10,.2f}{theory / 2**20:>12,.2f}")


def ring_worker(rank: int, world: int, seq: int, balanced: bool, heads: int, head_dim: int,
                window: int | None = None) -> dict:
    import torch.distributed as dist

    from qn_hf.context_parallel.ring_attention import PieceLayout, ring_attention

    gen = torch.Generator().manual_seed(rank)
    shape = (1, heads, seq // world, head_dim)
    q, k, v = (torch.randn(shape, generator=gen, requires_grad=True) for _ in range(3))
    ones = torch.ones(1, seq, dtype=torch.long)
    layout = PieceLayout(size=world, balanced=balanced)
    for _ in range(2):  # warm-up, then the timed call
        events: list = []
        dist.barrier()
        start = time.perf_counter()
        out = ring_attention(q, k, v, documents=ones * 0, valid=ones, layout=layout, group=dist.group.WORLD,
                             scaling=head_dim ** -0.5, events=events, window=window)
        out.sum().backward()
        total = time.perf_counter() - start
    events = [(p, s, a - start, b - start, c - start) for p, s, a, b, c in events]
    return {"rank": rank, "events": events, "total": total}


def _gather_ranks(body, world: int, extra: tuple) -> list[dict]:
    """Every rank's result (run_world returns rank 0's): rank 0 gathers them."""
    return run_world(_all_ranks, world=world, extra=(body, extra))


def _all_ranks(rank: int, world: int, body, extra: tuple) -> list[dict]:
    import torch.distributed as dist

    mine = body(rank, world, *extra)
    everyone: list = [None] * world
    dist.all_gather_object(everyone, mine)
    return everyone


def ring(args: argparse.Namespace) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from qn_hf.context_parallel.ring_attention import PieceLayout

    world, heads, head_dim = 4, 4, 16
    print(f"ring attention alone, cp={world}, 1 x {args.seq} tokens, {heads} heads of {head_dim}, forward + backward; "
          f"blocks = (query piece, key piece) pairs a rank computes per pass, the exact work; seconds measured with "
          f"{world} ranks on {os.cpu_count()} cores")
    print(f"{'layout':<12}{'blocks per rank':>18}{'max/mean':>10}" + "".join(f"{'rank ' + str(r) + ' s':>10}" for r in range(world))
          + f"{'max/mean':>10}")
    runs = {}
    for balanced in (True, False):
        layout = PieceLayout(size=world, balanced=balanced)
        blocks = [sum(kp <= qp for qp in layout.pieces(r) for o in range(world) for kp in layout.pieces(o))
                  for r in range(world)]
        ranks = _gather_ranks(ring_worker, world, (args.seq, balanced, heads, head_dim))
        compute = [sum(b - a for _, _, a, b, _ in r["events"]) for r in ranks]
        runs[balanced] = ranks
        print(f"{'balanced' if balanced else 'contiguous':<12}{str(blocks):>18}{max(blocks) / (sum(blocks) / world):>10.2f}"
              + "".join(f"{c:>10.3f}" for c in compute) + f"{max(compute) / (sum(compute) / world):>10.2f}")
    ranks = runs[True]
    fig, ax = plt.subplots(figsize=(10, 3))
    for r in ranks:
        for kind, _step, started, computed, received in r["events"]:
            color = "tab:blue" if kind == "forward" else "tab:green"
            ax.broken_barh([(started, computed - started)], (r["rank"] - 0.4, 0.8), color=color)
            ax.broken_barh([(computed, received - computed)], (r["rank"] - 0.4, 0.8), color="tab:red")
    ax.set_yticks(range(world), [f"cp rank {r}" for r in range(world)])
    ax.set_xlabel("seconds (blue: forward block compute, green: backward block compute, red: waiting for the ring)")
    ax.set_title(f"ring attention, balanced layout, cp={world}, sequence {args.seq}")
    fig.tight_layout()
    fig.savefig(args.out)
    waits = [sum(c - b for _, _, _, b, c in r["events"]) for r in ranks]
    print(f"waiting for transfers after computing, per rank (s): {[round(w, 3) for w in waits]}; timeline {args.out}")


def window(args: argparse.Namespace) -> None:
    """A sliding window of ``--window`` tokens: which (query rows x key columns) each rank computes per
    pass against the pairs its queries really see (each query sees min(position + 1, window) keys),
    both layouts, and the measured forward + backward time against full causal attention."""
    from qn_hf.context_parallel.ring_attention import PieceLayout, ring_blocks

    world, heads, head_dim, seq, w = 4, 4, 16, args.seq, args.window
    piece = seq // (2 * world)
    print(f"ring attention, cp={world}, 1 x {seq} tokens, {heads} heads of {head_dim}, window {w}; per rank and pass: "
          f"kernel calls, query x key elements computed (the calls' rectangles) and visible (exact: "
          f"sum of min(p + 1, window) over its queries), forward + backward seconds ({world} ranks, {os.cpu_count()} cores)")
    print(f"{'layout':<12}{'window':>8}{'calls':>16}{'computed (M)':>30}{'visible (M)':>30}{'max/mean':>10}"
          f"{'seconds':>30}{'max/mean':>10}")
    for balanced in (True, False):
        layout = PieceLayout(size=world, balanced=balanced)
        for size in (w, None):
            calls, computed, visible = [], [], []
            for r in range(world):
                plans = [p for o in range(world) for p in ring_blocks(layout, rank=r, owner=o, piece=piece, window=size)]
                calls.append(len(plans))
                computed.append(sum((p.queries.stop - p.queries.start) * (p.keys.stop - p.keys.start) for p in plans))
                at = layout.positions(r, seq)
                visible.append(int((at + 1).clamp(max=size or seq).sum()))
            ranks = _gather_ranks(ring_worker, world, (seq, balanced, heads, head_dim, size))
            seconds = [r["total"] for r in ranks]
            print(f"{'balanced' if balanced else 'contiguous':<12}{str(size):>8}{str(calls):>16}"
                  f"{str([round(c / 1e6, 2) for c in computed]):>30}{str([round(v / 1e6, 2) for v in visible]):>30}"
                  f"{max(computed) / (sum(computed) / world):>10.2f}{str([round(t, 3) for t in seconds]):>30}"
                  f"{max(seconds) / (sum(seconds) / world):>10.2f}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("part", choices=("sp", "cp", "ring", "window"))
    parser.add_argument("--window", type=int, default=1024)
    parser.add_argument("--seq", type=int, default=8192)
    parser.add_argument("--cps", type=lambda s: [int(x) for x in s.split(",")], default=[1, 2, 4])
    parser.add_argument("--out", default="results/cp_ring_timeline.png")
    args = parser.parse_args()
    {"sp": sp, "cp": cp, "ring": ring, "window": window}[args.part](args)


if __name__ == "__main__":
    main()
