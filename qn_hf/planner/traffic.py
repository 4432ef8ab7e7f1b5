"""Per-step communication of one rank of a pipeline stage, by group, as ``CommMeter`` counts it (the
payload this rank hands to each call: an all-reduce's tensor, a reduce-scatter's whole input, an
all-gather's own piece).

* tp: per microbatch, a forward all-reduce of each row-parallel output and vocab-parallel embedding
  output, a backward all-reduce of the input of each tp entry (attention, MLP) and of each column
  layer outside one (the vocab-parallel head), and the vocab-parallel loss's 3 floats per row.
  Recomputation (full or selective) runs a block's forward again in backward, and with it the
  all-reduce of each row layer that has something saved after it in the block (``Trace.rerun``).
* pp: per microbatch, the hidden state forward and its gradient backward to each neighbour (both
  directions counted on each rank), a 64-byte shape header per step, the 4-byte loss.
* dp: without ZeRO, an all-reduce of every gradient bucket; with ZeRO, a reduce-scatter of every
  bucket (the padded buffer, gradient dtype) and, after the optimizer step, an all-gather of every
  weight bucket (this rank's piece, parameter dtype); then the 8-byte target count and 4-byte loss.
  On gloo ZeRO's two are issued as one reduce and one broadcast per dp rank's piece
  (data_parallel.py), so each bucket takes 2 dp calls carrying the whole padded buffers.
* kv: replicated KV-head gradients when tp exceeds the KV heads; tie: a weight tied across the first
  and last stage (gradient dtype; under ZeRO only this rank's piece of them).
* float16's loss scaling: a 4-byte overflow flag over the whole job ("world", or the mesh dimension
  that spans it).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from ..pipeline.runtime import HEADER_INTS
from ..plan import TpPlan
from .memory import Bucket, owned
from .trace import Trace

HEADER_BYTES = HEADER_INTS * 8  # int64 values


@dataclass(frozen=True)
class GroupTraffic:
    calls: int
    nbytes: int


@dataclass(frozen=True)
class Mesh:
    dp: int
    tp: int
    pp: int
    microbatches: int


def stage_traffic(s: int, *, mesh: Mesh, plan: TpPlan, trace: Trace, stage_of: Callable[[str], int],
                  act_elem: int, param_elem: int, grad_elem: int, buckets: list[Bucket], zero: bool,
                  kv: dict[str, int], tied: dict[str, int], recompute: str | None,
                  loss_scaling: bool, backend: str = "nccl") -> dict[str, GroupTraffic]:
    """``kv`` and ``tied``: this stage's replicated-KV and cross-stage-tied parameters -> elements."""
    dp, tp, pp, microbatches = mesh.dp, mesh.tp, mesh.pp, mesh.microbatches
    out: dict[str, GroupTraffic] = {}
    if tp > 1:
        calls = nbytes = 0
        entered = lambda name: any(name.startswith(e + ".") for e in plan.tp_entries)  # noqa: E731
        for name, style in plan.rules:
            if stage_of(name) != s or name not in trace.io:
                continue
            io = trace.io[name]
            if style in ("rowwise", "vocab_embedding"):
                calls, nbytes = calls + io.calls, nbytes + io.out_numel * act_elem
                if recompute is not None and name in trace.rerun:
                    calls, nbytes = calls + io.calls, nbytes + io.out_numel * act_elem
            elif style.startswith("colwise") or style == "vocab_colwise":
                if not entered(name):
                    calls, nbytes = calls + io.calls, nbytes + io.in_numel * act_elem
                if style == "vocab_colwise" and plan.loss == "causal_lm":
                    calls, nbytes = calls + 2, nbytes + 3 * trace.logits_rows * 4
        for name in plan.tp_entries:
            if stage_of(name) == s and name in trace.io:
                calls, nbytes = calls + trace.io[name].calls, nbytes + trace.io[name].in_numel * act_elem
        out["tp"] = GroupTraffic(calls * microbatches, nbytes * microbatches)
    if pp > 1:
        neighbours = (s > 0) + (s < pp - 1)
        act = trace.boundary_numel * act_elem
        out["pp"] = GroupTraffic(2 * neighbours * microbatches + neighbours + 1,
                                 2 * neighbours * microbatches * act + neighbours * HEADER_BYTES + 4)
    pieces = owned(buckets, dp=dp) if zero else None
    if dp > 1:
        scalars = (8 if plan.loss else 0) + 4
        calls = 2 if plan.loss else 1
        if zero and backend == "gloo":
            out["dp"] = GroupTraffic(2 * dp * len(buckets) + calls,
                                     sum(b.padded * (grad_elem + param_elem) for b in buckets) + scalars)
        elif zero:
            out["dp"] = GroupTraffic(2 * len(buckets) + calls,
                                     sum(b.padded * grad_elem + b.piece(dp) * param_elem for b in buckets) + scalars)
        else:
            out["dp"] = GroupTraffic(len(buckets) + calls, sum(b.padded for b in buckets) * grad_elem + scalars)
    for group, params in (("kv", kv), ("tie", tied)):
        numel = sum(pieces.get(n, 0) for n in params) if pieces is not None else sum(params.values())
        if numel:
            out[group] = GroupTraffic(1, numel * grad_elem)
    if loss_scaling:
        spanning = [g for g, n in (("dp", dp), ("tp", tp), ("pp", pp)) if n == dp * tp * pp]
        group = spanning[-1] if spanning else "world"  # CommMeter names the default group by a dimension spanning it
        previous = out.get(group, GroupTraffic(0, 0))
        out[group] = GroupTraffic(previous.calls + 1, previous.nbytes + 4)
    return out
