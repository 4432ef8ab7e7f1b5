"""Measuring a ``Calibration`` (calibration.py): what this machine does while every rank of a job
runs at once. ``measure`` runs on every rank of a launched world; ``calibrate`` starts a local gloo
world for a process outside one. Ranks that share cores or a device contend as a real job's do; the
compute timings are averaged over the ranks (``_mean``) and the collectives' agreed with an all-reduce
MAX (a collective ends when its slowest rank does), so every rank returns the same ``Calibration``.

- matmul: ``x @ w.T`` forward and both backward products (6 x rows x width^2 FLOPs) over a grid of
  rows and widths, per dtype; float32 always (what the readers fall back to), a dtype the device
  lacks skipped and named in ``assumed``.
- grouped: routed experts' products as transformers' ``grouped_mm`` experts run them, over a grid
  of tokens per expert and widths, per dtype the device's grouped kernel takes.
- attention: causal ``scaled_dot_product_attention`` forward and backward at two lengths, its FLOPs
  counted as the planner counts them (12 x hidden x seq per token), a line through the two.
- op: a chain of a layer's elementwise ops as Hugging Face writes them (norm, rotary, gated
  activation, residual), forward and backward, on a small tensor (mostly the latency per op) and a
  large one (mostly the bytes the ops write), counted as the trace counts a forward's; a line through
  the two (latency per op, bytes written per second).
- collectives: groups laid out as a mesh lays out an axis (``layouts``), all of a layout's groups
  at once; payloads as ``CommMeter`` counts them, a least-squares line through them.
- overlap: a compute loop, an all-reduce about as long, and both at once.
- waits: the time spent inside a one-float all-reduce after compute segments of several lengths,
  less its aligned time: how long ranks that drift apart over a segment wait for each other at a
  blocking exchange (exchange_timing.py).
- optimizer: AdamW's step over many small parameters and over a few large ones, a line through
  the two (latency per tensor, bytes of state per second).
- host_copy: a block input to the host and back as ``offload="activations"`` moves it (its own code: on CUDA
  pinned memory and a side stream, so the host-device bandwidth), at two sizes, a line through the two.
- overheads (given a step runner, ``step_seconds``, and not in a quick calibration): qn_hf's own
  host work once a step and per call of each mechanism's exchanges, from tiny models' steps against
  what the figures above predict for them (overheads.py).
- compute_scale: a stack of pre-norm MLP blocks timed whole against the sum of its parts' figures,
  each time beside a timing of its product (compute_timing.py): what composing kernels into a step
  costs beyond them.

A timing is the median of samples after a warm-up, the compute timings' samples taken in turn (a
slow minute of the machine meets one sample of each); a compute sample repeats its call for
``SAMPLE_S`` so the clock and Python's loop do not count; CUDA is synchronized before the clock is read.
"""

from __future__ import annotations

import dataclasses
import os
import statistics
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass

import torch
import torch.distributed as dist

from ..arguments import check_choice, check_positive_int
from ..comm_meter import Collective
from ..compat import all_gather_single, reduce_scatter_single
from ..launch.nodes import local_rank
from ..launch.nodes import ranks_per_node as nodes_ranks_per_node
from ..local_world import LocalWorld
from .calibration import FORMAT, Calibration, CollectiveFit, Fit, Link, MatmulTable, fit_line, fit_per_call
from .compute_timing import (
    GROUPS,
    attention_call,
    attention_flops,
    composed_ratios,
    elementwise_call,
    grouped_call,
    matmul_call,
    offload_call,
    optimizer_call,
    seconds_in_turn,
    seconds_per_call,
)
from .exchange_timing import agree, align, aligned_seconds, mean, wait_table
from .overheads import StepSeconds, measure_overheads

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
CPU_DTYPES = ("float32", "bfloat16")  # float16 matmuls on a CPU are emulated: no job computes in them
KIB, MIB, M = 1024, 1024**2, 1 << 20  # M: a million elements
COLLECTIVE_OPS = (Collective.ALL_REDUCE, Collective.ALL_GATHER_INTO_TENSOR, Collective.REDUCE_SCATTER_TENSOR,
                  Collective.ALL_TO_ALL_SINGLE)
