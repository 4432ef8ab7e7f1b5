"""Expert parallelism on a tiny Qwen3-MoE: against replicated experts and expert-TP, its all-to-all
bytes against theory, and the load on each ep rank while training.

    python benchmarks/experts.py compare   # 2 ranks: dp=2 (experts replicated) | dp=2 ep=2 (all-to-all, all-gather
                                           # dispatch) | tp=2 (expert-TP)
    python benchmarks/experts.py bytes     # dp=2 ep=2: all-to-all bytes per step vs theory, off-rank rows counted
    python benchmarks/experts.py load      # 50 steps on the LM results config's data, tiny-qwen3-moe at dp=2 ep=2

compare: the same model (same weights, same global batches, AdamW) in one world of 2 gloo ranks with
one thread each, the three layouts taking turns step by step so that none always runs on a warmer
or busier machine; step time is the median of the timed steps (after warm-up steps), and one more
step per layout, not timed, is metered with ``CommMeter`` (calls and payload bytes per group and
op, rank 0). bytes: a forward pre-hook on every experts module sees ``(hidden_states,
top_k_index, top_k_weights)`` before the dispatch, so it counts the (token, expert) pairs whose
expert another rank owns; CommMeter's payload of each all-to-all is this rank's whole input, the
rows it keeps for its own experts included, while only the off-rank rows cross the wire. load
(expert_load.py): tokens routed to each ep rank's experts per step (summed over layers and dp
ranks), plotted to results/expert_load.png. Run from the repository root.
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

import torch
import torch.distributed as dist
from expert_load import load, route_counter
from world import run_world

CONFIG = dict(hidden_size=256, intermediate_size=512, moe_intermediate_size=256, num_experts=8, num_experts_per_tok=2,
              num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2, head_dim=64, vocab_size=512,
              max_position_embeddings=256, norm_topk_prob=True, output_router_logits=False, tie_word_embeddings=False)
LAYOUTS = {"plain dp=2": dict(dp=2), "ep=2 dp=2": dict(dp=2, ep=2),
           "ep=2 dp=2 all_gather": dict(dp=2, ep=2, expert_dispatch="all_gather"), "expert-TP tp=2": dict(tp=2)}
FLOAT = 4  # bytes per element: float32 throughout


def _model():
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)  # the same weights in every layout and on every rank
        return Qwen3MoeForCausalLM(Qwen3MoeConfig(**CONFIG))


def _batches(n: int, *, rows: int, seq: int) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(1)
    return [torch.randint(0, CONFIG["vocab_size"], (rows, seq), generator=gen) for _ in range(n)]


def _local(ids: torch.Tensor, pm) -> dict[str, torch.Tensor]:
    per = ids.shape[0] // pm.dims.dp
    mine = ids[pm.coords["dp"] * per : (pm.coords["dp"] + 1) * per]
    return {"input_ids": mine, "labels": mine.clone()}


def _replay(pm, events: list, *, repeats: int = 5) -> float:
    """Median seconds of one step's collectives alone: rank 0's metered calls issued again in order
    with the same payloads (every rank uses rank 0's sizes so that the calls pair up; an all-to-all
    gets even splits here, the router's uneven ones in the step)."""
    # the hosts' per-step agreement (point-to-point on "host", the same in every layout) is left out
    calls = [(e.group, e.op, e.numel, e.nbytes // max(e.numel, 1)) for e in events if e.group != "host"]
    box = [calls]
    dist.broadcast_object_list(box, src=0)
    tensors = [(getattr(pm.groups, g), op, torch.zeros(n, dtype=torch.int64 if size == 8 else torch.float32))
               for g, op, n, size in box[0]]
    times = []
    for _ in range(repeats):
        dist.barrier()
        start = time.perf_counter()
        for group, op, x in tensors:
            if op == "all_reduce":
                dist.all_reduce(x, group=group)
            elif op == "all_to_all_single":
                dist.all_to_all_single(torch.empty_like(x), x, group=group)
            elif op == "all_gather_into_tensor":  # the all-gather dispatch
                dist.all_gather_into_tensor(x.new_empty(x.numel() * dist.get_world_size(group)), x, group=group)
            else:
                raise NotImplementedError(op)
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def _experts_clock(pm) -> list[float]:
    """Seconds spent inside the experts modules' forward (summed over layers; under ep the dispatch
    and its all-to-alls, under expert-TP the output all-reduce included), appended per call; two
    clock reads per layer, cheap enough for timed steps."""
    from qn_hf.expert_parallel.apply import experts_modules

    spent: list[float] = []
    started: list[float] = []
    for module in experts_modules(pm.module).values():
        module.register_forward_pre_hook(lambda *_: started.append(time.perf_counter()))
        module.register_forward_hook(lambda *_: spent.append(time.perf_counter() - started.pop()))
    return spent


def compare_worker(rank: int, world: int, args: argparse.Namespace) -> dict:
    import qn_hf
    from qn_hf.expert_parallel.apply import experts_modules

    data = _batches(args.warmup + args.steps, rows=args.rows, seq=args.seq)
    runs = {}
    for name, layout in LAYOUTS.items():
        pm = qn_hf.parallelize(_model(), seed=0, **layout)
        runs[name] = (pm, torch.optim.AdamW(pm.parameters(), lr=1e-4), _experts_clock(pm))
    times: dict[str, list[float]] = {name: [] for name in LAYOUTS}
    experts: dict[str, list[float]] = {name: [] for name in LAYOUTS}
    # The layouts take turns step by step (the first of each turn rotating), so that load from other
    # processes on the cores falls on all three alike and each step has a same-time pair.
    for i, ids in enumerate(data):
        order = list(LAYOUTS)[i % len(LAYOUTS):] + list(LAYOUTS)[: i % len(LAYOUTS)]
        for name in order:
            pm, opt, spent = runs[name]
            batch = _local(ids, pm)
            dist.barrier()
            start = time.perf_counter()
            opt.zero_grad()
            pm.train_step(batch)
            opt.step()
            if i >= args.warmup:
                times[name].append(time.perf_counter() - start)
                experts[name].append(sum(spent))
            spent.clear()
    report: dict[str, dict] = {}
    for name, (pm, opt, _) in runs.items():  # one more step each, metered and not timed
        opt.zero_grad()
        with qn_hf.CommMeter(pm) as meter:
            pm.train_step(_local(data[0], pm))
        weights = sum(p.numel() * p.element_size() for p in pm.parameters())
        experts_held = sum(p.numel() * p.element_size() for m in experts_modules(pm.module).values()
                           for p in m.parameters())
        report[name] = {"totals": meter.totals(), "weights": weights, "experts": experts_held,
                        "alone": _replay(pm, meter.events)}
    return {"times": times, "experts": experts, "report": report}


def _theory(name: str, report: dict, *, tokens: int) -> int:
    """Payload bytes one step must hand to collectives on rank 0, from the layout of the math (T
    tokens on this rank, float32). plain: every gradient once (dp). ep: the gradients of all but
    the experts (dp, the experts' blocks are whole on their one owner) and the token all-to-alls,
    T x top_k rows of hidden each way per layer forward and backward at uniform routing, plus one
    int64 count per expert and layer. expert-TP: per layer the attention's and the experts' output
    forward and their inputs' gradients backward, [T, hidden] each; the embedding's output and the
    head input's gradient; 3 floats per token for the vocabulary-parallel loss; per layer the
    routing weights' gradient [T, top_k] (each rank's experts give a partial one) and the q/k norms'
    gradients. ep with the all-gather dispatch (ep members, this rank's inputs as CommMeter counts them):
    per layer forward the gather of [T, hidden], of the int64 choices and the routing weights [T, top_k]
    and the partial outputs [ep*T, hidden] summed back by an all-to-all; backward the sums of the
    gathered rows' and weights' gradients ([ep*T, hidden], [ep*T, top_k]) and the gather of the
    outputs' gradient [T, hidden]; no counts."""
    h, k, layers, experts = (CONFIG[n] for n in ("hidden_size", "num_experts_per_tok", "num_hidden_layers",
                                                  "num_experts"))
    if name.startswith("plain"):
        return report["weights"]
    if name.endswith("all_gather"):
        ep = 2
        per_layer = (2 * tokens * h + 2 * ep * tokens * h + ep * tokens * k) * FLOAT + tokens * k * (8 + FLOAT)
        return report["weights"] - report["experts"] + layers * per_layer
    if name.startswith("ep"):
        return report["weights"] - report["experts"] + 4 * layers * tokens * k * h * FLOAT + layers * experts * 8
    act = tokens * h * FLOAT
    return (4 * layers + 2) * act + 3 * tokens * FLOAT + layers * (tokens * k + 2 * CONFIG["head_dim"]) * FLOAT


def compare(args: argparse.Namespace) -> None:
    before = os.getloadavg()[0]
    out = run_world(compare_worker, world=2, extra=(args,))
    tokens = args.rows * args.seq
    print(f"Qwen3-MoE {CONFIG['num_hidden_layers']} layers, hidden {CONFIG['hidden_size']}, {CONFIG['num_experts']} "
          f"experts of width {CONFIG['moe_intermediate_size']}, top-{CONFIG['num_experts_per_tok']}, vocab "
          f"{CONFIG['vocab_size']}, float32; global batch {args.rows} x {args.seq} = {tokens} tokens per step (dp=2: "
          f"{tokens // 2} per rank; tp=2: all {tokens} on both); 2 gloo ranks x 1 thread on {os.cpu_count()} cores; "
          f"AdamW; {args.steps} timed steps per layout after {args.warmup} warm-up steps, the layouts taking turns "
          f"step by step; 1-minute load average {before:.1f} before, {os.getloadavg()[0]:.1f} after")
    plain = out["times"]["plain dp=2"]
    base_bytes = sum(t.nbytes for t in out["report"]["plain dp=2"]["totals"].values())
    base_weights = out["report"]["plain dp=2"]["weights"]
    print(f"{'layout':<22}{'median s':>10}{'best s':>8}{'vs plain':>10}{'experts fwd s':>15}{'comm MiB':>10}"
          f"{'theory':>8}{'vs plain':>10}{'calls':>7}{'comm alone s':>14}{'weights MiB':>13}{'vs plain':>10}")
    for name in LAYOUTS:
        steps, report = out["times"][name], out["report"][name]
        paired = statistics.median(t / p for t, p in zip(steps, plain))
        nbytes = sum(t.nbytes for t in report["totals"].values())
        calls = sum(t.calls for t in report["totals"].values())
        theory = _theory(name, report, tokens=tokens if name.startswith("expert-TP") else tokens // 2)
        print(f"{name:<22}{statistics.median(steps):>10.3f}{min(steps):>8.3f}{paired:>10.2f}"
              f"{statistics.median(out['experts'][name]):>15.3f}{nbytes / 2**20:>10.2f}{theory / 2**20:>8.2f}"
              f"{nbytes / base_bytes:>10.2f}"
              f"{calls:>7}{report['alone']:>14.3f}{report['weights'] / 2**20:>13.2f}"
              f"{report['weights'] / base_weights:>10.2f}")
    print("vs plain: median over the steps of (this layout's step / plain's step of the same turn). experts fwd s: "
          "inside the experts modules' forward per step, all layers (ep: sort, dispatch, all-to-alls, local experts, "
          "combine; expert-TP: half-width experts on every token and the output all-reduce). comm MiB, calls: one "
          "metered step, rank 0 (CommMeter: this rank's input to each call); theory: the payload the layout of the math needs "
          "(_theory in this file; ep at uniform routing). comm alone s: those calls replayed with "
          "no compute. plain's dp all-reduces run in buckets during backward; ep's all-to-alls and expert-TP's tp "
          "all-reduces stop the step where they stand")
    print("traffic of one step, rank 0:")
    print(f"{'layout':<22}{'group':<9}{'op':<24}{'calls':>7}{'MiB':>10}")
    for name in LAYOUTS:
        for (group, op), t in out["report"][name]["totals"].items():
            print(f"{name:<22}{group:<9}{op:<24}{t.calls:>7}{t.nbytes / 2**20:>10.3f}")


def bytes_worker(rank: int, world: int, args: argparse.Namespace) -> list[dict]:
    import qn_hf

    pm = qn_hf.parallelize(_model(), dp=2, ep=2, seed=0)
    ids = _batches(1, rows=args.rows, seq=args.seq)[0]
    pm.train_step(_local(ids, pm))  # warm-up, not counted
    counts = route_counter(pm, experts=CONFIG["num_experts"])
    with qn_hf.CommMeter(pm) as meter:
        pm.train_step(_local(ids, pm))
    routed = torch.stack(counts)  # [layer, expert]: pairs this rank routes
    everyone = [torch.empty_like(routed) for _ in range(world)]
    dist.all_gather(everyone, routed)
    ep, local = pm.dims.ep, CONFIG["num_experts"] // pm.dims.ep
    mine = slice(pm.coords["ep"] * local, (pm.coords["ep"] + 1) * local)
    sent = routed.sum(1)  # per layer: pairs this rank sends into the dispatch, kept ones included
    kept = routed[:, mine].sum(1)
    received = sum(e[:, mine].sum(1) for e in everyone)  # rows this rank's experts get, kept ones included
    # CommMeter reports every all-to-all alike: the counts are int64 (8 bytes an element), the rows
    # float32. With one microbatch and one stage the first 2 token all-to-alls of each layer are forward.
    ep_events = [e for e in meter.events if e.group == "ep"]
    is_count = [e.numel > 0 and e.nbytes // e.numel == 8 for e in ep_events]
    rows = [e for e, c in zip(ep_events, is_count) if not c]
    layers = CONFIG["num_hidden_layers"]
    mine_out = {
        "rank": rank, "ep": ep, "tokens": ids.shape[0] // pm.dims.dp * args.seq,
        "sent": sent.sum().item(), "kept": kept.sum().item(), "received": received.sum().item(),
        "forward": sum(e.nbytes for e in rows[: 2 * layers]), "backward": sum(e.nbytes for e in rows[2 * layers:]),
        "row_calls": (len(rows[: 2 * layers]), len(rows[2 * layers:])),
        "counts": [e.nbytes for e, c in zip(ep_events, is_count) if c],
        "others": {k: v for k, v in meter.totals().items() if k[0] != "ep"},
    }
    gathered: list = [None] * world
    dist.all_gather_object(gathered, mine_out)
    return gathered


def bytes_mode(args: argparse.Namespace) -> None:
    ranks = run_world(bytes_worker, world=2, extra=(args,))
    h, k, layers, experts = (CONFIG[n] for n in ("hidden_size", "num_experts_per_tok", "num_hidden_layers",
                                                  "num_experts"))
    ep = ranks[0]["ep"]
    print(f"Qwen3-MoE as in compare ({layers} MoE layers, {experts} experts, top-{k}, hidden {h}, float32) at dp=2 "
          f"ep=2, one microbatch of {args.rows // 2} x {args.seq} per rank; one train step after a warm-up step")
    print("theory per layer and rank, T tokens: the dispatch and the return each move T x top_k rows of hidden x 4 "
          "bytes, forward and backward (4 all-to-alls); under uniform routing (ep-1)/ep of the rows are off-rank")
    print("routing counted by the pre-hooks (all layers): pairs = T x top_k x layers this rank routes; kept = to its "
          "own experts; off-rank = pairs - kept (share measured vs (ep-1)/ep); recv = pairs its experts take from "
          "both ranks")
    print(f"{'rank':>4}{'T':>6}{'pairs':>8}{'kept':>8}{'off-rank':>10}{'share':>7}{'theory':>8}{'recv':>8}")
    for r in ranks:
        off = r["sent"] - r["kept"]
        print(f"{r['rank']:>4}{r['tokens']:>6}{r['sent']:>8}{r['kept']:>8}{off:>10}{off / r['sent']:>7.3f}"
              f"{(ep - 1) / ep:>8.3f}{r['received']:>8}")
    print("all-to-alls of the step, bytes: CommMeter's payload (this rank's whole input); the same from the routers' "
          "counts ((pairs + recv) rows x hidden x 4: the dispatch sends its pairs, the return its recv rows, backward "
          "the reverse); the uniform theory 2 x T x top_k x hidden x 4 per layer; and the off-rank bytes this rank "
          "puts on the wire ((pairs - kept) + (recv - kept) rows) against (ep-1)/ep of the theory")
    print(f"{'rank':>4}  {'all-to-all':<16}{'calls':>6}{'CommMeter':>14}{'from routers':>14}{'theory':>14}"
          f"{'off-rank':>14}{'theory':>14}")
    row = h * FLOAT
    for r in ranks:
        tokens, sent, kept, received = r["tokens"], r["sent"], r["kept"], r["received"]
        theory = 2 * tokens * k * layers * row
        predicted = (sent + received) * row
        off = (sent - kept + received - kept) * row
        assert predicted == r["forward"] == r["backward"], (predicted, r)
        for i, kind in enumerate(("forward", "backward")):
            print(f"{r['rank']:>4}  {'tokens ' + kind:<16}{r['row_calls'][i]:>6}{r[kind]:>14,}{predicted:>14,}"
                  f"{theory:>14,}{off:>14,}{theory * (ep - 1) // ep:>14,}")
        counts = layers * experts * 8
        print(f"{r['rank']:>4}  {'counts forward':<16}{len(r['counts']):>6}{sum(r['counts']):>14,}{counts:>14,}"
              f"{counts:>14,}{counts * (ep - 1) // ep:>14,}{counts * (ep - 1) // ep:>14,}")
    print(f"CommMeter counts each all-to-all's whole input, the rows a rank keeps for its own experts included "
          f"(all_to_all_single copies them locally); only the off-rank bytes cross the wire, (ep-1)/ep = "
          f"{(ep - 1) / ep:.2f} of the payload under uniform routing. The counts are int64 [ep, experts/ep] = "
          f"{experts * 8} bytes per layer, exchanged in forward only (backward reuses the splits).")
    print("other traffic of the step, rank 0: " + ", ".join(f"{g} {op} {t.calls} x {t.nbytes / 2**20:.2f} MiB"
                                                          for (g, op), t in ranks[0]["others"].items()))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("mode", choices=("compare", "bytes", "load"))
    parser.add_argument("--rows", type=int, default=8, help="global batch rows (compare, bytes)")
    parser.add_argument("--seq", type=int, default=256, help="tokens per row (compare, bytes)")
    parser.add_argument("--steps", type=int, default=None, help="timed steps per layout (compare, default 20); "
                                                                 "training steps (load, default 50)")
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--config", default="configs/llama_tiny.yaml", help="the LM results config (load)")
    parser.add_argument("--out", default="results/expert_load.png", help="the load plot (load)")
    args = parser.parse_args()
    if args.steps is None:
        args.steps = 50 if args.mode == "load" else 20
    {"compare": compare, "bytes": bytes_mode, "load": load}[args.mode](args)


if __name__ == "__main__":
    main()
