"""What a machine does, as the planner's time model reads it: measured (``calibrate.py``), or the
stated defaults of a ``Hardware`` with the assumed figures named.

Every figure is a line ``seconds = calls x latency + amount / rate``: for a matrix product the
amount is its FLOPs and the rate depends on its shape (a small product runs far below the peak,
most of all on a CPU), so matmuls keep a table over (rows, width) read between its points; for
attention the amount is the FLOPs the planner counts for it (``12 x hidden x positions`` per token,
forward and backward: the calibration times its kernel under the same count, so how the kernel
skips the masked half is in the rate); for every other op of a forward the latency is what one op
costs (forward and its backward, dispatch and autograd included) and the amount the bytes it
writes; for a collective the amount is its payload as ``CommMeter`` counts it (an all-reduce's
tensor, an all-gather's own piece, a reduce-scatter's whole input), over a group of that many
ranks on that kind of link, so ring factors are in the measured rate rather than in a formula.

``waits`` is what a blocking exchange costs beyond its transfer when it follows compute: the ranks
do not arrive together (a shared host's jitter, a device's clock), and the earlier waits for the
later; measured after compute segments of several lengths, since the spread grows with the
compute since the last exchange (``exchange_timing.py``).

``overlap`` is the share of an asynchronous collective's time that compute running meanwhile hides,
as measured on this backend (NCCL's own stream: nearly all; gloo's threads on the cores the
compute uses: little), applied only where qn_hf posts a collective asynchronously and computes
before waiting (``cost.py`` says where).
"""

from __future__ import annotations

import bisect
import json
import math
import os
import tempfile
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field

from ..arguments import Choice
from ..comm_meter import Collective

FORMAT = 2  # 2: host_copy


class Link(Choice):
    """Where a group's ranks sit: all on one node, or across nodes."""

    NODE = "node"
    NETWORK = "network"


@dataclass(frozen=True)
class Fit:
    """``seconds = calls x latency + amount / rate``."""

    latency: float
    rate: float

    def seconds(self, amount: float, calls: float = 1.0) -> float:
        return calls * self.latency + amount / self.rate


FLOOR_SHARE = 0.01  # a line whose time did not grow with the amount: the largest amount adds this share


def fit_line(amounts: Sequence[float], seconds: Sequence[float]) -> Fit:
    """The least-squares line ``seconds = latency + amount / rate``. A negative intercept (noise about
    a line through the origin) is refitted through the origin; a slope not positive (time that did not
    grow with the amount) becomes the rate at which the largest amount adds ``FLOOR_SHARE`` of the least time."""
    n = len(amounts)
    mean_a, mean_t = sum(amounts) / n, sum(seconds) / n
    var = sum((a - mean_a) ** 2 for a in amounts)
    slope = sum((a - mean_a) * (t - mean_t) for a, t in zip(amounts, seconds)) / var if var > 0 else 0.0
    if slope <= 0:
        return Fit(latency=min(seconds), rate=max(amounts) / (FLOOR_SHARE * min(seconds)))
    intercept = mean_t - slope * mean_a
    if intercept < 0:
        return Fit(latency=0.0, rate=sum(a * a for a in amounts) / sum(a * t for a, t in zip(amounts, seconds)))
    return Fit(latency=intercept, rate=1.0 / slope)


def fit_per_call(points: Sequence[tuple[float, float, float]]) -> Fit:
    """The least-squares ``seconds = calls x latency + amount / rate`` through (calls, amount,
    seconds) points, with fit_line's fallbacks: a negative latency refitted as zero, a rate not
    positive floored."""
    scc = sum(c * c for c, _, _ in points)
    saa = sum(a * a for _, a, _ in points)
    sca = sum(c * a for c, a, _ in points)
    sct = sum(c * t for c, _, t in points)
    sat = sum(a * t for _, a, t in points)
    det = scc * saa - sca * sca
    latency = (sct * saa - sat * sca) / det if det > 0 else -1.0
    per_byte = (scc * sat - sca * sct) / det if det > 0 else -1.0
    if latency < 0:
        return Fit(latency=0.0, rate=saa / sat)
    if per_byte <= 0:
        return Fit(latency=min(t / c for c, _, t in points),
                   rate=max(a for _, a, _ in points) / (FLOOR_SHARE * min(t for _, _, t in points)))
    return Fit(latency=latency, rate=1.0 / per_byte)


