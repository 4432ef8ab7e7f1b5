"""Pipeline parallelism: activation memory (1F1B vs GPipe), measured bubble, and train steps per
second of qn_hf's 1F1B against ``torch.distributed.pipelining.Schedule1F1B`` on the same split.

    python benchmarks/pipeline.py [--pp 2] [--microbatches 16] [--steps 3] [--rounds 2]

One run, ``pp`` CPU processes over gloo, each with ``cores // pp`` intra-op threads, a Llama cut
into ``pp`` even stages by qn_hf. The torch variant drives the very same stage modules (qn_hf's
split) with ``PipelineStage`` + ``Schedule1F1B``, so only the schedule runtime differs.

* Activation memory: bytes of tensors autograd saves for backward (parameters excluded), counted
  by ``saved_tensors_hooks`` while they are alive; the peak on stage 0 over a step.
* Bubble: 1 - (time in forward/backward compute) / (step time) per stage, from qn_hf's recorded
  timeline, against the theoretical (P-1)/(M+P-1).
"""

from __future__ import annotations

import argparse
import os
import statistics
import tempfile
import time
import weakref

import torch
import torch.distributed as dist
import torch.nn.functional as F
from world import run_world

CONFIG = dict(hidden_size=256, intermediate_size=688, num_hidden_layers=8, num_attention_heads=8, num_key_value_heads=4,
              vocab_size=2048, max_position_embeddings=256, bos_token_id=1, eos_token_id=2, pad_token_id=0)


class SavedActivations:
    """Live and peak bytes of tensors saved for backward, excluding parameters."""

    def __init__(self, params) -> None:
        self.param_storage = {p.untyped_storage().data_ptr() for p in params}
        self.live = 0
        self.peak = 0

    def _release(self, n: int) -> None:
        self.live -= n

    def pack(self, t: torch.Tensor):
        if t.untyped_storage().data_ptr() in self.param_storage:
            return t
        n = t.numel() * t.element_size()
        self.live += n
        self.peak = max(self.peak, self.live)
        token = _Token()
        weakref.finalize(token, self._release, n)
        return (t, token)

    @staticmethod
    def unpack(packed):
        return packed[0] if isinstance(packed, tuple) else packed

    def hooks(self):
        return torch.autograd.graph.saved_tensors_hooks(self.pack, self.unpack)


class _Token:
    pass


def make_batches(n: int, *, batch: int, seq: int, vocab: int = CONFIG["vocab_size"]) -> list[dict[str, torch.Tensor]]:
    gen = torch.Generator().manual_seed(0)
    out = []
    for _ in range(n):
        ids = torch.randint(3, vocab, (batch, seq), generator=gen)
        out.append({"input_ids": ids, "labels": ids})
    return out


def build(path: str, pp: int, microbatches: int, schedule: str):
    from transformers import LlamaForCausalLM

    import qn_hf

    return qn_hf.parallelize(LlamaForCausalLM.from_pretrained(path), pp=pp, microbatches=microbatches, schedule=schedule, seed=0)


def run_qn(pm, data, warmup: int) -> dict:
    opt = torch.optim.SGD(pm.parameters(), lr=1e-3)
    meter = SavedActivations(pm.parameters())
    bubbles, times = [], []
    for i, batch in enumerate(data):
        pm.executor.events = []
        opt.zero_grad()
        dist.barrier()
        start = time.perf_counter()
        with meter.hooks():
            if i == warmup:
                meter.peak = 0
            pm.train_step(batch)
        opt.step()
        elapsed = time.perf_counter() - start
        if i >= warmup:
            events = pm.executor.events
            busy = sum(e.stop - e.start for e in events if e.op in ("fwd", "bwd"))
            span = events[-1].stop - events[0].start
            bubbles.append(1 - busy / span)
            times.append(elapsed)
    pm.executor.events = None
    return {"steps_per_s": len(times) / sum(times), "bubble": statistics.mean(bubbles), "peak_bytes": meter.peak}


