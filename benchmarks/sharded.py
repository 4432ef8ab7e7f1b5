"""Sharded data parallelism (``dp_shard``) against ZeRO-1 and against FSDP2 applied as accelerate
applies it: bytes per rank counted from real tensors, and step time, at dp=4 in one run.

    python benchmarks/sharded.py [--rounds 3] [--steps 4]

A 6-layer Llama (hidden 384, vocab 8192, 16.9M parameters) trains with AdamW in bf16 (float32
masters) on 4 gloo ranks, one intra-op thread each. Each rank sums the storages of its parameters,
its gradients (``.grad`` or the dp buckets), the float32 master copies that are copies, and the
tensors in ``opt.state``, after one step:

* qn_hf dp_shard=1 with ``zero=True`` (ZeRO-1): bf16 weights and float32 gradients whole, masters
  and moments 1/dp: theory 2 + 4 + 12/dp bytes per parameter;
* qn_hf dp_shard=2 and 4: float32 shards that are the masters, float32 gradient shards and moments,
  all 1/dp_shard: theory 16/dp_shard bytes per parameter (plus one gathered block while it runs);
* "accelerate": the plain model with ``fully_shard`` on each decoder layer and then on the root,
  ``MixedPrecisionPolicy(param_dtype=bf16, reduce_dtype=float32)`` (what accelerate's FSDP2 plugin
  does with ``mixed_precision="bf16"``), torch's AdamW over the DTensor parameters, the loss averaged
  over the ranks by FSDP.

Then, per run: the planner's figures for the same settings (``Planner.estimate``: weights +
gradients + optimizer state, and the step's peak: activations plus, under dp_shard, the whole weights
FSDP gathers); the step's peak above what is held, measured (``StepPeak``: what ops made during the
step and still live, plus the parameters FSDP swapped in whole, after every op), and the peak in all
(held + that); and the step's collectives (calls and bytes each rank hands them, by op, counted by a
dispatch mode on torch's c10d ops, for both libraries alike) against the planner's FSDP traffic.

Step time: the median of ``--steps`` timed steps after a warm-up, qn_hf at dp_shard=4 and the
accelerate-style model alternating ``--rounds`` times; the ratio qn_hf / accelerate (>1: slower).
"""

from __future__ import annotations

import statistics

import torch
from torch.distributed.tensor import DTensor
from torch.utils._python_dispatch import TorchDispatchMode
from world import StepPeak, benchmark_parser, median_step_seconds, run_world, save_tiny_llama, storage_bytes

CONFIG = dict(hidden_size=384, intermediate_size=1024, num_hidden_layers=6, num_attention_heads=6,
              num_key_value_heads=6, vocab_size=8192, max_position_embeddings=256, bos_token_id=1, eos_token_id=2)
ROWS, SEQ = 2, 128  # per rank


def _local(tensors) -> list[torch.Tensor]:
    return [t.to_local() if isinstance(t, DTensor) else t for t in tensors]


def _batch(rank: int, step: int) -> dict:
    ids = torch.randint(3, CONFIG["vocab_size"], (ROWS, SEQ), generator=torch.Generator().manual_seed(rank * 1000 + step))
    return {"input_ids": ids, "labels": ids}


def _qn_hf(path: str, world: int, dp_shard: int):
    from transformers import AutoModelForCausalLM

    import qn_hf

    pm = qn_hf.parallelize(AutoModelForCausalLM.from_pretrained(path), dp=world, dp_shard=dp_shard,
                           mixed_precision="bf16", seed=0)
    opt = qn_hf.optimizer(pm, torch.optim.AdamW, zero=dp_shard == 1, lr=1e-4)

    def step(rank: int, n: int) -> None:
        opt.zero_grad()
        pm.train_step(_batch(rank, n))
        opt.step()

    def grads() -> list[torch.Tensor]:
        if pm.buckets is not None:
            return [b.buffer for b in pm.buckets.buckets]
        return _local(p.grad for p in pm.parameters() if p.grad is not None)

    return step, list(pm.parameters()), grads, opt, opt.masters, pm.module


