"""A mesh shape's configurations and its floors, as ``auto_plan`` prices them (auto.py): the
configurations of one (dp, tp, pp, cp, ep, schedule) at every dp_shard, and at pp=1 at every micro-batch
size, share the compute a least step time is priced from (``cost.step_floor``), which the search reads
before it estimates any of them."""

from __future__ import annotations

import math
from collections.abc import Iterator

from .calibration import Calibration
from .cost import Hardware, step_floor
from .estimate import Planner
from .results import MeshWork
from .search import Candidate, MeshGroup, Rejected, evaluate, refuse


class MeshShape:
    """A mesh shape's configurations (``search.MeshGroup``: every dp_shard; at pp=1 every micro-batch
    size) and its floor: the least over its groups of ``step_floor`` untimed (the busiest rank's
    compute), from the compute of the group's first configuration the checks pass (``Planner.work``;
    those before it refused, and named, as ``estimate`` refuses them: the same checks first); minus
    infinity for a group whose compute is unknown (priced, so that the estimate says why)."""

    def __init__(self) -> None:
        self.floor = math.inf
        self.configs = 0  # not refused
        self._parts: list[tuple[Planner, MeshGroup, MeshWork | None, int]] = []  # (.., the first not refused)

    def add(self, planner: Planner, group: MeshGroup, *, hw: Hardware, calibration: Calibration | None,
            rejected: list[Rejected]) -> None:
        for i, parallel in enumerate(group.configs):
            try:
                work = planner.work(parallel)
            except ValueError as error:
                if not group.zero_at(parallel):  # (checked without ZeRO: under it the estimate names its refusal)
                    refuse(rejected, parallel, error)
                    continue
                work = None
            self.floor = min(self.floor, -math.inf if work is None else step_floor(work, hw, calibration, timed=False))
            self._parts.append((planner, group, work, i))
            self.configs += len(group.configs) - i
            return

    def timed_floor(self, *, hw: Hardware, calibration: Calibration | None) -> float:
        """The least over its groups of ``step_floor`` timed (the schedule's lists walked): at least ``floor``."""
        return min(-math.inf if work is None else step_floor(work, hw, calibration) for _, _, work, _ in self._parts)

    def priced(self, *, hw: Hardware, calibration: Calibration | None, rejected: list[Rejected],
               held_over: int | None) -> Iterator[tuple[Planner, Candidate | None]]:
        """Every configuration of the shape priced, with its planner (those refused named in ``rejected``);
        None for one holding more than ``held_over`` before any activation (``Planner.estimate``)."""
        for planner, group, _, first in self._parts:
            for parallel in group.configs[first:]:
                try:
                    est = planner.estimate(parallel, zero=group.zero_at(parallel), held_over=held_over)
                except ValueError as error:
                    refuse(rejected, parallel, error)
                    continue
                yield planner, None if est is None else evaluate(est, hw=hw, calibration=calibration)
