"""Host-sync points of one steady-state training step, counted per feature and rank, and the peak
transient memory of ``clip_grad_norm_`` on one large gradient.

    python benchmarks/host_syncs.py --json after.json              # count this tree
    PYTHONPATH=/path/to/other/tree python benchmarks/host_syncs.py --json before.json
    python benchmarks/host_syncs.py --compare before.json after.json  # the before/after table
    python benchmarks/host_syncs.py --clip-memory                  # peak transient memory of clip

What one step is: ``opt.zero_grad(); pm.train_step(batch); qn_hf.clip_grad_norm_(pm, 1.0); opt.step()``
after two warm-up steps (the first step runs one-off checks), on 2 gloo ranks, for: plain dp=2, tp=2,
pp=2 (2 microbatches), dp=2 x ep=2 on a tiny Mixtral (and with ``expert_dispatch="all_gather"``), cp=2 (2 microbatches), dp=2 x dp_shard=2 (FSDP2), fp16
(loss scaling), bf16 + ZeRO-1, and dp=2 after a checkpoint resume with AdamW. AdamW runs with ``foreach=True``, the implementation torch
picks by default on CUDA (on CPU it would pick the per-tensor one).

How: a ``TorchDispatchMode`` (this thread; the autograd engine carries it into backward) sees every
aten op and counts those that make the host wait for a CUDA device: ``_local_scalar_dense``
(``.item()``, ``bool()``, ``int()``, ``float()`` of a tensor), ``nonzero``, ``masked_select``, the
``unique`` family, ``bincount``, ``histc`` without a range, ``repeat_interleave`` without ``output_size``, ``equal``,
``is_nonzero``, ``index``/``index_put_`` with a boolean mask, and copies between devices.
``Tensor.tolist`` does not dispatch an aten op, so it is patched (inside the count only). Each sync is
charged to the innermost frame of qn_hf, transformers or torch.optim on the Python stack.
``torch.tensor(<python data>)`` (``aten.lift_fresh``) is reported apart as "host data": on CUDA it is
a synchronous host-to-device copy when the tensor is placed on (or copied into) the device, which
this CPU run cannot tell.

Reads of the batch before it moves to the device (the step's checks, cp's document layout) are reads
of the caller's host tensors, which wait for no device: counted apart ("host batch reads"), told by when
they happen (inside ``train_step``, before ``step/runner.prepare`` calls ``to_device``). Each feature's "device waits" are its
syncs less those a step is allowed (issue 67): fp16's overflow flag in ``optimizer.step()`` (as
``GradScaler``); the loss report is the caller's own read of what ``train_step`` returns.

What it cannot see, since every tensor here is on the CPU: whether a tensor would live on the device
or the host, so device<->host copies (``.to(device)`` of the batch, ``.cpu()``) are invisible;
non-blocking copies, CUDA events, ``torch.cuda.synchronize``, NCCL waits; syncs inside C++ kernels.
One case is decided by rule instead: ``.item()`` of an optimizer's ``step`` counter (torch's
non-fused, non-capturable Adam reads it twice per parameter and step) is a sync only if the counter
lives on the device; it is counted as one when ``load_checkpoint`` placed it with ``Tensor.to(device)``
and reported as a host read otherwise (where torch's own optimizer keeps it).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import sys
import tempfile
from collections import Counter

import torch
import torch.distributed as dist
from torch.utils._python_dispatch import TorchDispatchMode

ALWAYS_SYNC = {"_local_scalar_dense", "nonzero", "masked_select", "_unique", "_unique2", "unique_dim",
               "unique_consecutive", "bincount", "equal", "is_nonzero"}
FEATURES = ("dp", "tp", "pp", "ep", "ep_all_gather", "cp", "dp_shard", "fp16", "bf16_zero", "resume")
# Device waits a step is allowed (issue 67): fp16's overflow flag, read by the optimizer's step as GradScaler
# does; the loss report is the user's own read of what train_step returns, outside the counted step
ALLOWED = ("qn_hf/data_parallel/precision.py",)
_HERE = os.path.abspath(__file__)


def _site() -> str:
    """Where in qn_hf, transformers or torch.optim the current op was asked for."""
    frame = sys._getframe(2)
    while frame is not None:
        path = frame.f_code.co_filename.replace(os.sep, "/")
        for marker in ("/qn_hf/", "/transformers/", "/torch/optim/", "/torch/nn/utils/"):
            if marker in path and path != _HERE:
                return f"{marker.strip('/')}/{path.split(marker, 1)[1]}:{frame.f_lineno}"
        frame = frame.f_back
    return "other"


def _bool_index(indices) -> bool:
    return any(isinstance(i, torch.Tensor) and i.dtype in (torch.bool, torch.uint8) for i in indices or ())


class SyncCounter(TorchDispatchMode):
    """Counts host-sync points and aten ops (see the module docstring)."""

    def __init__(self, *, host_steps: set[int], device_steps: set[int]) -> None:
        super().__init__()
        self.syncs: Counter[str] = Counter()  # "op @ site" -> count
        self.host_data: Counter[str] = Counter()
        self.host_step_reads = 0
        self.host_batch_reads: Counter[str] = Counter()  # reads before the batch moves to the device
        self.batch_on_host = False  # inside the step's prologue, before the batch moves (prepare's to_device)
        self.ops = 0
        self.host_steps, self.device_steps = host_steps, device_steps

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        name = func._overloadpacket.__name__
        self.ops += 1
        sync = name in ALWAYS_SYNC
        if name == "repeat_interleave":  # tensor repeats: the output size is their sum, unless given
            sync = func._overloadname in ("Tensor", "self_Tensor") and kwargs.get("output_size") is None
        if name == "histc":  # min == max (the default 0, 0): the range is read from the data first
            low = args[2] if len(args) > 2 else kwargs.get("min", 0)
            high = args[3] if len(args) > 3 else kwargs.get("max", 0)
            sync = low == high
        if name in ("index", "index_put_", "index_put") and _bool_index(args[1]):
            sync = True
        if name in ("_to_copy", "copy_"):
            devices = {a.device for a in (*args, *kwargs.values()) if isinstance(a, torch.Tensor)}
            devices |= {torch.device(kwargs["device"])} if kwargs.get("device") is not None else set()
            sync = len(devices) > 1
        if name == "_local_scalar_dense" and isinstance(args[0], torch.Tensor):
            ptr = args[0].data_ptr()
            if ptr in self.host_steps and ptr not in self.device_steps:
                self.host_step_reads += 1
                sync = False
        if sync and self.batch_on_host and name != "_to_copy" and name != "copy_":
            self.host_batch_reads[f"{name} @ {_site()}"] += 1  # the user's host batch: no device to wait for
            sync = False
        if sync:
            self.syncs[f"{name} @ {_site()}"] += 1
        if name == "lift_fresh":
            self.host_data[_site()] += 1
        return func(*args, **kwargs)


@contextlib.contextmanager
def counting(opt, device_placed: set[int]):
    steps = {s["step"].data_ptr() for s in opt.state.values() if isinstance(s.get("step"), torch.Tensor)}
    counter = SyncCounter(host_steps=steps, device_steps=steps & device_placed)
    tolist = torch.Tensor.tolist

    def counted_tolist(self):  # a read of the host batch is no sync either
        if counter.batch_on_host:
            counter.host_batch_reads[f"tolist @ {_site()}"] += 1
        else:
            counter.syncs[f"tolist @ {_site()}"] += 1
        return tolist(self)

    # The step reads the user's batch on the host before moving it (step/runner.prepare's to_device): on a GPU
    # those reads wait for nothing, and here, where every tensor is on the CPU, they are told apart by when
    from qn_hf import ParallelModel
    from qn_hf.step import runner

    moves = runner.to_device

    def moving(batch, device):
        counter.batch_on_host = False
        return moves(batch, device)

    train_step = ParallelModel.train_step

    def step_starting_on_host(self, *args, **kwargs):
        counter.batch_on_host = True
        try:
            return train_step(self, *args, **kwargs)
        finally:
            counter.batch_on_host = False

    torch.Tensor.tolist = counted_tolist
    runner.to_device, ParallelModel.train_step = moving, step_starting_on_host
    try:
        with counter:
            yield counter
    finally:
        torch.Tensor.tolist = tolist
        runner.to_device, ParallelModel.train_step = moves, train_step


@contextlib.contextmanager
def placements():
    """The storages ``Tensor.to(<a device>)`` returned inside the block: what the code put on the
    compute device (on CUDA, device memory)."""
    placed: set[int] = set()
    to = torch.Tensor.to

    def recording_to(self, *args, **kwargs):
        out = to(self, *args, **kwargs)
        if kwargs.get("device") is not None or any(isinstance(a, (torch.device, str)) for a in args):
            placed.add(out.data_ptr())
        return out

    torch.Tensor.to = recording_to
    try:
        yield placed
    finally:
        torch.Tensor.to = to


def _gpt2(n_layer: int = 4):
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(0)
    return GPT2LMHeadModel(GPT2Config(n_layer=n_layer, n_embd=64, n_head=4, n_positions=64, vocab_size=256,
                                      resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0))


def _llama():
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    return LlamaForCausalLM(LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=4,
                                        num_attention_heads=8, num_key_value_heads=2, vocab_size=256,
                                        max_position_embeddings=64))


def _mixtral():
    from transformers import CONFIG_MAPPING

    from qn_hf.check.run import build
    from qn_hf.check.shrink import shrink_config

    return build(shrink_config(CONFIG_MAPPING["mixtral"]()), seed=0)


def setup_feature(feature: str, world: int, tmp: str):
    """The model and optimizer of one feature on ``world`` ranks, and what a resume placed on the device."""
    import qn_hf

    if feature == "dp":
        pm = qn_hf.parallelize(_gpt2(), dp=world)
    elif feature == "tp":
        pm = qn_hf.parallelize(_llama(), tp=world)
    elif feature == "pp":
        pm = qn_hf.parallelize(_gpt2(), pp=world, microbatches=2)
    elif feature == "ep":
        pm = qn_hf.parallelize(_mixtral(), dp=world, ep=world)
    elif feature == "ep_all_gather":
        pm = qn_hf.parallelize(_mixtral(), dp=world, ep=world, expert_dispatch="all_gather")
    elif feature == "cp":
        pm = qn_hf.parallelize(_llama(), cp=world, microbatches=2)
    elif feature == "dp_shard":
        pm = qn_hf.parallelize(_llama(), dp=world, dp_shard=world)
    elif feature == "fp16":
        pm = qn_hf.parallelize(_gpt2(), dp=world, mixed_precision="fp16")
        return pm, qn_hf.optimizer(pm, torch.optim.AdamW, lr=1e-4, foreach=True), set()
    elif feature == "bf16_zero":
        pm = qn_hf.parallelize(_gpt2(), dp=world, mixed_precision="bf16")
        return pm, qn_hf.optimizer(pm, torch.optim.AdamW, zero=True, lr=1e-4, foreach=True), set()
    elif feature == "resume":
        pm = qn_hf.parallelize(_gpt2(), dp=world)
        opt = torch.optim.AdamW(pm.parameters(), lr=1e-4, foreach=True)
        train_one_step(pm, opt, seed=0)
        pm.save_checkpoint(tmp, optimizer=opt, step=1)
        pm = qn_hf.parallelize(_gpt2(), dp=world)
        opt = torch.optim.AdamW(pm.parameters(), lr=1e-4, foreach=True)
        with placements() as placed:
            pm.load_checkpoint(tmp, optimizer=opt)
        return pm, opt, placed
    else:
        raise ValueError(feature)
    return pm, torch.optim.AdamW(pm.parameters(), lr=1e-4, foreach=True), set()


def train_one_step(pm, opt, *, seed: int) -> None:
    """What is counted: zero_grad, train_step, clip_grad_norm_, the optimizer's step."""
    import qn_hf

    gen = torch.Generator().manual_seed(seed + pm.coords["dp"])
    ids = torch.randint(0, min(256, pm.config.vocab_size), (2 * pm.microbatches, 16), generator=gen)
    opt.zero_grad()
    pm.train_step({"input_ids": ids, "labels": ids})
    qn_hf.clip_grad_norm_(pm, 1.0)
    opt.step()