@dataclass(frozen=True)
class MatmulTable:
    """FLOP/s of a matrix product (forward and both backward products) by its rows (tokens) and its
    width (the smaller of its two weight dimensions), measured on a grid; read log-bilinearly
    between the points and clamped outside them."""

    rows: tuple[int, ...]
    widths: tuple[int, ...]
    rates: tuple[tuple[float, ...], ...]  # rates[i][j]: rows[i], widths[j]

    @classmethod
    def from_json(cls, data: dict) -> MatmulTable:
        return cls(rows=tuple(data["rows"]), widths=tuple(data["widths"]), rates=tuple(tuple(r) for r in data["rates"]))

    def rate(self, rows: float, width: float) -> float:
        def place(grid: tuple[int, ...], x: float) -> tuple[int, int, float]:
            x = min(max(x, grid[0]), grid[-1])
            hi = min(max(bisect.bisect_left(grid, x), 1), len(grid) - 1) if len(grid) > 1 else 0
            lo = max(hi - 1, 0)
            if lo == hi:
                return lo, hi, 0.0
            return lo, hi, (math.log(x) - math.log(grid[lo])) / (math.log(grid[hi]) - math.log(grid[lo]))

        i0, i1, a = place(self.rows, rows)
        j0, j1, b = place(self.widths, width)
        log = [[math.log(r) for r in row] for row in self.rates]
        value = ((1 - a) * ((1 - b) * log[i0][j0] + b * log[i0][j1])
                 + a * ((1 - b) * log[i1][j0] + b * log[i1][j1]))
        return math.exp(value)


@dataclass(frozen=True)
class WaitTable:
    """Seconds a rank waits at a blocking exchange, beyond the exchange's own time, after ``segments``
    seconds of compute since the last one (measured points, ascending); read linearly between them,
    and in proportion to the segment outside them (the measured spread grew with the segment)."""

    segments: tuple[float, ...]
    waits: tuple[float, ...]

    @classmethod
    def from_json(cls, data: dict) -> WaitTable:
        return cls(segments=tuple(data["segments"]), waits=tuple(data["waits"]))

    def wait(self, segment: float) -> float:
        first, last = self.segments[0], self.segments[-1]
        if segment <= first:
            return self.waits[0] * segment / first
        if segment >= last:
            return self.waits[-1] * segment / last
        hi = bisect.bisect_left(self.segments, segment)
        a = (segment - self.segments[hi - 1]) / (self.segments[hi] - self.segments[hi - 1])
        return (1 - a) * self.waits[hi - 1] + a * self.waits[hi]

    def total(self, seconds: float, exchanges: float) -> float:
        """The waits of ``exchanges`` blocking exchanges spread evenly over ``seconds`` of compute."""
        return exchanges * self.wait(seconds / exchanges) if exchanges > 0 and seconds > 0 else 0.0


@dataclass(frozen=True)
class CollectiveFit:
    op: Collective
    ranks: int
    link: Link
    fit: Fit