def _accelerate(path: str, world: int):
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(path)
    policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    for layer in model.model.layers:
        fully_shard(layer, mp_policy=policy)
    fully_shard(model, mp_policy=policy)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)

    def step(rank: int, n: int) -> None:
        opt.zero_grad()
        model(**_batch(rank, n)).loss.backward()
        opt.step()

    def grads() -> list[torch.Tensor]:
        return _local(p.grad for p in model.parameters() if p.grad is not None)

    return step, list(model.parameters()), grads, opt, [], model


def _build(kind: str, path: str, world: int):
    return _accelerate(path, world) if kind == "accelerate" else _qn_hf(path, world, int(kind.split("=")[1]))


class _Collectives(TorchDispatchMode):
    """Calls and bytes of torch's c10d collectives by op: an all-gather's input (this rank's shard),
    a reduce-scatter's whole input, an all-reduce's tensors (CommMeter's payload convention)."""

    OPS = {"c10d._allgather_base_.default": ("all_gather", 1), "c10d._reduce_scatter_base_.default": ("reduce_scatter", 1),
           "c10d.allreduce_.default": ("all_reduce", 0)}

    def __init__(self) -> None:
        super().__init__()
        self.ops: dict[str, list[int]] = {}

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if str(func) in self.OPS:
            op, at = self.OPS[str(func)]
            tensors = args[at] if isinstance(args[at], (list, tuple)) else [args[at]]
            acc = self.ops.setdefault(op, [0, 0])
            acc[0] += 1
            acc[1] += sum(t.numel() * t.element_size() for t in tensors)
        return func(*args, **(kwargs or {}))


def bytes_worker(rank: int, world: int, path: str, kind: str) -> dict:
    step, params, grads, opt, masters, model = _build(kind, path, world)
    step(rank, 0)
    weights = {t.untyped_storage().data_ptr() for t in _local(params)}
    copies = [t for t in _local(m.tensor for m in masters) if t.untyped_storage().data_ptr() not in weights]
    state = [t for s in opt.state.values() for t in s.values() if isinstance(t, torch.Tensor) and t.dim() > 0]
    held = {"params": sum(p.numel() for p in params), "weights": storage_bytes(_local(params)),
            "grads": storage_bytes(grads()), "masters": storage_bytes(copies), "state": storage_bytes(_local(state))}
    opt.zero_grad()  # what stays is held between steps (set_to_none: FSDP's gradients go)
    held_then = storage_bytes(_local(params)) + storage_bytes(grads()) + held["masters"] + held["state"]
    with StepPeak(model) as peak:
        step(rank, 1)
    with _Collectives() as traffic:
        step(rank, 2)
    return {**held, "held": held_then, "peak": peak.bytes, "traffic": traffic.ops}


def _planned(path: str, world: int, kind: str):
    """The planner's estimate of a qn_hf run (None for the accelerate-style one)."""
    from transformers import AutoConfig

    from qn_hf.config.parallel_config import ParallelConfig
    from qn_hf.planner.estimate import Planner

    if kind == "accelerate":
        return None
    dp_shard = int(kind.split("=")[1])
    planner = Planner(AutoConfig.from_pretrained(path), seq_len=SEQ, micro_batch_size=ROWS)
    parallel = ParallelConfig.from_keywords(dp=world, microbatches=1, mixed_precision="bf16", dp_shard=dp_shard)
    return planner.estimate(parallel, zero=dp_shard == 1, backend="gloo").stages[0]


def time_worker(rank: int, world: int, path: str, kind: str, steps: int) -> float:
    step = _build(kind, path, world)[0]
    return median_step_seconds(lambda n: step(rank, n), steps=steps)


def _label(kind: str) -> str:
    if kind == "accelerate":
        return "fully_shard as accelerate applies it"
    return "qn_hf " + kind + (" (ZeRO-1)" if kind == "dp_shard=1" else "")