def count_steady_step(feature: str, *, world: int, tmp: str) -> dict:
    """The counts of one steady-state step of ``feature`` on this rank (after two warm-up steps)."""
    from qn_hf.expert_parallel.apply import experts_modules

    pm, opt, placed = setup_feature(feature, world, tmp)
    for seed in (1, 2):
        train_one_step(pm, opt, seed=seed)
    dist.barrier()
    with counting(opt, placed) as counter:
        train_one_step(pm, opt, seed=3)
    dist.barrier()
    return {"syncs": dict(counter.syncs), "host_data": dict(counter.host_data), "ops": counter.ops,
            "host_batch_reads": dict(counter.host_batch_reads),
            "device_waits": sum(n for site, n in counter.syncs.items() if not any(a in site for a in ALLOWED)),
            "host_step_reads": counter.host_step_reads, "params": sum(1 for p in pm.parameters() if p.requires_grad),
            "moe_layers": len(experts_modules(pm.module))}


def count_worker(rank: int, world: int, features: list[str], tmp: str) -> list[dict]:
    out = {feature: count_steady_step(feature, world=world, tmp=os.path.join(tmp, feature)) for feature in features}
    gathered = [None] * world
    dist.all_gather_object(gathered, out)
    return gathered


def _summary(ranks: list[dict], feature: str) -> str:
    parts = []
    for r in ranks:
        f = r[feature]
        parts.append(f"{sum(f['syncs'].values())}+{sum(f['host_data'].values())}h")
    return "/".join(parts)