@dataclass(frozen=True)
class Calibration:
    """One machine's figures (module docstring). ``assumed`` names what was not measured."""

    device: str  # "cpu", or the GPU's name
    backend: str  # the process group's: "gloo" or "nccl"
    world_size: int  # ranks running at once while measured (they share the machine as a job's do)
    ranks_per_node: int
    matmul: dict[str, MatmulTable]  # compute dtype name ("float32", "bfloat16", "float16") -> table
    attention: dict[str, Fit]  # dtype name -> FLOPs fit of one attention call, forward and backward
    op: Fit  # any other op of a forward: latency per op (forward and backward), rate in bytes written/s
    collectives: tuple[CollectiveFit, ...]
    overlap: float  # share of an asynchronous collective hidden by compute meanwhile (0..1)
    memory_bytes: int  # device memory per rank
    assumed: tuple[str, ...] = ()
    threads: int = 1  # intra-op threads per rank while measured
    format: int = FORMAT
    notes: dict[str, str] = field(default_factory=dict)
    # a step's compute against the sum of its kernels' figures (calibrate.py: composed blocks timed whole)
    compute_scale: float = 1.0
    # AdamW's step: latency per parameter tensor, rate in bytes of state (weights, gradients and both
    # moments) per second; None (a file from before it was measured): priced from the op fit
    optimizer: Fit | None = None
    # routed experts' grouped products: FLOP/s by (rows per expert, width), per dtype; a dtype
    # missing (not measured, or the device's grouped kernel refused it): read from ``matmul``
    grouped: dict[str, MatmulTable] = field(default_factory=dict)
    # waits at blocking exchanges after compute (one rank, or a file from before they were measured: None)
    waits: WaitTable | None = None
    # qn_hf's host work (overheads.py): seconds once a step ("step") and per call of a group ("tp",
    # "cp", "pp", "ep", "dp_shard"); empty: not measured (a quick calibration, an older file)
    overheads: dict[str, float] = field(default_factory=dict)
    # a block input to the host and back under offload="activations", rate in its bytes per second (None: a
    # Calibration made by hand, priced as the op fit's writes)
    host_copy: Fit | None = None

    # -- reading -------------------------------------------------------------------------------
    @property
    def on_cpu(self) -> bool:
        """Ops run as the host issues them (no device queue to launch ahead into)."""
        return self.device == "cpu"

    def matmul_rate(self, dtype: str, *, rows: float, width: float) -> float:
        table = self.matmul.get(dtype) or self.matmul["float32"]
        return table.rate(rows, width)

    def grouped_rate(self, dtype: str, *, rows: float, width: float) -> float:
        """Routed experts' products at ``rows`` tokens an expert (``matmul_rate`` where not measured)."""
        table = self.grouped.get(dtype)
        return table.rate(rows, width) if table else self.matmul_rate(dtype, rows=rows, width=width)

    def attention_fit(self, dtype: str) -> Fit:
        return self.attention.get(dtype) or self.attention["float32"]

    def collective(self, op: Collective, *, ranks: int, link: Link) -> Fit:
        """The fit for ``op`` over ``ranks`` ranks on ``link``: measured at that size, or read from
        the nearest measured size by the ring's factors (latency x (n-1)/(m-1); the seconds per
        payload byte of an all-gather grow as its (n-1) pieces, the others' as (n-1)/n), a p2p
        transfer the same at any size; an op never measured is priced as an all-reduce."""
        fits = [c for c in self.collectives if c.op == op] or [c for c in self.collectives
                                                              if c.op == Collective.ALL_REDUCE]
        same = [c for c in fits if c.link == link] or fits
        exact = [c for c in same if c.ranks == ranks]
        if exact:
            return exact[0].fit
        near = min(same, key=lambda c: (abs(math.log(c.ranks) - math.log(max(ranks, 2))), -c.ranks))
        if op in (Collective.SEND, Collective.RECV):
            return near.fit
        n, m = max(ranks, 2), near.ranks
        scale = (n - 1) / (m - 1) if op == Collective.ALL_GATHER_INTO_TENSOR else ((n - 1) / n) / ((m - 1) / m)
        return Fit(latency=near.fit.latency * (n - 1) / (m - 1), rate=near.fit.rate / scale)

    # -- files ---------------------------------------------------------------------------------
    def to_json(self) -> dict:
        out = asdict(self)
        out["collectives"] = [{"op": str(c.op), "ranks": c.ranks, "link": str(c.link), **asdict(c.fit)}
                              for c in self.collectives]
        out["assumed"] = list(self.assumed)
        return out

    @classmethod
    def from_json(cls, data: dict) -> Calibration:
        if data.get("format") != FORMAT:
            raise ValueError(f"calibration format {data.get('format')!r} is not {FORMAT}; run qn-hf-plan --calibrate again")
        try:
            return cls(
                device=data["device"], backend=data["backend"], world_size=int(data["world_size"]),
                ranks_per_node=int(data["ranks_per_node"]),
                matmul={k: MatmulTable.from_json(v) for k, v in data["matmul"].items()},
                attention={k: Fit(**v) for k, v in data["attention"].items()}, op=Fit(**data["op"]),
                collectives=tuple(CollectiveFit(op=Collective(c["op"]), ranks=int(c["ranks"]), link=Link(c["link"]),
                                                fit=Fit(latency=c["latency"], rate=c["rate"]))
                                  for c in data["collectives"]),
                overlap=float(data["overlap"]), memory_bytes=int(data["memory_bytes"]),
                assumed=tuple(data.get("assumed", ())), threads=int(data.get("threads", 1)),
                notes=dict(data.get("notes", {})), compute_scale=float(data.get("compute_scale", 1.0)),
                optimizer=Fit(**data["optimizer"]) if data.get("optimizer") else None,
                grouped={k: MatmulTable.from_json(v) for k, v in data.get("grouped", {}).items()},
                waits=WaitTable.from_json(data["waits"]) if data.get("waits") else None,
                overheads={k: float(v) for k, v in data.get("overheads", {}).items()},
                host_copy=Fit(**data["host_copy"]) if data.get("host_copy") else None)
        except (KeyError, TypeError) as e:
            raise ValueError(f"not a qn_hf calibration file: {e!r} missing or malformed") from e

    def save(self, path: str) -> None:
        """Written whole or not at all (a temporary file renamed over ``path``)."""
        folder = os.path.dirname(os.path.abspath(path))
        fd, tmp = tempfile.mkstemp(dir=folder, prefix=".calibration.")
        with os.fdopen(fd, "w") as f:
            json.dump(self.to_json(), f, indent=1)
        os.replace(tmp, path)

    @classmethod
    def load(cls, path: str) -> Calibration:
        with open(path) as f:
            return cls.from_json(json.load(f))


