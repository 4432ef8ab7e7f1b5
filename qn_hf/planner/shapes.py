"""A mesh shape's configurations and its floors, as ``auto_plan`` prices them (auto.py): the
configurations of one (dp, tp, pp, cp, ep, schedule) at every dp_shard, and at pp=1 at every micro-batch
size, share the compute a least step time is priced from (``cost.step_floor``), which the search reads
before it estimates any of them; ``price`` prices shapes from the least floor up until the least
left exceeds the runner-up found so far.

Exact: a shape is left out only when each of its configurations, at any recomputation, is slower
than the runner-up by its floor alone, and so could be neither chosen nor the runner-up; full
recomputation only where its own floor does not exceed it (under a pipeline: at pp=1 whether a larger
micro-batch fits decides whether a smaller one is kept); and, once one configuration fits, one
that holds more than the memory before any activation (its state) is not priced, as no
memory option makes it fit (only the closest miss, named when nothing fits, needs those)."""

from __future__ import annotations

import heapq
import math
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, replace

from ..config.options import Offload, Recompute
from ..config.parallel_config import ParallelConfig
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


LOSS_CHUNK_TOKENS = 1024  # what the search takes: a 128k vocabulary's float32 logits of it are half a GiB
# tried in this order for what does not fit without: recomputation, then the loss in chunks, then the blocks'
# inputs on the host (each slower than the one before, none changing the result)
MEMORY_OPTIONS = (dict(recompute=Recompute.SELECTIVE), dict(recompute=Recompute.FULL),
                  dict(recompute=Recompute.FULL, loss_chunk_tokens=LOSS_CHUNK_TOKENS),
                  dict(recompute=Recompute.FULL, loss_chunk_tokens=LOSS_CHUNK_TOKENS, offload=Offload.ACTIVATIONS))


def memory_options(fixed: Mapping[str, object]) -> tuple[dict, ...]:
    """``MEMORY_OPTIONS`` with what the caller fixed (``ParallelConfig`` keywords) in place of theirs, each once;
    one that ``parallelize`` refuses so (offload without recomputation) left out. A fixed value that every candidate
    would carry and ``parallelize`` refuses (offload with recomputation fixed off, or left free: the candidates
    start without it) raises its ``ValueError`` here, before any is priced; a recomputation fixed to None (not
    merely left out) stays off in every option."""
    given = {k: fixed[k] for k in MEMORY_OPTIONS[-1] if k in fixed}  # (the last sets every one)
    ParallelConfig.from_keywords(**given)
    out: list[dict] = []
    for option in MEMORY_OPTIONS:
        try:
            config = ParallelConfig.from_keywords(**{**option, **given})
        except ValueError:
            continue
        merged = {k: getattr(config, k) for k in {**option, **given}}
        out += [merged] if merged not in out else []
    return tuple(out)


@dataclass
class Priced:
    """What ``price`` priced: every candidate, those over the memory before any activation (index in
    ``accepted``, planner: priced under recomputation only if nothing fits), how many left unpriced."""

    accepted: list[Candidate]
    hopeless: list[tuple[int, Planner]]
    unpriced: int


