"""qn-hf-plan: which (dp, tp, pp, cp) fits, where the stages are cut, what each rank holds and sends.

    qn-hf-plan MODEL --gpus 64 [--global-batch 256] [--gpu-memory 80GiB] [--seq-len 4096] [--micro-batch-size 1]
               [--dtype bf16|fp16|fp32] [--zero] [--recompute full|selective] [--sequence-parallel] [--cp N]
               [--ep N] [--schedule 1f1b|gpipe|interleaved_1f1b|zb_h1] [--virtual-stages V]
               [--dp-shard N|all] [--dp-shard-gather step|microbatch] [--expert-dispatch all_to_all|all_gather]
               [--loss-chunk-tokens N] [--offload activations]
    qn-hf-plan MODEL --gpus 64 --tp 8 --pp 8 --global-batch 512         # the other degrees searched
    qn-hf-plan MODEL --dp 1 --tp 8 --pp 8 [--cp 2] [--ep 8] [--microbatches 32]  # one mesh, per-stage detail
    qn-hf-plan path/to/config.json --gpus 16 --json                     # machine-readable
    qn-hf-plan --calibrate OUT.json [--calibrate-ranks N] [--dtype bf16] [--quick]  # measure this machine
    qn-hf-plan MODEL --gpus 8 --global-batch 64 --auto [--calibration machine.json]  # what mesh="auto" picks

--global-batch B ranks only meshes that train exactly B sequences per step (each mesh's microbatches
are B / (dp x micro-batch size); one that this does not divide is rejected, saying so), and every row
and JSON entry shows the global batch it trains. Degrees given with --gpus (--dp, --tp, --pp, --cp)
are kept and the rest searched.

MODEL is a Hugging Face directory or a config.json. The model is built on the meta device (no
weights, no GPU) and put through the checks, tp plan and stage cut ``parallelize`` uses, so a
mesh the planner accepts trains and one it rejects fails with the same message. The training
settings are ``parallelize``'s and ``qn_hf.optimizer``'s: --dtype bf16 (default) or fp16 is
mixed_precision (16-bit weights and activations, float32 gradients, float32 master weights and
AdamW moments: 2+4+4+8 B per parameter), fp32 is none (4+4+8); --zero shards the master weights
and moments over dp (ZeRO-1); --recompute recomputes each block's activations in backward;
--sequence-parallel splits the activations between tensor-parallel regions over tp along the
sequence (meshes with tp=1 are then rejected, as parallelize rejects them); --cp is context
parallelism (``parallelize(cp=N)``: each rank runs 1/cp of every sequence, ring attention between
them, gradients and ZeRO's state over dp x cp). With --gpus the meshes take every cp that divides
the GPUs left by tp, up to 8 (rings within a node or two), unless --cp fixes it; a sequence length
that 2*cp does not divide is rejected, as train_step rejects it. --ep is expert parallelism
(``parallelize(ep=N)``: a MoE model's fused experts split over ep of each stage's dp x tp ranks,
tokens sent to them by all-to-all, priced at uniform routing; the experts' gradients summed over
the dp x tp / ep ranks holding the same experts); with --gpus every mesh takes it (and cp=1 unless
--cp is given), and those whose dp x tp it does not divide are rejected; without it, a MoE model's
meshes are planned at ep=1 and at every ep that divides both a layer's experts and the mesh's
dp x tp (those at cp=1 unless --cp is given), a dense model's at ep=1. --schedule and
--virtual-stages are ``parallelize``'s: interleaved_1f1b runs V chunks per rank (a rank's blocks are
then listed per chunk), zb_h1 splits the backward and defers the linear layers' weight gradients;
the default microbatch count (4 per stage) is raised to the next one the schedule allows.
--dp-shard N is sharded data parallelism (``parallelize(dp_shard=N)``: FSDP2 shards weights,
gradients and AdamW state over N dp ranks (x cp), all-reduced across the dp/N groups; every mesh
takes it, those whose dp it does not divide rejected); with --gpus the default (or --dp-shard all)
plans each mesh at every dp_shard dividing its dp (ZeRO-1, if --zero, at dp_shard=1 only), so a mesh
that fits only sharded is ranked with the rest; one mesh (--dp --tp --pp) takes 1 unless given.
Under ep the experts are FSDP groups of their own over the ranks holding the same experts (whole
when one rank holds them). Its memory adds the whole weights gathered during a step and, under a
pipeline, the whole gradients kept until the step's reduction (the "gathered" column);
--dp-shard-gather is ``parallelize``'s (under pp: gather once a step, or per microbatch).
Memory is per rank: weights + gradients + AdamW state, plus activations (what one microbatch
keeps for its backward, with a fused attention kernel, or ring attention under cp, and the recompute
mode, per chunk, at the most the schedule's action list holds at once, zb_h1's stash of the deferred
layers' inputs and output gradients included). The bubble is the schedule's own, timed on its action
lists with per-op costs (forward, backward, weight gradients) from the FLOPs. Communication is per
step and rank, by group (the dp column: the gradients' reduction, over dp x cp). Step times come
from qn_hf/planner/cost.py priced at --calibration (a file --calibrate wrote on the machine that will
train), or without one at the stated --tflops and link figures (every figure then assumed, and said).

--auto prints the configuration ``parallelize(model, mesh="auto", global_batch=B, seq_len=L)`` would
choose (planner/auto.py: the fastest predicted among those that fit --gpu-memory), its step time
and memory, and the runner-up with why it lost; degrees, --dtype, --recompute and
--sequence-parallel given are kept. It prices mesh shapes from the lowest floor up and leaves those
that cannot beat the runner-up unpriced (said, with how many); --exhaustive prices every one.

--calibrate OUT.json measures this machine's figures (planner/calibrate.py: matmul rates by shape in
float32 and --dtype, attention, per-op latency, collectives by group size, overlap) and writes them:
under torchrun on every rank of the launched job (NCCL on GPUs, else gloo), otherwise on
--calibrate-ranks local gloo ranks (default 1) sharing this machine's CPU cores (GPUs are measured
under torchrun); --quick measures less.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import sys

import torch
import torch.distributed as dist

from ..config.dims import DEGREES, MESH_DEGREES, Axis, ParallelDims
from ..config.options import Dispatch, Gather, Offload, Recompute
from ..config.schedule import SCHEDULES, Schedule, as_schedule
from ..launch.nodes import local_rank
from .auto import auto_plan
from .calibrate import calibrate, measure, summary
from .calibration import Calibration
from .cost import GIB, Hardware
from .estimate import Planner
from .overheads import StepSeconds
from .report import mesh_report, ranking_report, settings, to_json
from .search import at_mesh, microbatches_for, search
from .tiny_steps import tiny_step_seconds

MIXED_PRECISION = {"bf16": "bf16", "fp16": "fp16", "fp32": None}  # --dtype -> parallelize's mixed_precision
CALIBRATED_DTYPE = {"bf16": "bfloat16", "fp16": "float16", "fp32": "float32"}  # --dtype -> what --calibrate times


def parse_bytes(text: str) -> int:
    match = re.fullmatch(r"\s*([\d.]+)\s*(GiB|GB|MiB|MB|TiB|TB)?\s*", text)
    if not match:
        raise argparse.ArgumentTypeError(f"{text!r} is not a size like 80GiB")
    scale = {"GiB": GIB, "GB": 10**9, "MiB": 1024**2, "MB": 10**6, "TiB": 1024**4, "TB": 10**12, None: GIB}[match[2]]
    return int(float(match[1]) * scale)


def _dp_shard(text: str) -> int | str:
    """--dp-shard: a positive number, or "all" (every divisor of each mesh's dp)."""
    if text == "all":
        return text
    if not text.isdigit() or int(text) < 1:
        raise argparse.ArgumentTypeError(f"{text!r} is neither a positive number nor 'all'")
    return int(text)


def load_config(path: str):
    from transformers import AutoConfig

    if os.path.isdir(path):
        if not os.path.isfile(os.path.join(path, "config.json")):
            raise SystemExit(f"error: {path} has no config.json")
        return AutoConfig.from_pretrained(path)
    if not os.path.isfile(path):
        raise SystemExit(f"error: {path} is neither a model directory nor a config.json")
    with open(path) as f:
        values = json.load(f)
    if "model_type" not in values:
        raise SystemExit(f"error: {path} has no model_type")
    return AutoConfig.for_model(**values)


def run_options(args: argparse.Namespace) -> dict[str, object]:
    """What every mesh of this run shares (the schedule, virtual stages, precision, recomputation,
    sequence parallelism, gather), as ``ParallelConfig`` keywords; the degrees and microbatches are
    each mesh's (``search.at_mesh``). Keywords, not a config: a schedule that some meshes cannot run
    (interleaved_1f1b at pp=1) rejects those meshes with ``parallelize``'s message, as each is
    checked when ``at_mesh`` builds its configuration."""
    return {"schedule": args.schedule, "virtual_stages": args.virtual_stages, "mixed_precision": MIXED_PRECISION[args.dtype],
            "recompute": args.recompute, "sequence_parallel": args.sequence_parallel,
            "dp_shard_gather": args.dp_shard_gather, "expert_dispatch": args.expert_dispatch,
            "loss_chunk_tokens": args.loss_chunk_tokens, "offload": args.offload}


def run_calibration(args: argparse.Namespace, step_seconds: StepSeconds | None = None) -> None:
    """--calibrate: every rank of a torchrun job measures (rank 0 writes), else a local world does;
    ``step_seconds``: the tiny models' step runner for the host's work (overheads.py)."""
    dtypes = (CALIBRATED_DTYPE[args.dtype],)
    if "WORLD_SIZE" not in os.environ:
        cal = calibrate(args.calibrate_ranks, dtypes=dtypes, quick=args.quick, step_seconds=step_seconds)
    else:
        started = not dist.is_initialized()
        if started and torch.cuda.is_available():
            torch.cuda.set_device(local_rank())
        if started:
            dist.init_process_group(dist.Backend.NCCL if torch.cuda.is_available() else dist.Backend.GLOO)
        cal = measure(dtypes=dtypes, quick=args.quick, step_seconds=step_seconds)
        rank = dist.get_rank()
        if started:
            dist.destroy_process_group()
        if rank != 0:
            return
    cal.save(args.calibrate)
    print("\n".join(summary(cal)))
    print(f"wrote {args.calibrate}")


def main(argv: list[str] | None = None) -> None:
    """``qn-hf-plan``; ``--calibrate`` measures qn_hf's host work on tiny models' steps too (``tiny_steps.py``)."""
    parser = argparse.ArgumentParser(prog="qn-hf-plan", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("model", nargs="?", help="Hugging Face model directory or config.json (not with --calibrate)")
    parser.add_argument("--gpus", type=int, help="GPUs in the job (with --dp/--tp/--pp/--cp: must equal their product)")
    parser.add_argument("--dp", type=int)
    parser.add_argument("--tp", type=int)
    parser.add_argument("--pp", type=int)
    parser.add_argument("--cp", type=int, default=None,
                        help="context parallelism: with --dp/--tp/--pp the mesh's (default 1); with --gpus alone, the "
                             "only cp enumerated (default: every divisor up to 8)")
    parser.add_argument("--ep", type=int, default=None,
                        help="expert parallelism: a MoE model's experts over ep of a stage's dp x tp ranks (default: "
                             "with --gpus, every ep dividing the experts and dp x tp for a MoE model, else 1)")
    parser.add_argument("--gpu-memory", type=parse_bytes, default=80 * GIB, help="per GPU, e.g. 80GiB (default)")
    parser.add_argument("--seq-len", type=int, default=None, help="tokens per sequence (default: the model's, at most 4096)")
    parser.add_argument("--micro-batch-size", type=int, default=1)
    parser.add_argument("--microbatches", type=int, default=None, help="per step (default: 4 per pipeline stage)")
    parser.add_argument("--global-batch", type=int, default=None,
                        help="sequences per optimizer step: rank only meshes that train exactly this many (their "
                             "microbatches follow: global batch / (dp x micro-batch size))")
    parser.add_argument("--schedule", default="1f1b", choices=SCHEDULES)
    parser.add_argument("--virtual-stages", type=int, default=1,
                        help="chunks per pipeline rank (interleaved_1f1b needs 2 or more; default 1)")
    parser.add_argument("--dtype", default="bf16", choices=sorted(MIXED_PRECISION),
                        help="bf16/fp16: mixed precision with float32 gradients and master weights; fp32: none (default bf16)")
    parser.add_argument("--zero", action="store_true", help="shard master weights and AdamW moments over dp (ZeRO-1)")
    parser.add_argument("--recompute", choices=Recompute.values(), default=None,
                        help="recompute each block's activations in backward (default: keep them)")
    parser.add_argument("--sequence-parallel", action="store_true",
                        help="split the activations between tensor-parallel regions over tp (needs tp > 1)")
    parser.add_argument("--dp-shard", type=_dp_shard, default=None,
                        help="sharded data parallelism (FSDP) over N dp ranks, or 'all': every N dividing dp "
                             "(default: all with --gpus, 1 for one mesh)")
    parser.add_argument("--dp-shard-gather", choices=Gather.values(), default=Gather.STEP.value,
                        help="under pp with --dp-shard: gather a stage's weights once a step (default) or per microbatch")
    parser.add_argument("--expert-dispatch", choices=Dispatch.values(), default=Dispatch.ALL_TO_ALL.value,
                        help="with ep: the all-to-all (default: one device wait per MoE call) or the all-gather "
                             "(none, ep times the tokens moved and held; docs/experts.md)")
    parser.add_argument("--loss-chunk-tokens", type=int, default=None, metavar="N",
                        help="a causal LM's loss N tokens at a time: the whole logits never held (default: at once)")
    parser.add_argument("--offload", choices=Offload.values(), default=None,
                        help="with --recompute: what recomputation keeps held in host memory (its figures: the "
                             "host's, beside the device's; the copies' time at --host-gbps or the calibration's)")
    parser.add_argument("--gpus-per-node", type=int, default=8)
    parser.add_argument("--tflops", type=float, default=Hardware.tflops, help="sustained TFLOP/s per GPU (default %(default)s)")
    parser.add_argument("--nvlink-gbps", type=float, default=Hardware.nvlink_gbps, help="GB/s per GPU in a node")
    parser.add_argument("--ib-gbps", type=float, default=Hardware.ib_gbps, help="GB/s per GPU across nodes")
    parser.add_argument("--host-gbps", type=float, default=Hardware.host_gbps,
                        help="GB/s per GPU to and from pinned host memory (offload)")
    parser.add_argument("--top", type=int, default=10)
    parser.add_argument("--json", action="store_true", help="print JSON instead of tables")
    parser.add_argument("--calibration", metavar="FILE.json", default=None,
                        help="price step times at this machine's figures (written by --calibrate); default: the "
                             "stated --tflops and link figures, every one named as assumed")
    parser.add_argument("--auto", action="store_true",
                        help="with --gpus and --global-batch: the configuration parallelize(mesh='auto') would choose, "
                             "its predicted step time and memory, and the runner-up with why it lost")
    parser.add_argument("--exhaustive", action="store_true",
                        help="with --auto: price every configuration, also those whose mesh shape cannot beat the "
                             "runner-up (the same choice, slower; every feasible one then counted)")
    parser.add_argument("--expert-loads", metavar="FILE.json", default=None,
                        help="a model with routed experts: per MoE layer and batch, the (token, expert) pairs each expert "
                             "received on your data (a JSON list of lists, as qn_hf.planner.measure_expert_loads "
                             "counts them); ep is then priced at your router's busiest rank, not uniform routing's")
    parser.add_argument("--calibrate", metavar="OUT.json", help="measure this machine's figures into OUT.json")
    parser.add_argument("--calibrate-ranks", type=int, default=1,
                        help="with --calibrate outside torchrun: local ranks measuring at once (default 1)")
    parser.add_argument("--quick", action="store_true", help="with --calibrate: fewer shapes and sizes")
    args = parser.parse_args(argv)
    if args.calibrate is not None:
        if args.model is not None:
            parser.error(f"--calibrate measures this machine, not a model: give it without {args.model}")
        if args.calibrate_ranks < 1:
            parser.error(f"--calibrate-ranks={args.calibrate_ranks} must be at least 1")
        run_calibration(args, tiny_step_seconds)
        return
    if args.model is None:
        parser.error("the following arguments are required: model")

    explicit = {name: getattr(args, name) for name in (Axis.DP, Axis.TP, Axis.PP) if getattr(args, name) is not None}
    whole_mesh = len(explicit) == 3
    if args.gpus is None and not whole_mesh:
        parser.error("give --gpus N (every mesh for N GPUs, keeping any of --dp/--tp/--pp/--cp given) or all of "
                     "--dp, --tp and --pp")
    if whole_mesh and args.dp_shard == "all":
        parser.error("--dp-shard all searches dp_shard over the meshes of --gpus; with --dp/--tp/--pp give a number")
    dp_shard = None if args.dp_shard in (None, "all") and not whole_mesh else args.dp_shard or 1
    if args.microbatches is not None and args.global_batch is not None:
        parser.error("give --microbatches or --global-batch, not both (the global batch fixes the microbatches)")
    for name in ("gpus", "global_batch", "ep", *explicit):
        value = getattr(args, name)
        if value is not None and value < 1:
            parser.error(f"--{name.replace('_', '-')}={value} must be at least 1")
    config = load_config(args.model)
    positions = getattr(config, "max_position_embeddings", None) or getattr(config, "n_positions", None) or 4096
    seq_len = args.seq_len or min(positions, 4096)
    hw = Hardware(gpu_memory=args.gpu_memory, gpus_per_node=args.gpus_per_node, tflops=args.tflops,
                  nvlink_gbps=args.nvlink_gbps, ib_gbps=args.ib_gbps, host_gbps=args.host_gbps)
    cal = Calibration.load(args.calibration) if args.calibration else None
    if args.expert_loads is not None:
        with open(args.expert_loads) as f:
            args.expert_loads = json.load(f)
    if args.auto:
        run_auto(args, config, seq_len=seq_len, hw=hw, calibration=cal, explicit=explicit, parser=parser)
        return
    # The model is loaded in float32; mixed precision casts its parameters, as parallelize does.
    try:
        planner = Planner(config, seq_len=seq_len, micro_batch_size=args.micro_batch_size, dtype=torch.float32,
                          expert_loads=args.expert_loads)
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        raise SystemExit(2) from None
    training = dict(mixed_precision=MIXED_PRECISION[args.dtype], zero=args.zero, recompute=args.recompute,
                    sequence_parallel=args.sequence_parallel, loss_chunk_tokens=args.loss_chunk_tokens,
                    offload=args.offload)
    options = run_options(args)
    try:
        if whole_mesh:
            # the degrees given (1 where not); dp_shard as resolved above (--dp-shard all is refused at one mesh)
            degrees = {**{name: getattr(args, name) or 1 for name in DEGREES}, "dp_shard": dp_shard}
            if args.gpus is not None:
                ParallelDims.of(degrees, axes=MESH_DEGREES).check_world_size(args.gpus)
            microbatches = microbatches_for(args.pp, args.microbatches, schedule=args.schedule, dp=args.dp,
                                            global_batch=args.global_batch, micro_batch_size=args.micro_batch_size)
            parallel = at_mesh(options, degrees, microbatches=microbatches)
            est = planner.estimate(parallel, zero=args.zero)
            print(json.dumps(to_json(est, hw, cal), indent=1) if args.json else mesh_report(est, hw, cal))
            return
        accepted, rejected = search(planner, options, gpus=args.gpus, hw=hw, zero=args.zero,
                                    microbatches=args.microbatches, global_batch=args.global_batch, fixed=explicit,
                                    cp=args.cp, ep=args.ep, dp_shard=dp_shard, calibration=cal)
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        raise SystemExit(2) from None
    if args.json:
        print(json.dumps({"meshes": [{**to_json(c.estimate, hw, cal), "rank": i}
                                     for i, c in enumerate(accepted, 1)],
                          "rejected": [{**r.degrees, "reason": r.reason} for r in rejected]}, indent=1))
        return
    label = settings(**training, dp_shard=dp_shard or 1) + (", dp_shard searched" if dp_shard is None else "")
    kept = "".join(f", {k}={v}" for k, v in explicit.items())
    batch = f", global batch {args.global_batch}" if args.global_batch else ""
    ep = args.ep if args.ep is not None or planner.experts else 1  # searched only for a model with experts
    print(f"{config.model_type}: {planner.total_params:,} parameters, {args.gpus} GPUs{kept}, sequences of {seq_len}, "
          f"micro-batch {args.micro_batch_size}{batch}, {label}"
          + (", ep searched" if ep is None else f", ep={ep}" if ep > 1 else ""))
    print(ranking_report(accepted, rejected, hw=hw, top=args.top, label=label, ep=ep, dp_shard=dp_shard != 1))
    if accepted:
        print("\nbest mesh in detail:\n")
        print(mesh_report(accepted[0].estimate, hw, cal))


def run_auto(args: argparse.Namespace, config, *, seq_len: int, hw: Hardware, calibration: Calibration | None,
             explicit: dict, parser: argparse.ArgumentParser) -> None:
    """--auto: ``auto_plan`` at --gpus and --global-batch, keeping the options given (--dtype's precision,
    degrees, --recompute, --sequence-parallel)."""
    if args.gpus is None or args.global_batch is None:
        parser.error("--auto needs --gpus N and --global-batch B (auto trains exactly B sequences per step)")
    if args.microbatches is not None or args.zero or as_schedule(args.schedule) is not Schedule.ONE_F_ONE_B or args.virtual_stages != 1:
        parser.error("--auto chooses the microbatches and the schedule, and not ZeRO-1 (dp_shard, searched, shards "
                     "more): leave out --microbatches, --schedule, --virtual-stages and --zero")
    fixed = {**{str(k): v for k, v in explicit.items()}, "mixed_precision": MIXED_PRECISION[args.dtype],
             "sequence_parallel": args.sequence_parallel,
             **{k: v for k, v in (("recompute", args.recompute), ("cp", args.cp), ("ep", args.ep),
                                  ("dp_shard", args.dp_shard), ("loss_chunk_tokens", args.loss_chunk_tokens),
                                  ("offload", args.offload))
                if v not in (None, "all")},
             # the options parallelize takes as they are, kept where they differ from its defaults
             **{k: v for k, v in (("dp_shard_gather", Gather(args.dp_shard_gather)),
                                  ("expert_dispatch", Dispatch(args.expert_dispatch)))
                if v not in (Gather.STEP, Dispatch.ALL_TO_ALL)}}
    try:
        choice = auto_plan(config, global_batch=args.global_batch, seq_len=seq_len, world_size=args.gpus,
                           device_memory=args.gpu_memory, calibration=calibration, fixed=fixed,
                           gpus_per_node=args.gpus_per_node, expert_loads=args.expert_loads,
                           exhaustive=args.exhaustive)
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        raise SystemExit(2) from None
    if args.json:
        up = choice.runner_up
        print(json.dumps({"chosen": {**to_json(choice.feasible[0].estimate, hw, calibration),
                                     "config": choice.config.keywords()},
                          "runner_up": None if up is None else {**to_json(up.estimate, hw, calibration),
                                                                "config": up.estimate.parallel.keywords()},
                          "why": choice.why, "feasible": len(choice.feasible), "unpriced": choice.unpriced,
                          "assumed": list(choice.assumed)},
                         indent=1, default=str))
        return
    print(f"{config.model_type}: {args.gpus} GPUs, a global batch of {args.global_batch} x {seq_len} tokens")
    print(choice.summary())
    print("\nchosen in detail:\n")
    print(mesh_report(choice.feasible[0].estimate, hw, calibration))