# Stated figures for a GPU without a calibration (an H100 class card, NVLink in a node, one 400 Gb/s
# NIC per GPU across nodes), each named in ``assumed``.
ASSUMED_LATENCY_S = {Link.NODE: 10e-6, Link.NETWORK: 20e-6}
ASSUMED_OP_S = 10e-6  # an op's kernel launches, forward and backward, on a busy stream
ASSUMED_MEMORY_RATE = 2.0e12  # bytes/s an elementwise op writes (HBM3, well below its peak)
ASSUMED_OVERLAP = 1.0  # NCCL runs on its own stream
NO_WAITS = "ranks' waits at blocking exchanges (priced as none)"


def assumed(*, tflops: float, nvlink_gbps: float, ib_gbps: float, gpus_per_node: int, gpu_memory: int,
            world_size: int = 8, host_gbps: float = 25.0) -> Calibration:
    """The figures the planner uses without a calibration: one FLOP rate for every matmul and
    attention, the link bandwidths as a ring moves bytes (an all-reduce 2(n-1)/n bytes per payload
    byte, a reduce-scatter (n-1)/n, an all-gather n-1, p2p and all-to-all 1 and (n-1)/n)."""
    flat = MatmulTable(rows=(1,), widths=(1,), rates=((tflops * 1e12,),))
    bandwidth = {Link.NODE: nvlink_gbps * 1e9, Link.NETWORK: ib_gbps * 1e9}
    sizes = sorted({2, *(n for n in (4, 8, 16, 32, 64, 128, 256, 512, 1024) if n <= max(world_size, 2))})
    fits = []
    for link, bw in bandwidth.items():
        for n in sizes:
            per_byte = {Collective.ALL_REDUCE: 2 * (n - 1) / n, Collective.REDUCE_SCATTER_TENSOR: (n - 1) / n,
                        Collective.ALL_GATHER_INTO_TENSOR: n - 1, Collective.ALL_TO_ALL_SINGLE: (n - 1) / n,
                        Collective.SEND: 1.0, Collective.RECV: 1.0}
            fits += [CollectiveFit(op=op, ranks=n, link=link,
                                   fit=Fit(latency=ASSUMED_LATENCY_S[link] * (1 if op in (Collective.SEND, Collective.RECV)
                                                                             else (n - 1)), rate=bw / factor))
                     for op, factor in per_byte.items()]
    names = ("matmul and attention FLOP rate", "collective bandwidths and latencies", "per-op latency",
             "elementwise memory rate", "overlap of asynchronous collectives", NO_WAITS, "host-device copy bandwidth")
    return Calibration(device="assumed GPU", backend="nccl", world_size=world_size, ranks_per_node=gpus_per_node,
                       matmul={"float32": flat}, attention={"float32": Fit(0.0, tflops * 1e12)},
                       op=Fit(ASSUMED_OP_S, ASSUMED_MEMORY_RATE), collectives=tuple(fits),
                       overlap=ASSUMED_OVERLAP, memory_bytes=gpu_memory, assumed=names,
                       host_copy=Fit(ASSUMED_LATENCY_S[Link.NODE], host_gbps * 1e9 / 2))  # there and back