def compare(before: dict, after: dict) -> None:
    print("syncs per rank (rank0/rank1), N+Mh = N sync points + M torch.tensor(host data); aten ops rank 0")
    print(f"{'feature':<10} {'before':>14} {'after':>14} {'ops before':>11} {'ops after':>10}  host step reads b/a")
    for feature in FEATURES:
        if feature in before["ranks"][0] and feature in after["ranks"][0]:
            b, a = before["ranks"][0][feature], after["ranks"][0][feature]
            print(f"{feature:<10} {_summary(before['ranks'], feature):>14} {_summary(after['ranks'], feature):>14} "
                  f"{b['ops']:>11} {a['ops']:>10}  {b['host_step_reads']}/{a['host_step_reads']}")
    for label, data in (("before", before), ("after", after)):
        print(f"\n{label}: sites (rank 0 | rank 1)")
        for feature in FEATURES:
            if feature not in data["ranks"][0]:
                continue
            sites = sorted({s for r in data["ranks"] for s in r[feature]["syncs"]})
            hosts = sorted({s for r in data["ranks"] for s in r[feature]["host_data"]})
            print(f"  {feature}:")
            for s in sites:
                print(f"    {' | '.join(str(r[feature]['syncs'].get(s, 0)) for r in data['ranks'])}  {s}")
            for s in hosts:
                print(f"    {' | '.join(str(r[feature]['host_data'].get(s, 0)) for r in data['ranks'])}h {s}")


