"""What one rank writes into a checkpoint: its tensors (``local_entries``: weights, or the float32
masters under mixed precision, then the optimizer's state, each marked with whether this rank is
the one that writes it) and the pieces each is cut into (``pieces_of``: boxes of the global tensor)."""

from __future__ import annotations

import math
from collections.abc import Iterator
from dataclasses import dataclass

import torch
from torch import nn

from ..data_parallel.optimizer import OptimizerView
from ..data_parallel.sharded import local, row_range
from ..placement import Held, ShardPlacement
from ..tensor_parallel.shard import ShardSpec
from .format import boxes, optimizer_key
from .pieces import flat_runs


@dataclass(frozen=True)
class LocalTensor:
    """One tensor this rank holds (``values``), or under ``zero=True`` the flat range of it starting
    at ``start`` (``values`` 1-D), of a local tensor shaped ``shape``."""

    name: str  # the saved name
    values: torch.Tensor
    shape: list[int]
    start: int
    spec: ShardSpec | None
    writes: bool

    @property
    def whole(self) -> bool:
        return self.start == 0 and list(self.values.shape) == self.shape


def local_entries(module: nn.Module, placement: ShardPlacement, view: OptimizerView | None):
    """Every tensor this rank writes or could write (``writes``): weights, then optimizer state.

    Weights are the float32 masters under mixed precision; the placement says which rank writes each
    distinct value (dp rank 0, or each dp rank its ZeRO-1 pieces, or the first dp_shard group its rows)."""
    mixed = view is not None and view.mixed
    for name, p in module.named_parameters():
        if placement.is_follower(name):
            continue
        key = view.state_key(p) if view is not None else None
        rows = row_range(p)
        if rows is not None:  # dp_shard: this rank's rows, a flat range, and its optimizer state's
            state = view.inner.state.get(key, {}) if key is not None else {}
            yield from _row_entries(name, p, rows, placement, state)
            continue
        spec, shape = placement.spec(name), list(p.shape)
        m = view.master(p) if view is not None else None
        split = view is not None and view.split(p)  # ZeRO-1: its optimizer data in pieces over its holders
        held = Held.PIECES if split else Held.WHOLE
        once, mine = placement.writes(name), placement.writes(name, held)  # mine: what this rank holds
        if mixed and m is not None:
            values = m.tensor.detach() if split else m.tensor.detach().reshape(shape)
            yield LocalTensor(name, values, shape, m.start, spec, mine)
        elif not (mixed and split):
            yield LocalTensor(name, p.detach(), shape, 0, spec, once)
        if key is None:
            continue
        for state_name, value in view.inner.state.get(key, {}).items():
            if not isinstance(value, torch.Tensor):
                continue
            if list(value.shape) == list(key.shape) and value.ndim > 0:  # shaped like its parameter
                values = value.detach() if split else value.detach().reshape(shape)
                yield LocalTensor(optimizer_key(name, state_name), values, shape, m.start if split else 0, spec, mine)
            else:  # a scalar (Adam's step): one writer, the rank holding the parameter's first element
                writes = placement.writes_scalar(name, held, holds_first=not split or m.start == 0)
                yield LocalTensor(optimizer_key(name, state_name), value.detach(), list(value.shape), 0, None, writes)


def _row_entries(name: str, p: torch.Tensor, rows: tuple[int, int], placement: ShardPlacement,
                 state: dict) -> Iterator[LocalTensor]:
    """A dp_shard parameter (float32: it is the master) and its state, as this rank's flat range of
    its local tensor, written where the placement says (``Held.ROWS``) and this rank holds rows."""
    spec, shape = placement.spec(name), list(p.shape)
    first, count = rows
    start = first * math.prod(shape[1:])
    mine = placement.writes(name, Held.ROWS) and count > 0
    yield LocalTensor(name, local(p.detach()).reshape(-1), shape, start, spec, mine)
    for key, value in state.items():
        if isinstance(value, torch.Tensor) and list(value.shape) == shape and value.ndim > 0:
            yield LocalTensor(optimizer_key(name, key), local(value.detach()).reshape(-1), shape, start, spec, mine)
        elif isinstance(value, torch.Tensor):  # a scalar (Adam's step): the rank holding the first row
            writes = count > 0 and placement.writes_scalar(name, Held.ROWS, holds_first=first == 0)
            yield LocalTensor(optimizer_key(name, key), local(value.detach()), list(value.shape), 0, None, writes)


def pieces_of(t: LocalTensor, shard_rank: int) -> list[tuple[list[list[int]], torch.Tensor]]:
    """(global box, its values) for each piece of ``t``: the shard's boxes of a whole tensor, or
    for a flat range, its contiguous runs cut by those boxes."""
    regions = boxes(torch.Size(t.shape), t.spec, shard_rank)
    if t.whole:
        return [(box, t.values if t.spec is None else t.values.narrow(t.spec.dim, at, box[t.spec.dim][1] - box[t.spec.dim][0]))
                for box, at in regions]
    out = []
    for run, offset in flat_runs(t.shape, t.start, t.start + t.values.numel()):
        values = t.values[offset - t.start :][: math.prod(b - a for a, b in run)].reshape([b - a for a, b in run])
        if t.spec is None:
            out.append((run, values))
            continue
        d = t.spec.dim
        for box, at in regions:  # the local rows [at, at + n) along the split dim are the global box's
            n = box[d][1] - box[d][0]
            lo, hi = max(run[d][0], at), min(run[d][1], at + n)
            if lo < hi:
                global_box = [list(r) for r in run]
                global_box[d] = [box[d][0] + lo - at, box[d][0] + hi - at]
                out.append((global_box, values.narrow(d, lo - run[d][0], hi - lo)))
    return out