def run_torch(pm, data, warmup: int, microbatches: int) -> dict:
    """torch.distributed.pipelining's Schedule1F1B driving qn_hf's stage modules."""
    from torch.distributed.pipelining import PipelineStage, Schedule1F1B

    stage = pm.stage

    class StageModule(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.model = pm.module

        def forward(self, x):
            # Stage 0 gets token ids; later stages get the activation and rebuild positions from its shape.
            ids = x if stage.is_first else torch.zeros(x.shape[:2], dtype=torch.long)
            out = stage.forward({"input_ids": ids}, None if stage.is_first else x, use_cache=False)
            return out.logits if stage.is_last else out

    def loss_fn(logits, labels):
        return F.cross_entropy(logits[:, :-1].flatten(0, 1).float(), labels[:, 1:].flatten())

    pipe_stage = PipelineStage(StageModule(), stage.stage, stage.stages, torch.device("cpu"))
    schedule = Schedule1F1B(pipe_stage, n_microbatches=microbatches, loss_fn=loss_fn)
    opt = torch.optim.SGD(pm.parameters(), lr=1e-3)
    meter = SavedActivations(pm.parameters())
    times = []
    pm.module.train()
    for i, batch in enumerate(data):
        opt.zero_grad()
        dist.barrier()
        start = time.perf_counter()
        with meter.hooks():
            if i == warmup:
                meter.peak = 0
            if stage.is_first:
                schedule.step(batch["input_ids"])
            elif stage.is_last:
                schedule.step(target=batch["labels"], losses=[])
            else:
                schedule.step()
        opt.step()
        if i >= warmup:
            times.append(time.perf_counter() - start)
    return {"steps_per_s": len(times) / sum(times), "peak_bytes": meter.peak}


def worker(rank: int, pp: int, path: str, args: argparse.Namespace) -> list[dict] | None:
    data = make_batches(args.steps + 1, batch=args.batch, seq=args.seq)
    out: dict[str, list[dict]] = {"qn_hf 1f1b": [], "qn_hf gpipe": [], "torch Schedule1F1B": []}
    for _ in range(args.rounds):
        for schedule in ("1f1b", "gpipe"):
            pm = build(path, pp, args.microbatches, schedule)
            out[f"qn_hf {schedule}"].append(run_qn(pm, data, warmup=1))
        pm = build(path, pp, args.microbatches, "1f1b")
        out["torch Schedule1F1B"].append(run_torch(pm, data, warmup=1, microbatches=args.microbatches))
    gathered = [None] * pp
    dist.all_gather_object(gathered, out)
    return gathered if rank == 0 else None


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--pp", type=int, default=2)
    parser.add_argument("--microbatches", type=int, default=16)
    parser.add_argument("--batch", type=int, default=32, help="global batch (microbatch = batch / microbatches)")
    parser.add_argument("--seq", type=int, default=128)
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--rounds", type=int, default=2)
    args = parser.parse_args()

    from transformers import LlamaConfig, LlamaForCausalLM

    path = tempfile.mkdtemp(prefix="qn_hf_pipe_")
    torch.manual_seed(0)
    LlamaForCausalLM(LlamaConfig(**CONFIG)).save_pretrained(path)
    per_stage = run_world(worker, world=args.pp, extra=(path, args))

    P, M = args.pp, args.microbatches
    cores = os.cpu_count()
    print(f"Llama {CONFIG['num_hidden_layers']} layers, hidden {CONFIG['hidden_size']}; batch {args.batch}x{args.seq}, "
          f"M={M} microbatches, pp={P} gloo ranks x {max(1, cores // P)} thread(s) on {cores} cores; median of {args.rounds} rounds")

    def med(stage: int, variant: str, key: str) -> float:
        return statistics.median(r[key] for r in per_stage[stage][variant])

    mib = 1024 * 1024
    f1, gp = med(0, "qn_hf 1f1b", "peak_bytes"), med(0, "qn_hf gpipe", "peak_bytes")
    tv = med(0, "torch Schedule1F1B", "peak_bytes")
    print(f"stage-0 activation memory: 1F1B {f1 / mib:.1f} MiB, GPipe {gp / mib:.1f} MiB, ratio {f1 / gp:.3f} "
          f"(P/M = {P / M:.3f}); torch Schedule1F1B {tv / mib:.1f} MiB")
    theory = (P - 1) / (M + P - 1)
    for variant in ("qn_hf 1f1b", "qn_hf gpipe"):
        bubbles = [med(s, variant, "bubble") for s in range(P)]
        print(f"{variant} bubble per stage {[round(b, 3) for b in bubbles]} (mean {statistics.mean(bubbles):.3f}); "
              f"theory (P-1)/(M+P-1) = {theory:.3f}")
    rates = {v: med(0, v, "steps_per_s") for v in per_stage[0]}
    for variant, rate in rates.items():
        print(f"{variant:<22} {rate:.3f} train steps/s")
    print(f"ratio qn_hf 1F1B / torch Schedule1F1B = {rates['qn_hf 1f1b'] / rates['torch Schedule1F1B']:.2f}x")


if __name__ == "__main__":
    main()