def clip_memory(label: str) -> dict:
    """Peak bytes ``clip_grad_norm_`` allocates above what exists before it, for one 32768 x 4096
    float32 gradient at tp=1 in one process: from the profiler's allocation events (net running sum,
    its maximum) and from the peak resident set (ru_maxrss) before and after the call."""
    import resource

    from torch.profiler import ProfilerActivity, profile
    from transformers import GPT2Config, GPT2LMHeadModel

    import qn_hf

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(29500 + os.getpid() % 1000), RANK="0", WORLD_SIZE="1")
    dist.init_process_group("gloo")
    model = GPT2LMHeadModel(GPT2Config(n_layer=1, n_embd=4096, n_head=32, n_inner=8, n_positions=8, vocab_size=32768))
    pm = qn_hf.parallelize(model, dp=1)
    wte = pm.module.transformer.wte.weight
    wte.grad = torch.randn_like(wte)  # the only gradient: the clip reads this one tensor
    unclipped = wte.grad.clone()  # alive from here on: in the resident set before and after alike
    rss0 = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    mode = os.environ.get("CLIP_MEMORY_MODE", "rss")
    if mode == "profiler":
        with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
            norm = qn_hf.clip_grad_norm_(pm, 1.0)
        events = sorted((e for e in prof.events() if e.self_cpu_memory_usage), key=lambda e: e.time_range.start)
        running = peak = 0
        for e in events:
            running += e.self_cpu_memory_usage
            peak = max(peak, running)
        result = {"profiler_peak_bytes": peak}
    else:
        norm = qn_hf.clip_grad_norm_(pm, 1.0)
        result = {"rss_peak_delta_bytes": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 - rss0}
    # the norm to expect, in float64 a run at a time (after the measurement)
    exact = sum(run.double().square().sum().item() for run in unclipped.view(-1).split(2**20)) ** 0.5
    dist.destroy_process_group()
    return {"tree": label, "grad_bytes": wte.grad.nbytes, "norm": float(norm), "float64_norm": exact, **result}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--features", default=",".join(FEATURES))
    parser.add_argument("--json", help="write the counts here")
    parser.add_argument("--compare", nargs=2, metavar=("BEFORE", "AFTER"))
    parser.add_argument("--clip-memory", action="store_true", help="one fresh process per method")
    parser.add_argument("--clip-memory-one", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    import qn_hf

    tree = os.path.dirname(os.path.dirname(os.path.abspath(qn_hf.__file__)))
    if args.compare:
        with open(args.compare[0]) as f, open(args.compare[1]) as g:
            compare(json.load(f), json.load(g))
        return
    if args.clip_memory_one:
        print(json.dumps(clip_memory(tree)))
        return
    if args.clip_memory:
        import subprocess

        for mode in ("rss", "profiler"):
            out = subprocess.run([sys.executable, _HERE, "--clip-memory-one"], env={**os.environ, "CLIP_MEMORY_MODE": mode},
                                 capture_output=True, text=True, check=True).stdout.strip().splitlines()[-1]
            print(out)
        return
    from world import run_world  # here: tests load this file by path, without benchmarks/ on sys.path

    features = args.features.split(",")
    with tempfile.TemporaryDirectory() as tmp:
        ranks = run_world(count_worker, world=2, extra=(features, tmp))
    data = {"tree": tree, "ranks": ranks}
    for feature in features:
        print(f"{feature}: syncs {_summary(ranks, feature)}; ", {s: n for s, n in ranks[0][feature]["syncs"].items()},
              "host data", ranks[0][feature]["host_data"], "host step reads", ranks[0][feature]["host_step_reads"])
    print(f"\n{'feature':<13} device waits per step (rank 0 / rank 1)  host batch reads")
    for feature in features:
        waits = "/".join(str(r[feature]["device_waits"]) for r in ranks)
        print(f"{feature:<13} {waits:>38}  {sum(ranks[0][feature]['host_batch_reads'].values())}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(data, f, indent=1)


if __name__ == "__main__":
    main()
