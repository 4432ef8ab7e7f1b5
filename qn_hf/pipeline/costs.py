"""What the pipeline schedule does to a rank's activation memory and to the step's pipeline time,
read off the schedule as data (``qn_hf.pipeline.schedule``) with its process-free checks
(``qn_hf.pipeline.schedule_check``).

Memory (``peak_activation_bytes``): walking a rank's action list, the bytes it holds after each
action are, summed over the chunks it runs, the bytes one microbatch keeps on the chunk times its
(chunk, mb)es whose forward ran and whose backward has not, plus under zb_h1 the chunk's W stash
times its (chunk, mb)es past their backward and before their W; the peak is the largest. With one
chunk and no W this is the chunk's bytes times ``peaks(...).f_to_b``, as before schedules had W's.
What a backward allocates while it runs is not counted (as nowhere in the planner).

Time (``op_costs``, ``pipeline_timing``): ``schedule_check.timed`` runs every rank's list with one
cost per compute op, for one chunk's microbatch:

    F = (compute / 3 + comm / 2) / V
    B = (2 compute / 3 + comm / 2) / V   (+ compute / 3 with full recomputation: the forward again)
    W = 0                                  (B keeps the weight gradients)
      or under zb_h1: W = weight / V and B gives it up

where ``compute`` is a rank's forward and backward of one microbatch (6 x matmul parameters +
attention: the forward a third, the backward two thirds), ``weight`` is the deferred linears' weight
gradients (2 x their parameters per token, the forward FLOPs of those layers), ``comm`` the
microbatch's communication (half with the forward, half with the backward; a W communicates
nothing) and V the chunks per rank. One rank's costs stand for every rank and every chunk (timed
takes one cost per op): the planner passes the slowest rank's, an even share per chunk.
"""

from __future__ import annotations

import functools
from collections import Counter
from collections.abc import Sequence

from ..config.options import Recompute
from ..config.schedule import as_schedule
from .schedule import Action, Op, chunk_of, deferred, schedule_actions
from .schedule_check import Peaks, Run, Timing, peaks, run_of, timed


@functools.lru_cache(maxsize=512)
def rank_actions(*, stages: int, microbatches: int, schedule: str,
                 virtual_stages: int = 1) -> tuple[tuple[Action, ...], ...]:
    """Every rank's training list (cached: the search estimates many meshes at the same pp and M)."""
    return tuple(map(tuple, schedule_actions(stages=stages, microbatches=microbatches, schedule=schedule,
                                             virtual_stages=virtual_stages)))


def peak_activation_bytes(actions: Sequence[Action], *, stage: int, kept: Sequence[int],
                          stash: Sequence[int]) -> int:
    """The most bytes rank ``stage`` holds over its list (see the module docstring); ``kept`` and
    ``stash`` are per global chunk: one microbatch's activations and W stash."""
    return _peak_of(_holdings(tuple(actions), stage=stage), kept=kept, stash=stash)


def _peak_of(holdings: frozenset[tuple[tuple[tuple[int, int], ...], tuple[tuple[int, int], ...]]], *,
             kept: Sequence[int], stash: Sequence[int]) -> int:
    return max((sum(kept[c] * n for c, n in alive) + sum(stash[c] * n for c, n in waiting)
                for alive, waiting in holdings), default=0)


def _holdings(actions: tuple[Action, ...], *, stage: int) -> frozenset:
    """Every distinct holding the list passes through after a compute op: ((chunk, (chunk, mb)es from
    F to B), ...) and ((chunk, (chunk, mb)es from B to W), ...). They do not depend on the bytes, so
    a search prices a list's peak at many meshes' bytes from its few holdings."""
    with_w = deferred(list(actions))
    alive: Counter[int] = Counter()  # chunk -> (chunk, mb)es from F to B
    waiting: Counter[int] = Counter()  # chunk -> (chunk, mb)es from B to W
    seen = set()
    for a in actions:
        chunk = chunk_of(a, stage=stage)
        if a.op is Op.FWD:
            alive[chunk] += 1
        elif a.op is Op.BWD:
            alive[chunk] -= 1
            if (a.chunk, a.mb) in with_w:
                waiting[chunk] += 1
        elif a.op is Op.WGT:
            waiting[chunk] -= 1
        else:
            continue
        seen.add((tuple(sorted(alive.items())), tuple(sorted(waiting.items()))))
    return frozenset(seen)