def main() -> None:
    parser = benchmark_parser(__doc__, steps=4)
    args = parser.parse_args()
    path = save_tiny_llama(CONFIG, prefix="qn_hf_sharded_")
    world = 4
    kinds = ["dp_shard=1", "dp_shard=2", "dp_shard=4", "accelerate"]
    theory = {"dp_shard=1": 2 + 4 + 12 / world, "dp_shard=2": 16 / 2, "dp_shard=4": 16 / 4, "accelerate": 16 / world}
    print(f"bytes per rank at dp={world}, bf16 + AdamW (float32 masters and moments), counted from real tensors:")
    print("| run | weights | gradients | master copies | optimizer state | total | bytes/param | theory | planner |")
    print("|---|---|---|---|---|---|---|---|---|")
    results, mib = {}, 2**20
    plans = {kind: _planned(path, world, kind) for kind in kinds}
    for kind in kinds:
        r = results[kind] = run_world(bytes_worker, world=world, extra=(path, kind))
        total = r["weights"] + r["grads"] + r["masters"] + r["state"]
        plan = plans[kind]
        planned = f"{plan.state_bytes:,}" if plan else "-"
        print(f"| {_label(kind)} | {r['weights']:,} | {r['grads']:,} | {r['masters']:,} | {r['state']:,} | {total:,} | "
              f"{total / r['params']:.2f} | {theory[kind]:.2f} | {planned} |")
    print("\nthe step's peak per rank (MiB): above what is held between steps, and in all; the planner's figure")
    print("| run | held | step's peak above it | peak in all | planner: activations + gathered | planner: peak |")
    print("|---|---|---|---|---|---|")
    for kind in kinds:
        r, plan = results[kind], plans[kind]
        planned = f"{(plan.activation_bytes + plan.unsharded_bytes) / mib:.1f} | {plan.total_bytes / mib:.1f}" if plan \
            else "- | -"
        print(f"| {_label(kind)} | {r['held'] / mib:.1f} | {r['peak'] / mib:.1f} | {(r['held'] + r['peak']) / mib:.1f} "
              f"| {planned} |")
    ours, theirs = results["dp_shard=4"], results["accelerate"]
    print(f"peak in all, qn_hf dp_shard=4 / accelerate-style: "
          f"{(ours['held'] + ours['peak']) / (theirs['held'] + theirs['peak']):.3f}")
    print("\ncollectives of one step per rank (calls, MiB handed to them), and the planner's FSDP traffic:")
    print("| run | all-gather | reduce-scatter | all-reduce | planner: dp_shard all-gather, reduce-scatter |")
    print("|---|---|---|---|---|")
    for kind in kinds:
        ops, plan = results[kind]["traffic"], plans[kind]
        cells = [f"{ops[o][0]}, {ops[o][1] / mib:.2f}" if o in ops else "-"
                 for o in ("all_gather", "reduce_scatter", "all_reduce")]
        fsdp = plan.comm.get("dp_shard") if plan else None
        planned = "; ".join(f"{c}, {b / mib:.2f}" for c, b in fsdp.ops.values()) if fsdp else "-"
        print(f"| {_label(kind)} | {' | '.join(cells)} | {planned} |")
    ours, theirs = [], []
    for _ in range(args.rounds):
        ours.append(run_world(time_worker, world=world, extra=(path, "dp_shard=4", args.steps)))
        theirs.append(run_world(time_worker, world=world, extra=(path, "accelerate", args.steps)))
    a, b = statistics.median(ours), statistics.median(theirs)
    print(f"step time at dp=4 (median of {args.rounds} alternating rounds of {args.steps} steps): qn_hf dp_shard=4 "
          f"{a * 1e3:.1f} ms, accelerate-style fully_shard {b * 1e3:.1f} ms, ratio qn_hf/accelerate {a / b:.3f}")


if __name__ == "__main__":
    main()