CALIBRATE_TIMEOUT_S = 900.0
OP_WIDTH = 256  # the op chain's last dimension (a hidden size's order)
MIN_SCALE, MAX_SCALE = 0.5, 4.0  # a composed step outside these of its parts' sum is a broken measurement


@dataclass(frozen=True)
class Sizes:
    """What is measured on a kind of device: the largest points near its peak, a CPU's whole run
    well under a minute at two ranks on two cores (quick: about 10 s)."""

    rows: tuple[int, ...]
    widths: tuple[int, ...]
    heads: int
    head_dim: int
    seqs: tuple[int, int]
    op_numel: int  # elements of the op chain's large tensor (its rows x OP_WIDTH)
    payloads: tuple[int, ...]  # bytes per collective call
    overlap_s: float  # the overlap test's compute loop
    overlap_width: int  # of its square matmuls
    overlap_max_bytes: int
    repeats: int
    block: tuple[int, int] = (512, 256)  # rows and width of the composed blocks (compute_timing.py)
    # the optimizer's step: (parameter tensors, elements each), many small and a few large
    optimizer: tuple[tuple[int, int], ...] = ((64, 1024), (4, M))
    grouped_rows: tuple[int, ...] = (16, 64, 256, 1024)  # tokens an expert receives, in the experts' grid
    # compute before a blocking exchange, in seconds, and the width of its square matmuls (exchange_timing.py)
    wait_segments: tuple[float, ...] = (1e-3, 8e-3, 64e-3, 256e-3)
    wait_width: int = 256
    offload: tuple[int, ...] = (M // 4, 8 * M)  # float32 elements of a block input offload moves and brings back


CPU = Sizes(rows=(64, 256, 1024, 4096), widths=(64, 256, 1024), heads=4, head_dim=64, seqs=(128, 512),
            op_numel=4 * M, payloads=(4 * KIB, 256 * KIB, 4 * MIB), overlap_s=0.04, overlap_width=512,
            overlap_max_bytes=256 * MIB, repeats=5)
CUDA = Sizes(rows=(256, 1024, 4096, 16384), widths=(256, 1024, 4096, 8192), heads=16, head_dim=128,
             seqs=(1024, 4096), op_numel=64 * M, payloads=(64 * KIB, 16 * MIB, 256 * MIB), overlap_s=0.04,
             overlap_width=4096, overlap_max_bytes=2048 * MIB, repeats=5, block=(4096, 1024),
             optimizer=((256, 4096), (8, 16 * M)), grouped_rows=(64, 256, 1024, 4096),
             wait_segments=(1e-4, 1e-3, 1e-2, 1e-1), wait_width=1024)
QUICK_CPU = dataclasses.replace(CPU, rows=(64, 512), widths=(64, 256), op_numel=M, payloads=(4 * KIB, MIB), repeats=3,
                                grouped_rows=(16, 256), wait_segments=(2e-3, 32e-3))
QUICK_CUDA = dataclasses.replace(CUDA, rows=(256, 2048), widths=(256, 2048), op_numel=16 * M,
                                 payloads=(64 * KIB, 16 * MIB), repeats=3, grouped_rows=(64, 1024),
                                 wait_segments=(1e-4, 1e-2))


@dataclass(frozen=True)
class Layout:
    """Groups of ``ranks`` ranks that partition the world as a mesh lays out one axis: consecutive
    ranks (an inner axis), or one rank from each of ``ranks`` nodes (an axis across nodes)."""

    ranks: int
    link: Link
    groups: tuple[tuple[int, ...], ...]


def layouts(world_size: int, ranks_per_node: int) -> list[Layout]:
    """Every group size n >= 2 dividing the world: its consecutive groups (on one node when n divides
    the ranks per node) and, with several nodes, the strided groups taking one rank per node (only where
    the consecutive ones stay on a node, so that each (n, link) is measured once)."""
    if world_size % ranks_per_node:
        raise ValueError(f"ranks_per_node={ranks_per_node} does not divide world_size={world_size}")
    nodes = world_size // ranks_per_node
    out = []
    for n in range(2, world_size + 1):
        if world_size % n:
            continue
        inside = ranks_per_node % n == 0
        out.append(Layout(n, Link.NODE if inside else Link.NETWORK,
                          tuple(tuple(range(g * n, (g + 1) * n)) for g in range(world_size // n))))
        if inside and nodes % n == 0:
            out.append(Layout(n, Link.NETWORK, tuple(
                tuple(local + ranks_per_node * (block * n + i) for i in range(n))
                for block in range(nodes // n) for local in range(ranks_per_node))))
    return out


def _collective_call(op: Collective, payload: int, group: dist.ProcessGroup, n: int,
                     device: torch.device) -> tuple[Callable[[], object], int]:
    """The call of ``op`` on ``group`` and its payload in bytes as ``CommMeter`` counts it (a
    reduce-scatter's or all-to-all's input rounded to n whole pieces)."""
    numel = payload // 4 if op in (Collective.ALL_REDUCE, Collective.ALL_GATHER_INTO_TENSOR) else payload // 4 // n * n
    x = torch.ones(numel, device=device)
    out = torch.empty({Collective.ALL_GATHER_INTO_TENSOR: numel * n, Collective.REDUCE_SCATTER_TENSOR: numel // n,
                       Collective.ALL_TO_ALL_SINGLE: numel}.get(op, 0), device=device)
    calls = {Collective.ALL_REDUCE: lambda: dist.all_reduce(x, group=group),
             Collective.ALL_GATHER_INTO_TENSOR: lambda: all_gather_single(out, x, group=group),
             Collective.REDUCE_SCATTER_TENSOR: lambda: reduce_scatter_single(out, x, group=group),
             Collective.ALL_TO_ALL_SINGLE: lambda: dist.all_to_all_single(out, x, group=group)}
    return calls[op], numel * 4


def _exchange_call(pair: tuple[int, ...], payload: int, device: torch.device) -> Callable[[], object]:
    """A round trip between the pair: the first rank sends, then the second sends back."""
    first, x = dist.get_rank() == pair[0], torch.ones(payload // 4, device=device)
    peer, y = pair[1] if first else pair[0], torch.empty_like(x)
    if first:
        return lambda: (dist.send(x, peer), dist.recv(y, peer))
    return lambda: (dist.recv(y, peer), dist.send(x, peer))


def _collectives(device: torch.device, sizes: Sizes, ranks_per_node: int) -> tuple[CollectiveFit, ...]:
    rank, world = dist.get_rank(), dist.get_world_size()
    measured: list[tuple[Layout, Collective, list[int], list[float]]] = []
    for layout in layouts(world, ranks_per_node):
        # every rank creates every group, in the same order; then each runs its own, all at once
        groups = [dist.new_group(list(g)) for g in layout.groups]
        mine = next(i for i, g in enumerate(layout.groups) if rank in g)
        for op in COLLECTIVE_OPS:
            nbytes, seconds = [], []
            for payload in sizes.payloads:
                call, counted = _collective_call(op, payload, groups[mine], layout.ranks, device)
                nbytes.append(counted)
                seconds += aligned_seconds([call], device, repeats=3 * sizes.repeats)
            measured.append((layout, op, nbytes, seconds))
        if layout.ranks == 2:
            calls = [_exchange_call(layout.groups[mine], p, device) for p in sizes.payloads]
            seconds = [t / 2 for t in aligned_seconds(calls, device, repeats=3 * sizes.repeats)]
            measured.append((layout, Collective.SEND, list(sizes.payloads), seconds))
        align(device)  # no rank destroys its group while another member may still be using it
        dist.destroy_process_group(groups[mine])  # (the others' handles are placeholders on this rank)
    agreed = iter(agree([t for *_, seconds in measured for t in seconds], device))
    out = []
    for layout, op, nbytes, seconds in measured:
        fit = fit_line(nbytes, [next(agreed) for _ in seconds])
        for each in (op, Collective.RECV) if op == Collective.SEND else (op,):
            out.append(CollectiveFit(op=each, ranks=layout.ranks, link=layout.link, fit=fit))
    return tuple(out)


def _overlap(device: torch.device, sizes: Sizes, world_fit: Fit) -> tuple[float, str]:
    """The share of an asynchronous all-reduce over the world that a compute loop running meanwhile
    hides, (T_compute + T_reduce - T_both) / min(T_compute, T_reduce) clamped to 0..1, and the times."""
    a = torch.randn(sizes.overlap_width, sizes.overlap_width, device=device)
    out = torch.empty_like(a)
    (one,) = agree([seconds_per_call(lambda: torch.mm(a, a, out=out), device, repeats=3)], device)
    count = max(1, round(sizes.overlap_s / one))  # the same on every rank, as is the all-reduce's size

    def compute() -> None:
        for _ in range(count):
            torch.mm(a, a, out=out)

    def reduce(x: torch.Tensor) -> Callable[[], None]:
        return lambda: dist.all_reduce(x, async_op=True).wait()

    def elements(nbytes: float) -> int:
        return int(min(max(nbytes, 4 * KIB), sizes.overlap_max_bytes)) // 4

    # The all-reduce as long as the compute: sized by the fit, then corrected by one trial at that
    # size (the fit's payloads are far smaller, and its line misses by 2x on gloo).
    x = torch.ones(elements((count * one - world_fit.latency) * world_fit.rate), device=device)
    (trial,) = agree(aligned_seconds([reduce(x)], device, repeats=1), device)
    x = torch.ones(elements(x.numel() * 4 * count * one / trial), device=device)

    def both() -> None:
        work = dist.all_reduce(x, async_op=True)
        compute()
        work.wait()

    t_c, t_a, t_both = agree(aligned_seconds([compute, reduce(x), both], device, repeats=sizes.repeats), device)
    times = f"compute {t_c * 1e3:.1f} ms, all-reduce of {x.numel() * 4:,} B {t_a * 1e3:.1f} ms, both {t_both * 1e3:.1f}"
    return min(max((t_c + t_a - t_both) / min(t_c, t_a), 0.0), 1.0), times


def _default_device() -> torch.device:
    # A gloo world measures the CPU (what a gloo job computes on); NCCL ranks their own GPU.
    if torch.cuda.is_available() and dist.get_backend() == dist.Backend.NCCL:
        return torch.device("cuda", local_rank())
    return torch.device("cpu")


def _supported(name: str, device: torch.device) -> bool:
    if device.type == "cuda":
        return DTYPES[name] != torch.bfloat16 or torch.cuda.is_bf16_supported()
    return name in CPU_DTYPES


def _table(rows: Sequence[int], widths: Sequence[int], seconds: Iterator[float], *, groups: int = 1) -> MatmulTable:
    """A grid's rates from its timings, taken rows outer (6 x groups x rows x width^2 FLOPs each)."""
    return MatmulTable(rows=tuple(rows), widths=tuple(widths), rates=tuple(
        tuple(6.0 * groups * r * w * w / next(seconds) for w in widths) for r in rows))


def _grouped_supported(name: str, device: torch.device) -> bool:
    """Whether this device's ``torch._grouped_mm`` takes ``name`` (CUDA's takes bfloat16 only on
    some releases), agreed over the ranks."""
    try:
        grouped_call(1, 16, DTYPES[name], device)()
        ok = 1.0
    except (RuntimeError, NotImplementedError, AttributeError):
        ok = 0.0
    return bool(agree([ok], device, op=dist.ReduceOp.MIN)[0])


def measure(*, dtypes: Sequence[str] = ("float32",), quick: bool = False,
            device: torch.device | str | None = None, step_seconds: StepSeconds | None = None) -> Calibration:
    """This machine's figures, measured by every rank of the initialized default process group at
    once (module docstring); call it on every rank. The same ``Calibration`` comes back on each.
    ``device``: by default this rank's GPU (LOCAL_RANK) under NCCL, else the CPU."""
    if not dist.is_initialized():
        raise RuntimeError("measure runs on every rank of an initialized process group; outside one, call "
                           "calibrate(world_size)")
    for name in dtypes:
        check_choice("dtype", name, tuple(DTYPES))
    device = _default_device() if device is None else torch.device(device)
    sizes = (QUICK_CUDA if quick else CUDA) if device.type == "cuda" else (QUICK_CPU if quick else CPU)
    world = dist.get_world_size()
    ranks_per_node = min(nodes_ranks_per_node() or world, world)
    names = list(dict.fromkeys(("float32", *dtypes)))  # float32 first: what every reader falls back to
    skipped = [n for n in names if not _supported(n, device)]
    names = [n for n in names if n not in skipped]
    assumed = [f"{n} matmul and attention ({n} unsupported on {device.type}: read as float32)" for n in skipped]

    align(device)
    grid = [(r, w) for r in sizes.rows for w in sizes.widths]
    # every compute timing's samples taken in turn (compute_timing.seconds_in_turn)
    matmuls = [matmul_call(r, w, DTYPES[n], device) for n in names for r, w in grid]
    attentions = [attention_call(s, heads=sizes.heads, head_dim=sizes.head_dim, dtype=DTYPES[n], device=device)
                  for n in names for s in sizes.seqs]
    experts = [n for n in names if _grouped_supported(n, device)]
    assumed += [f"{n} routed experts' grouped products (the device's grouped kernel refused {n}: read as its "
                "matmuls)" for n in names if n not in experts]
    grouped_grid = [(r, w) for r in sizes.grouped_rows for w in sizes.widths]
    groups = [grouped_call(r, w, DTYPES[n], device) for n in experts for r, w in grouped_grid]
    chain = [elementwise_call(rows, OP_WIDTH, device) for rows in (8, sizes.op_numel // OP_WIDTH)]
    optimizers = [optimizer_call(tensors, numel, device=device) for tensors, numel in sizes.optimizer]
    copies = [offload_call(numel, device=device) for numel in sizes.offload]
    agreed = iter(mean(seconds_in_turn([*matmuls, *attentions, *groups, *(fn for _, _, fn in chain), *optimizers,
                                        *copies], device, repeats=sizes.repeats), device))
    del matmuls, attentions, groups, optimizers, copies
    matmul = {n: _table(sizes.rows, sizes.widths, agreed) for n in names}
    attention = {n: fit_line([attention_flops(s, heads=sizes.heads, head_dim=sizes.head_dim) for s in sizes.seqs], [next(agreed) for _ in sizes.seqs])
                 for n in names}
    grouped = {n: _table(sizes.grouped_rows, sizes.widths, agreed, groups=GROUPS) for n in experts}
    op = fit_per_call([(ops, nbytes, next(agreed)) for ops, nbytes, _ in chain])
    # per tensor and per byte of state: weights, gradients and the two moments, 16 bytes an element
    optimizer = fit_per_call([(tensors, tensors * numel * 16, next(agreed)) for tensors, numel in sizes.optimizer])
    host_copy = fit_line([4 * numel for numel in sizes.offload], [next(agreed) for _ in sizes.offload])
    ratios = mean(composed_ratios(*sizes.block, dtype=torch.float32, device=device, op=op, pairs=sizes.repeats),
                   device)
    compute_scale = min(max(statistics.median(ratios), MIN_SCALE), MAX_SCALE)

    collectives: tuple[CollectiveFit, ...] = ()
    overlap, waits = 0.0, None
    notes = {"mode": "quick" if quick else "full", "torch": torch.__version__}
    if world > 1:
        collectives = _collectives(device, sizes, ranks_per_node)
        widest = max(c.ranks for c in collectives)
        world_fit = next(c.fit for c in collectives if c.op == Collective.ALL_REDUCE and c.ranks == widest)
        overlap, notes["overlap"] = _overlap(device, sizes, world_fit)
        waits = wait_table(device, segments=sizes.wait_segments, width=sizes.wait_width, repeats=sizes.repeats,
                           exchange=world_fit.seconds(4))
        if not any(c.op == Collective.SEND for c in collectives):
            assumed.append("send/recv (no pairs at an odd world size: priced as an all-reduce)")

    memory = (torch.cuda.get_device_properties(device).total_memory if device.type == "cuda"
              else os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") // ranks_per_node)
    (memory,) = agree([memory], device, op=dist.ReduceOp.MIN)
    (threads,) = agree([torch.get_num_threads()], device)
    cal = Calibration(
        device=torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
        backend=str(dist.get_backend()), world_size=world, ranks_per_node=ranks_per_node, matmul=matmul,
        attention=attention, op=op, collectives=collectives, overlap=overlap, memory_bytes=int(memory),
        assumed=tuple(assumed), threads=int(threads), format=FORMAT, notes=notes, compute_scale=compute_scale,
        optimizer=optimizer, grouped=grouped, waits=waits, host_copy=host_copy)
    # qn_hf's own host work, priced at the figures above (a quick calibration, or one without a
    # step runner, leaves it out)
    if quick or step_seconds is None:
        return cal
    return dataclasses.replace(cal, overheads=measure_overheads(cal, device, step_seconds=step_seconds))


def calibrate(world_size: int = 1, *, dtypes: Sequence[str] = ("float32",), quick: bool = False,
              step_seconds: StepSeconds | None = None) -> Calibration:
    """``measure`` in a process outside a launched world: on ``world_size`` local gloo ranks
    (``LocalWorld``, the cores shared among them), rank 0's figures. Inside an initialized process
    group, ``measure`` on this rank (every rank must call it)."""
    if dist.is_available() and dist.is_initialized():
        return measure(dtypes=dtypes, quick=quick, step_seconds=step_seconds)
    check_positive_int("world_size", world_size)
    with LocalWorld(world_size) as world:
        return world.run(measure, timeout=CALIBRATE_TIMEOUT_S, dtypes=tuple(dtypes), quick=quick,
                         step_seconds=step_seconds)[0]


def summary(cal: Calibration) -> list[str]:
    """A few lines naming the headline figures (for the command line)."""
    lines = [f"{cal.device}, {cal.backend}, {cal.world_size} rank(s), {cal.threads} thread(s) each"]
    lines += [f"matmul {name}: peak {max(max(r) for r in t.rates) / 1e9:,.1f} GFLOP/s (smallest point "
              f"{t.rates[0][0] / 1e9:,.1f})" for name, t in cal.matmul.items()]
    lines += [f"attention {name}: {fit.rate / 1e9:,.1f} GFLOP/s, latency {fit.latency * 1e6:,.0f} us"
              for name, fit in cal.attention.items()]
    lines.append(f"op: {cal.op.latency * 1e6:,.1f} us each, {cal.op.rate / 1e9:,.2f} GB/s written")
    reduces = [c for c in cal.collectives if c.op == Collective.ALL_REDUCE]
    if reduces:
        widest = max(reduces, key=lambda c: (c.ranks, c.link == Link.NETWORK))
        lines.append(f"all_reduce over {widest.ranks} ranks ({widest.link}): latency "
                     f"{widest.fit.latency * 1e6:,.0f} us, {widest.fit.rate / 1e9:,.2f} GB/s of payload")
    lines.append(f"overlap of an asynchronous all-reduce: {cal.overlap:.2f}")
    return lines + (["not measured: " + "; ".join(cal.assumed)] if cal.assumed else [])