@functools.lru_cache(maxsize=1024)
def _rank_holdings(*, stages: int, microbatches: int, schedule: str, virtual_stages: int,
                   stage: int) -> tuple[Peaks, frozenset]:
    actions = rank_actions(stages=stages, microbatches=microbatches, schedule=schedule,
                           virtual_stages=virtual_stages)[stage]
    return peaks(list(actions)), _holdings(actions, stage=stage)


@functools.lru_cache(maxsize=1024)
def rank_peaks(*, stages: int, microbatches: int, schedule: str, virtual_stages: int, stage: int,
               kept: tuple[int, ...], stash: tuple[int, ...]) -> tuple[Peaks, int]:
    """Rank ``stage``'s ``peaks`` and ``peak_activation_bytes`` (cached: a search asks for the same at
    every dp and dp_shard of a mesh shape; the list's holdings once per list)."""
    found, holdings = _rank_holdings(stages=stages, microbatches=microbatches, schedule=schedule,
                                     virtual_stages=virtual_stages, stage=stage)
    return found, _peak_of(holdings, kept=kept, stash=stash)


def op_costs(*, compute: float, weight: float, comm: float, recompute: str | None, schedule: str,
             virtual_stages: int = 1, redone: float = 0.0) -> dict[Op, float]:
    """One chunk's microbatch cost per compute op (see the module docstring), in the units of
    ``compute``, ``weight`` and ``comm`` (FLOPs, or seconds); ``redone``: what selective recomputation
    runs again in backward (the elementwise work; planner/cost.py prices it, FLOPs count it as free)."""
    forward = compute / 3 + comm / 2
    backward = 2 * compute / 3 + comm / 2 + (compute / 3 if recompute == Recompute.FULL else 0.0) + redone
    split = weight if as_schedule(schedule).split_backward else 0.0
    costs = {Op.FWD: forward, Op.BWD: backward - split, Op.WGT: split}
    return {op: cost / virtual_stages for op, cost in costs.items()}


def pipeline_timing(*, stages: int, microbatches: int, schedule: str, virtual_stages: int = 1,
                    costs: dict[Op, float] | Sequence[dict[Op, float]]) -> Timing:
    """Every rank's list timed with ``costs`` (``op_costs``: one for every rank, or one per rank)."""
    if isinstance(costs, dict):
        costs = [costs] * stages
    return _timed(stages, microbatches, schedule, virtual_stages, tuple(tuple(c.items()) for c in costs))


@functools.lru_cache(maxsize=4096)
def _timed(stages: int, microbatches: int, schedule: str, virtual_stages: int,
           costs: tuple[tuple[tuple[Op, float], ...], ...]) -> Timing:
    # Cached: a search times each (pp, M) with the same costs at every dp and dp_shard of a mesh
    # shape (the costs are per microbatch), and a long pipeline's lists take a while to walk.
    return timed(_run(stages=stages, microbatches=microbatches, schedule=schedule, virtual_stages=virtual_stages),
                 costs=[dict(c) for c in costs])


@functools.lru_cache(maxsize=512)
def _run(*, stages: int, microbatches: int, schedule: str, virtual_stages: int) -> Run:
    """The lists' execution order, walked and checked once (a search times them at many costs)."""
    return run_of([list(a) for a in rank_actions(stages=stages, microbatches=microbatches, schedule=schedule,
                                                 virtual_stages=virtual_stages)])


def bubble(timing: Timing) -> float:
    """The pipeline's idle fraction: the most any rank idles (with one cost per op every rank does
    the same work, so all idle alike)."""
    return max(timing.bubble)