def price(shapes: list[MeshShape], *, exhaustive: bool, device_memory: int, options: tuple[dict, ...], hw: Hardware,
          calibration: Calibration | None, rejected: list[Rejected]) -> Priced:
    """The shapes priced from the least floor up, until the least floor left exceeds the runner-up
    found so far (module docstring; ``exhaustive``: every one priced). ``options``: what a configuration that
    does not fit is tried under (``memory_options``' list, the caller's fixed values in place; empty: none tried);
    the refusals met are added to ``rejected``."""
    accepted: list[Candidate] = []
    hopeless: list[tuple[int, Planner]] = []  # (in accepted, its planner): over the memory before any activation
    least: list[float] = []  # the two least predicted times of fitting candidates kept so far
    unpriced = 0
    # least floor first; a shape's untimed floor is replaced by its timed one (its lists walked) when it
    # comes up, so that shapes are priced in the order of their timed floors, walked only while they lead
    queue = [(shape.floor, i, False, shape) for i, shape in enumerate(shapes)]
    heapq.heapify(queue)
    while queue:
        floor, i, timed, shape = heapq.heappop(queue)
        if not exhaustive and len(least) == 2 and floor > least[1] + _CLEAR:  # so is every one left
            unpriced += shape.configs + sum(entry[-1].configs for entry in queue)
            break
        if not timed and not exhaustive:
            heapq.heappush(queue, (shape.timed_floor(hw=hw, calibration=calibration), i, True, shape))
            continue
        found = []
        # once a configuration fits, one that no recomputation can make fit is not priced (only the
        # closest miss, named when nothing fits, needs them)
        for planner, c in shape.priced(hw=hw, calibration=calibration, rejected=rejected,
                                       held_over=device_memory if least and not exhaustive else None):
            if c is None:
                unpriced += 1
                continue
            if not c.fits and options:
                if _held_besides_activations(c) <= device_memory:
                    # (not at pp=1, where whether a larger micro-batch fits under a recomputation
                    # decides whether a smaller one is kept: undominated)
                    skip = len(least) == 2 and not exhaustive and c.estimate.pp > 1
                    c = with_memory_options(planner, c, options, hw=hw, calibration=calibration,
                                            above=least[1] + _CLEAR if skip else math.inf)
                else:  # no memory option makes it fit: tried only if nothing fits (for the closest miss)
                    hopeless.append((len(accepted), planner))
            accepted.append(c)
            found.append(c)
        # a shape holds every candidate undominated compares a candidate with: what it keeps is final
        least = sorted(least + [c.time.seconds for c in undominated(found) if c.fits])[:2]
    return Priced(accepted=accepted, hopeless=hopeless, unpriced=unpriced)


# A shape is left out only when its floor clears the runner-up by more than _order's rounding (12
# decimals of a second), so that none of its candidates could tie with the runner-up there either, and
# by more than the float rounding of the floor's sums against the step time's (1e-15 of a step).
_CLEAR = 1e-9


def undominated(candidates: list[Candidate]) -> list[Candidate]:
    """Without the pp=1 candidates whose larger micro-batch, otherwise the same, fits too."""
    largest: dict[tuple, int] = {}
    for c in candidates:
        if c.estimate.pp == 1 and c.fits:
            key = _without_microbatches(c)
            largest[key] = max(largest.get(key, 0), c.estimate.micro_batch_size)
    return [c for c in candidates if c.estimate.pp > 1 or not c.fits
            or c.estimate.micro_batch_size == largest[_without_microbatches(c)]]


def _without_microbatches(c: Candidate) -> ParallelConfig:
    return replace(c.estimate.parallel, microbatches=1)


def _held_besides_activations(c: Candidate) -> int:
    """The most a rank of ``c`` holds besides activations (its state, FSDP's gathered weights and whole
    gradients: ``Planner.estimate``'s held_over), the same under every recomputation."""
    return max(s.state_bytes + s.unsharded_bytes for s in c.estimate.stages)


def with_memory_options(planner: Planner, c: Candidate, options: tuple[dict, ...], *, hw: Hardware,
                        calibration: Calibration | None, above: float = math.inf) -> Candidate:
    """``c`` under the first of ``options`` that makes it fit, else under the last tried; one whose floor exceeds
    ``above`` is not tried (it could be neither chosen nor the runner-up: ``auto_plan``), nor one that changes
    nothing."""
    start = c.estimate.parallel
    for option in options:
        if all(getattr(start, k) == v for k, v in option.items()):
            continue
        if above < math.inf and step_floor(c.estimate, hw, calibration, recompute=option["recompute"]) > above:
            continue  # (its lists walked only where there is a bound to compare with)
        try:
            est = planner.estimate(replace(start, **option))
        except ValueError:
            continue  # a model an option does not apply to (no blocks to recompute, no causal LM loss): as it was
        c = evaluate(est, hw=hw, calibration=calibration)
        if c.fits:
            break
    return c
