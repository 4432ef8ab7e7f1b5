"""Where a training run resumes from, and at which mesh.

A run resumes by default from the newest complete checkpoint in its output directory (``latest``),
so the command that started a job also restarts it (``torchrun --max-restarts``); at another world
size than the checkpoint's it keeps its mesh where that fits, else the planner chooses
(docs/elastic.md). Both are decided from files alone, on every rank alike, before any collective.
"""

from __future__ import annotations

import dataclasses
import os

from ..arguments import plural
from ..checkpoint import checkpoint_dir
from ..checkpoint.dcp.directory import checkpoint_record
from ..config.dims import ParallelDims
from .config import AUTO, TrainConfig
from .errors import UsageError


def resume_mesh(cfg: TrainConfig, *, resume_from: str | None, world: int) -> tuple[TrainConfig, str | None]:
    """A run resumed at another world size than its checkpoint's: its mesh where that fits the new world
    (the default mesh always does), else the planner's choice (mesh auto) for the same global batch, its
    cp, dp_shard and ep each brought down to the largest degree the new mesh holds; and what changed, to
    be logged (None: nothing moved). Read from the checkpoint's index on every rank alike, before any
    collective; weights, optimizer state and the loss scale reshard on load, and the batches and the
    learning rate go by step, whatever the mesh."""
    if resume_from is None:
        return cfg, None
    saved = checkpoint_record(checkpoint_dir(resume_from)).get("mesh") or {}  # qn_hf's format or its DCP
    degrees = {f.name for f in dataclasses.fields(ParallelDims)}  # the index also records virtual stages
    dims = ParallelDims(**{axis: int(degree) for axis, degree in saved.items() if axis in degrees})
    if dims.world_size == world:
        return cfg, None
    was = (f"resumed at {plural(world, 'process')} from a checkpoint of {plural(dims.world_size, 'process')} "
           f"(mesh {' '.join(f'{axis}={degree}' for axis, degree in saved.items())})")
    cfg, notes = _fit(cfg, {"cp": (world, "the world size", True)})
    if not cfg.auto:
        dp, tp, pp = cfg.mesh_for(world)
        needed = cfg.mesh_dims(world).world_size
        if needed != world:
            # The user's mesh needs the old world: the planner chooses one for this world, keeping every
            # other option given (microbatches are the planner's with the mesh)
            notes.append(f"--mesh {dp} {tp} {pp} needs {plural(needed, 'process')}")
            cfg = dataclasses.replace(cfg, mesh=AUTO, microbatches=None, given=cfg.given - {"mesh", "microbatches"})
    # the planner's dp x tp is at most what cp leaves
    dp, tp = (world // cfg.cp, 1) if cfg.auto else cfg.mesh_for(world)[:2]
    cfg, more = _fit(cfg, {"dp_shard": (dp, "dp", False), "ep": (dp * tp, "dp x tp", True)})
    return cfg, "; ".join([was, *notes, *more])


def _fit(cfg: TrainConfig, limits: dict[str, tuple[int, str, bool]]) -> tuple[TrainConfig, list[str]]:
    """The degrees named in ``limits`` (name -> (what it must divide, its name, whether the new degree must also
    divide the old)) brought down to the largest that divides it, so a moved job keeps what it can of its mesh
    instead of refusing to start; and one note per degree changed."""
    changed, notes = {}, []
    for name, (limit, what, of_old) in limits.items():
        degree = getattr(cfg, name)
        if limit % degree == 0:
            continue
        # dp_shard may be any divisor of dp; cp and ep must also divide what they divided (the sequence's
        # pieces, the experts), which every divisor of the old degree does
        changed[name] = max(d for d in range(1, min(degree, limit) + 1)
                            if limit % d == 0 and (not of_old or degree % d == 0))
        notes.append(f"--{name.replace('_', '-')} {degree} does not divide {what}={limit}: now {changed[name]}")
    return (dataclasses.replace(cfg, **changed) if changed else cfg), notes


def resume_path(cfg: TrainConfig) -> str | None:
    """The checkpoint to resume from: ``latest`` under this run's checkpoints (the default; none yet:
    start fresh, so a restarted or preempted job reruns its command unchanged), or an explicit path
    that must exist; None with --no-resume."""
    if cfg.resume is None:
        return None
    if cfg.resume == "latest":
        root = cfg.checkpoint_root
        if not os.path.isdir(root) or not any(n == "latest" or n.startswith("ckpt-") for n in os.listdir(root)):
            return None
        # Something is there: a damaged pointer must stop the job, not start it over (the next
        # save would then replace the checkpoints that are still good).
        return checkpoint_dir(root)
    if not os.path.exists(cfg.resume):
        raise UsageError(f"--resume {cfg.resume}: no such checkpoint")
    return cfg.resume
