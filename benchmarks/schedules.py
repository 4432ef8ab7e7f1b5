"""Pipeline schedules side by side: measured bubble against theory, qn_hf's interleaved 1F1B and
ZB-H1 against torch.distributed.pipelining's, and peak activation memory per schedule.

    python benchmarks/schedules.py bubble [--microbatches 16] [--steps 3] [--rounds 2]
    python benchmarks/schedules.py torch  [--steps 3] [--rounds 2]
    python benchmarks/schedules.py memory [--steps 2]

One run per command: pp CPU processes over gloo, one intra-op thread each (more threads than
cores make every timing meaningless), every variant in the same run, in alternating rounds so
a change in the machine's load hits all of them alike. The model is benchmarks/pipeline.py's
8-layer Llama with a 256-token vocabulary: the last chunk's extra work (final norm, LM head,
loss) is then a few per cent of a block, so chunks are balanced and a measured bubble can be
held against the equal-cost theory; the F and B times per chunk are printed to show how balanced.

* bubble: 1 - busy / span per rank, busy = time in fwd + bwd + wgt actions, span = first action's
  start to last action's end of a step (qn_hf's recorded ``StageEvent``s). Theory: the closed
  forms for equal costs, and ``schedule_check.timed`` fed with the mean F, B, W measured in that
  very run (the honest theory: real B is about 2F, not F). Writes one step's timeline per schedule.
* torch: train steps/s of qn_hf's interleaved_1f1b (V=2) against ``ScheduleInterleaved1F1B`` and
  of qn_hf's zb_h1 against ``ScheduleInterleavedZeroBubble`` with one stage per rank; torch drives
  qn_hf's own chunk modules (one ``PipelineStage`` per chunk), so only the schedule runtime differs.
* memory: per rank, the peak bytes held for a later pass during a step: tensors autograd saved for
  backward plus, for zb_h1, the W stash (the (x, g) pairs the weight-gradient queue holds), each
  storage counted once however many holders it has, parameters excluded.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import re
import statistics
import tempfile
import time
import weakref
from collections import Counter, defaultdict
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn.functional as F
from pipeline import CONFIG as PIPELINE_CONFIG
from pipeline import make_batches as pipeline_batches
from world import run_world

CONFIG = dict(PIPELINE_CONFIG, vocab_size=256)
LAYERS = CONFIG["num_hidden_layers"]
# name -> (qn_hf schedule, virtual stages)
VARIANTS = {"1f1b": ("1f1b", 1), "interleaved_1f1b": ("interleaved_1f1b", 2), "zb_h1": ("zb_h1", 1),
            "gpipe": ("gpipe", 1)}
COMPUTE = ("fwd", "bwd", "wgt")
PNG = {"1f1b": "timeline_1f1b_balanced.png", "interleaved_1f1b": "timeline_interleaved.png",
       "zb_h1": "timeline_zb_h1.png"}


def build(path: str, *, pp: int, microbatches: int, variant: str):
    from transformers import LlamaForCausalLM

    import qn_hf

    schedule, virtual = VARIANTS[variant]
    chunks = pp * virtual
    # equal blocks per chunk; the last chunk's head is small at this vocabulary
    layers = [LAYERS // chunks] * chunks if LAYERS % chunks == 0 else None
    return qn_hf.parallelize(LlamaForCausalLM.from_pretrained(path), pp=pp, microbatches=microbatches,
                             schedule=schedule, virtual_stages=virtual, layers_per_stage=layers, seed=0)


class HeldBytes:
    """Live and peak bytes of the storages held for a later pass, per holder ("saved": autograd's
    saved tensors; "stash": the W queue's (x, g)) and for their union, each storage once."""

    def __init__(self, params) -> None:
        self.params = {p.untyped_storage().data_ptr() for p in params}
        self.held: dict[int, tuple[int, Counter]] = {}
        self.live = {"saved": 0, "stash": 0, "union": 0}
        self.peak = dict(self.live)

    def add(self, t: torch.Tensor, holder: str) -> int | None:
        ptr = t.untyped_storage().data_ptr()
        if ptr in self.params or not t.untyped_storage().nbytes():
            return None
        nbytes, counts = self.held.setdefault(ptr, (t.untyped_storage().nbytes(), Counter()))
        if not counts:
            self.live["union"] += nbytes
        if not counts[holder]:
            self.live[holder] += nbytes
        counts[holder] += 1
        self.peak = {k: max(self.peak[k], self.live[k]) for k in self.live}
        return ptr

    def drop(self, ptr: int, holder: str) -> None:
        nbytes, counts = self.held[ptr]
        counts[holder] -= 1
        if not counts[holder]:
            del counts[holder]
            self.live[holder] -= nbytes
        if not counts:
            self.live["union"] -= nbytes
            del self.held[ptr]

    def hooks(self):
        def pack(t):
            ptr = self.add(t, "saved")
            if ptr is None:
                return t
            token = Token()  # dies with the graph node that saved t: the saved tensor is released
            weakref.finalize(token, self.drop, ptr, "saved")
            return (t, token)

        return torch.autograd.graph.saved_tensors_hooks(pack, lambda p: p[0] if isinstance(p, tuple) else p)

    def watch_stash(self, queue) -> None:
        """Count what ``queue`` (a WeightGradQueue) holds from ``defer`` until its ``run``."""
        keys: dict[object, list[int]] = defaultdict(list)
        defer, run = queue.defer, queue.run

        def counted_defer(key, entry):
            keys[key] += [p for p in (self.add(entry.x, "stash"), self.add(entry.grad, "stash")) if p is not None]
            defer(key, entry)

        def counted_run(key):
            run(key)
            for ptr in keys.pop(key, []):
                self.drop(ptr, "stash")

        queue.defer, queue.run = counted_defer, counted_run


class Token:
    pass


def run_qn(pm, data, *, warmup: int, meter: HeldBytes | None = None) -> dict:
    opt = torch.optim.SGD(pm.parameters(), lr=1e-3)
    out = {"times": [], "bubbles": [], "durations": defaultdict(list), "losses": [], "events": []}
    for i, batch in enumerate(data):
        pm.executor.events = []
        opt.zero_grad()
        dist.barrier()
        start = time.perf_counter()
        if meter is not None and i == warmup:
            meter.peak = dict(meter.live)
        with meter.hooks() if meter is not None else contextlib.nullcontext():
            loss = pm.train_step(batch)
        opt.step()
        elapsed = time.perf_counter() - start
        out["losses"].append(loss.item())
        if i < warmup:
            continue
        events = [(str(e.op), e.chunk, e.mb, e.start, e.stop) for e in pm.executor.events]
        busy = sum(stop - begin for op, _, _, begin, stop in events if op in COMPUTE)
        out["bubbles"].append(1 - busy / (events[-1][4] - events[0][3]))
        out["times"].append(elapsed)
        for op, chunk, _, begin, stop in events:
            if op in COMPUTE:
                out["durations"][op, chunk].append(stop - begin)
        out["events"] = events
    pm.executor.events = None
    if meter is not None:
        out["peak"] = dict(meter.peak)
    out["durations"] = dict(out["durations"])
    return out


class ChunkModule(torch.nn.Module):
    """One qn_hf chunk as torch's PipelineStage sees it: qn_hf's forward of that chunk, and only that
    chunk's parameters (torch's split backward asks the stage module for its weights)."""

    def __init__(self, pm, chunk: int) -> None:
        super().__init__()
        plan = pm.stage.plan
        mine = []
        for name, p in pm.module.named_parameters():
            block = re.search(r"layers\.(\d+)\.", name)
            # blocks by their range; the rank's entry (chunk 0) or head (last chunk) go to that chunk
            ends = 0 if 0 in pm.stage.chunks else plan.chunks - 1
            owner = plan.chunk_of_layer(int(block.group(1))) if block else ends
            if owner == chunk:
                mine.append(p)
        self.weights = torch.nn.ParameterList(mine)
        self.run = pm.stage.forward
        self.chunk, self.first, self.last = chunk, chunk == 0, pm.stage.is_last_chunk(chunk)

    def forward(self, x):
        # chunk 0 gets token ids; later chunks the hidden state, positions rebuilt from its shape
        ids = x if self.first else torch.zeros(x.shape[:2], dtype=torch.long)
        out = self.run({"input_ids": ids}, None if self.first else x, chunk=self.chunk, use_cache=False)
        return out.logits if self.last else out


def run_torch(pm, data, *, warmup: int, microbatches: int, zero_bubble: bool) -> dict:
    from torch.distributed.pipelining import PipelineStage, ScheduleInterleaved1F1B, ScheduleInterleavedZeroBubble

    def loss_fn(logits, labels):
        # the microbatch's mean over its targets / M, summed over microbatches = the batch mean
        # (qn_hf's loss); scale_grads=False so torch does not divide the gradients again
        return F.cross_entropy(logits[:, :-1].flatten(0, 1).float(), labels[:, 1:].flatten()) / microbatches

    chunks = pm.stage.plan.chunks
    stages = [PipelineStage(ChunkModule(pm, c), c, chunks, torch.device("cpu"), group=None) for c in pm.stage.chunks]
    kind = ScheduleInterleavedZeroBubble if zero_bubble else ScheduleInterleaved1F1B
    schedule = kind(stages, n_microbatches=microbatches, loss_fn=loss_fn, scale_grads=False)
    opt = torch.optim.SGD(pm.parameters(), lr=1e-3)
    out = {"times": [], "losses": []}
    pm.module.train()
    for i, batch in enumerate(data):
        opt.zero_grad()
        dist.barrier()
        start = time.perf_counter()
        losses: list[torch.Tensor] = []
        if pm.stage.is_first:
            schedule.step(batch["input_ids"])
        else:
            schedule.step(target=batch["labels"], losses=losses)
        opt.step()
        elapsed = time.perf_counter() - start
        out["losses"].append(sum(x.item() for x in losses) if losses else None)
        if i >= warmup:
            out["times"].append(elapsed)
    return out


def worker(rank: int, pp: int, path: str, args: argparse.Namespace) -> str | None:
    torch.set_num_threads(1)
    M = args.microbatches
    data = pipeline_batches(args.steps + 1, batch=args.batch, seq=args.seq, vocab=CONFIG["vocab_size"])
    out: dict[str, list[dict]] = defaultdict(list)
    for _ in range(args.rounds):
        if args.command == "bubble":
            for variant in ("1f1b", "interleaved_1f1b", "zb_h1"):
                out[variant].append(run_qn(build(path, pp=pp, microbatches=M, variant=variant), data, warmup=1))
        elif args.command == "memory":
            for variant in ("1f1b", "interleaved_1f1b", "zb_h1", "gpipe"):
                pm = build(path, pp=pp, microbatches=M, variant=variant)
                meter = HeldBytes(pm.parameters())
                if pm.executor.weights is not None:
                    meter.watch_stash(pm.executor.weights)
                out[variant].append(run_qn(pm, data, warmup=1, meter=meter))
        else:
            for variant, zero_bubble in (("interleaved_1f1b", False), ("zb_h1", True)):
                pm = build(path, pp=pp, microbatches=M, variant=variant)
                out[f"qn_hf {variant}"].append(run_qn(pm, data, warmup=1))
                # torch's own split backward: plain Linear layers (qn_hf's 1f1b build of the same cut)
                twin = "1f1b" if zero_bubble else variant
                pm = build(path, pp=pp, microbatches=M, variant=twin)
                name = "torch " + ("ScheduleInterleavedZeroBubble" if zero_bubble else "ScheduleInterleaved1F1B")
                out[name].append(run_torch(pm, data, warmup=1, microbatches=M, zero_bubble=zero_bubble))
    gathered = [None] * pp
    dist.all_gather_object(gathered, dict(out))
    return gathered if rank == 0 else None


def rate(runs: list[dict]) -> float:
    """Median over rounds of a round's steps per second."""
    return statistics.median(len(r["times"]) / sum(r["times"]) for r in runs)


def chunk_means(runs: list[dict]) -> dict[tuple[str, int], float]:
    """Mean seconds of each (op, chunk)'s actions, pooled over rounds and measured steps."""
    acc: dict[tuple[str, int], list[float]] = defaultdict(list)
    for r in runs:
        for key, seconds in r["durations"].items():
            acc[key] += seconds
    return {key: statistics.mean(v) for key, v in acc.items()}


def write_timeline(path: Path, runs_per_rank: list[list[dict]], *, title: str) -> None:
    """The last measured step of the last round, both ranks on one clock (perf_counter is the
    system's monotonic clock, which the processes share)."""
    from qn_hf.training.plots import pipeline_timeline

    events = [runs[-1]["events"] for runs in runs_per_rank]
    origin = min(e[0][3] for e in events)
    ranks = [(f"rank {s}", [(op, c, mb, a - origin, b - origin) for op, c, mb, a, b in evs])
             for s, evs in enumerate(events)]
    pipeline_timeline(str(path), ranks=ranks, title=title)


def report_bubble(per_rank: list[dict], args) -> None:
    from qn_hf.pipeline.schedule import Op, schedule_actions
    from qn_hf.pipeline.schedule_check import timed

    P, M = args.pp, args.microbatches
    V = VARIANTS["interleaved_1f1b"][1]
    closed = {"1f1b": ("(P-1)/(M+P-1)", (P - 1) / (M + P - 1)),
              "interleaved_1f1b": ("(P-1)/(VM+P-1)", (P - 1) / (V * M + P - 1)),
              "zb_h1": ("(P-1)/(3M+P-1)", (P - 1) / (3 * M + P - 1))}
    print(f"{'schedule':<18}{'measured bubble per rank':<28}{'equal-cost theory':<26}"
          f"{'timed(measured F,B,W) per rank':<32}{'steps/s':>8}")
    for variant, (form, value) in closed.items():
        schedule, virtual = VARIANTS[variant]
        runs = [per_rank[s][variant] for s in range(P)]
        measured = [statistics.median(b for r in rank_runs for b in r["bubbles"]) for rank_runs in runs]
        times = {key: t for rank_runs in runs for key, t in chunk_means(rank_runs).items()}
        ops = [op for op in COMPUTE if any(o == op for o, _ in times)]
        mean = {op: statistics.mean(t for (o, _), t in times.items() if o == op) for op in ops}
        actions = schedule_actions(stages=P, microbatches=M, schedule=schedule, virtual_stages=virtual)
        theory = timed(actions, costs={Op(op): mean[op] for op in ops}).bubble
        print(f"{variant:<18}{str([round(b, 3) for b in measured]):<28}{f'{form} = {value:.3f}':<26}"
              f"{str([round(b, 3) for b in theory]):<32}{rate(runs[0]):>8.3f}")
        for op in ops:
            row = {c: t for (o, c), t in sorted(times.items()) if o == op}
            cells = "  ".join(f"c{c} {1e3 * t:6.1f}" for c, t in row.items())
            print(f"    {op} ms per chunk: {cells}   (max/min {max(row.values()) / min(row.values()):.2f}; "
                  f"mean {1e3 * mean[op]:.1f})")
        png = Path(args.out) / PNG[variant]
        write_timeline(png, runs, title=f"qn_hf {variant} (V={virtual}), pp={P}, M={M}: one train step")
        print(f"    timeline: {png}")


def report_torch(per_rank: list[dict], args) -> None:
    last = per_rank[-1]
    rates = {v: rate(per_rank[0][v]) for v in per_rank[0]}
    for variant, r in rates.items():
        losses = [f"{x:.8f}" for x in last[variant][0]["losses"][:2]]
        rounds = ", ".join(f"{len(x['times']) / sum(x['times']):.3f}" for x in per_rank[0][variant])
        print(f"{variant:<36} {r:.3f} steps/s (rounds: {rounds})   losses of steps 0, 1: {', '.join(losses)}")
    for ours, theirs in (("interleaved_1f1b", "ScheduleInterleaved1F1B"), ("zb_h1", "ScheduleInterleavedZeroBubble")):
        print(f"ratio qn_hf {ours} / torch {theirs} = {rates['qn_hf ' + ours] / rates['torch ' + theirs]:.2f}x")


def report_memory(per_rank: list[dict], args) -> None:
    from qn_hf.pipeline.schedule import schedule_actions
    from qn_hf.pipeline.schedule_check import peaks

    P, M, mib = args.pp, args.microbatches, 1024 * 1024
    print(f"{'schedule':<18}{'rank':>4}{'saved MiB':>11}{'stash MiB':>11}{'union MiB':>11}{'F->B':>6}{'F->W':>6}"
          f"{'blocks held':>12}{'MiB/block-mb':>14}")
    for variant in ("gpipe", "1f1b", "interleaved_1f1b", "zb_h1"):
        schedule, virtual = VARIANTS[variant]
        actions = schedule_actions(stages=P, microbatches=M, schedule=schedule, virtual_stages=virtual)
        for s in range(P):
            peak = {k: statistics.median(r["peak"][k] for r in per_rank[s][variant]) / mib
                    for k in ("saved", "stash", "union")}
            count = peaks(actions[s])
            blocks = count.f_to_b * LAYERS // (P * virtual)  # (block, microbatch) pairs whose activations are held
            print(f"{variant:<18}{s:>4}{peak['saved']:>11.1f}{peak['stash']:>11.1f}{peak['union']:>11.1f}"
                  f"{count.f_to_b:>6}{count.f_to_w:>6}{blocks:>12}{peak['saved'] / blocks:>14.2f}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("command", choices=("bubble", "torch", "memory"))
    parser.add_argument("--pp", type=int, default=2)
    parser.add_argument("--microbatches", type=int, default=16)
    parser.add_argument("--batch", type=int, default=32, help="global batch (microbatch = batch / microbatches)")
    parser.add_argument("--seq", type=int, default=128)
    parser.add_argument("--steps", type=int, default=3, help="measured steps per round (after one warm-up step)")
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--out", default=str(Path(__file__).resolve().parents[1] / "results"), help="where PNGs go")
    args = parser.parse_args()

    from transformers import LlamaConfig, LlamaForCausalLM

    path = tempfile.mkdtemp(prefix="qn_hf_schedules_")
    torch.manual_seed(0)
    LlamaForCausalLM(LlamaConfig(**CONFIG)).save_pretrained(path)
    load = os.getloadavg()
    start = time.perf_counter()
    per_rank = run_world(worker, world=args.pp, extra=(path, args))
    print(f"Llama {LAYERS} layers, hidden {CONFIG['hidden_size']}, vocab {CONFIG['vocab_size']}; "
          f"batch {args.batch}x{args.seq}, M={args.microbatches}, pp={args.pp} gloo ranks x 1 thread on "
          f"{os.cpu_count()} cores; {args.rounds} rounds x {args.steps} measured steps; 1-min load average "
          f"before {load[0]:.2f}, after {os.getloadavg()[0]:.2f}; {time.perf_counter() - start:.0f} s")
    {"bubble": report_bubble, "torch": report_torch, "memory": report_memory}[args.command](per_rank, args)


if __name__ == "__main__":
    main()
