"""The training loop shared by ``scripts/train_lm.py`` and ``scripts/train_vit.py``.

Order of work, so that mistakes fail fast and together: every rank checks the options, paths and
mesh against the launched world size (no communication yet); then the process group starts with
a bounded timeout; rank 0 prepares the data first (``datasets`` caches it) while the others wait
for its verdict; then the model is built (a preset from the seed on every rank, or a model
directory on the ``meta`` device with each rank reading only its shard), parallelized, and trained.
Under ``mesh: auto`` the planner chooses the configuration once the model is built (its size and
the data's vocabulary are known then), and the run goes on as at that explicit mesh.
"""

from __future__ import annotations

import dataclasses
import datetime
import json
import math
import os
import sys
import tempfile
import time
import warnings
from collections.abc import Callable
from typing import Any, TypeVar

import datasets
import torch
import torch.distributed as dist

from ..arguments import plural
from ..checkpoint import checkpoint_dir
from ..checkpoint.atomic import write_text_atomic
from ..checkpoint.lock import DirectoryInUse, HeldDirectory, hold_directory
from ..config.parallel_config import ParallelConfig
from ..data_parallel.grad_norm import clip_grad_norm_
from ..devices import default_device
from ..entry.parallelize import parallelize
from ..launch.nodes import ranks_per_node
from ..mesh import init_distributed, launched_world_size
from ..parallel_model import ParallelModel, optimizer
from ..planner.auto import Choice, auto_choice
from ..planner.calibration import Calibration
from .config import TrainConfig, default_microbatches, effective_yaml
from .errors import UsageError
from .lr import warmup_cosine
from .metrics import MetricsLog, Progress
from .plots import loss_curve, pipeline_timeline
from .resume import resume_mesh, resume_path
from .retention import Retention
from .sampler import GlobalBatches
from .tasks import TASK_TYPES, model_directory
from .words import mesh_words

T = TypeVar("T")


def train(cfg: TrainConfig) -> dict[str, Any]:
    """Run (or resume) the configured training; return the summary (also in ``summary.json``)."""
    task = TASK_TYPES[cfg.task]()
    world = launched_world_size()
    calibration = _calibration(cfg)
    resume_from = resume_path(cfg)
    cfg, moved = resume_mesh(cfg, resume_from=resume_from, world=world)
    if not cfg.auto:  # else chosen once the model is built (_choose)
        cfg, parallel = _explicit(cfg, world=world)
    model_dir = model_directory(cfg.model)
    task.check(cfg, model_dir)
    _check_output_dir(cfg.output_dir)

    # no oversubscribed cores: this node's ranks share its cores
    torch.set_num_threads(max(1, (os.cpu_count() or 1) // (ranks_per_node() or 1)))
    device = default_device()
    init_distributed(device=device, timeout=datetime.timedelta(seconds=cfg.timeout_s))
    rank = dist.get_rank()
    held = _hold_output_dir(cfg)  # for the whole run: released at the end, or when the process ends
    if rank != 0:  # one set of progress bars (tokenizing, grouping) per job, drawn by rank 0
        datasets.disable_progress_bars()
    prepared = _rank0_first(lambda: task.prepare(cfg, model_dir))

    model = _build_model(cfg, task=task, config=prepared.config, model_dir=model_dir)
    choice = None
    if cfg.auto:
        choice = _choose(cfg, model=model, positions=task.positions(cfg, prepared.config), world=world,
                         calibration=calibration)
        cfg, parallel = _explicit(cfg.chosen(choice.config), world=world)
        task.check(cfg, model_dir)  # the sequence's split at the chosen degrees, as an explicit mesh's
        if parallel != choice.config:
            raise RuntimeError(f"mesh auto chose {choice.config!r}, which this run's options record as {parallel!r}")
    dims = parallel.dims
    try:
        pm = parallelize(model, parallel, seed=cfg.seed, checkpoint=model_dir,
                         timeout=datetime.timedelta(seconds=cfg.timeout_s))
        optimizer = _adamw(pm, cfg, rank=rank)
    except ValueError as e:  # a configuration the model cannot take (checked on every rank alike)
        raise UsageError(str(e)) from None
    start = 0
    if resume_from is not None:
        start = int(pm.load_checkpoint(resume_from, optimizer=optimizer).get("step") or 0)
    retention = Retention(cfg.checkpoint_root, keep_last=cfg.keep_last, active=rank == 0,
                          resumed_from=None if resume_from is None else checkpoint_dir(resume_from))
    if rank == 0:  # replaced by rename, never written through a link planted under its name
        write_text_atomic(os.path.join(cfg.output_dir, "config.yaml"), effective_yaml(cfg, comment=_chose(choice)))

    log = MetricsLog(os.path.join(cfg.output_dir, "metrics.jsonl"), active=rank == 0, resume_step=start)
    progress = Progress(total=cfg.steps, initial=start, active=rank == 0, enabled=cfg.progress, unit_name=task.unit)
    total_params = sum(p.numel() for p in model.parameters())  # this rank's shard
    chunks = f" x {plural(parallel.virtual_stages, 'chunk')}" if parallel.virtual_stages > 1 else ""
    progress.say(f"mesh {mesh_words(parallel)} ({plural(world, 'process')}, {device.type}), schedule "
                 f"{parallel.schedule}{chunks}, {plural(parallel.microbatches, 'microbatch')}; rank 0 holds "
                 f"{total_params:,} parameters")
    for line in choice.summary().splitlines() if choice is not None else ():
        progress.say(f"mesh auto: {line}")
    progress.say(f"data: {prepared.description}")
    if start:
        progress.say(f"resumed from {resume_from} at step {start}"
                     + (" (nothing left to train; --no-resume starts over)" if start >= (cfg.stop_after or cfg.steps) else ""))
    if moved is not None:
        progress.say(f"{moved}; now at mesh {mesh_words(parallel)}"
                     + (" (chosen by the planner)" if choice is not None else ""))

    sampler = GlobalBatches(examples=len(prepared.train), batch_size=cfg.batch_size, seed=cfg.seed)
    timeline_step = cfg.timeline_step if cfg.timeline_step is not None else (min(3, cfg.steps) if dims.pp > 1 else 0)
    last = cfg.stop_after or cfg.steps
    began, elapsed_before, record = time.perf_counter(), log.elapsed_before, {}
    for step in range(start + 1, last + 1):
        t0 = time.perf_counter()
        lr = warmup_cosine(step, lr=cfg.lr, warmup_steps=cfg.warmup_steps, total_steps=cfg.steps, min_lr_ratio=cfg.min_lr_ratio)
        for group in optimizer.param_groups:
            group["lr"] = lr
        rows = sampler.local_indices(step, dp_rank=pm.coords.dp, dp=dims.dp)
        batch = task.batch(prepared.train[rows])
        optimizer.zero_grad(set_to_none=True)
        if step == timeline_step:
            loss = _recorded_step(pm, batch, path=os.path.join(cfg.output_dir, "timeline.png"), step=step, cfg=cfg)
        else:
            loss = pm.train_step(batch)
        norm = clip_grad_norm_(pm, cfg.grad_clip if cfg.grad_clip > 0 else float("inf"))
        loss_value, norm_value = loss.item(), norm.item()  # the same on every rank
        if not math.isfinite(loss_value) or (pm.scaler is None and not math.isfinite(norm_value)):
            # Diverged: no optimizer step and no checkpoint; the checkpoint of the previous step (if
            # it was saved) gave these numbers, so it is set aside; float16 skips a step whose
            # gradients overflowed (the loss scale shrinks) instead.
            log.append({"step": step, "loss": loss_value, "lr": lr, "grad_norm": norm_value, "diverged": True})
            pm.wait_checkpoint()  # the checkpoint set aside must be whole first
            raise UsageError(_diverged(step, loss=loss_value, norm=norm_value, good=retention.fall_back(),
                                       root=cfg.checkpoint_root))
        retention.vouched()  # finite from the current weights: the checkpoints saved so far are good
        optimizer.step()
        seconds = time.perf_counter() - t0
        record = {"step": step, "loss": loss_value, "lr": lr, "grad_norm": norm_value, "step_time_s": seconds,
                  task.unit: task.units(batch) * dims.dp / seconds, "elapsed_s": elapsed_before + time.perf_counter() - began}
        if pm.scaler is not None:  # fp16: steps skipped for overflowing gradients, and the loss scale
            record.update(skipped_steps=optimizer.skipped_steps, loss_scale=pm.scaler.scale)
        if (cfg.eval_every > 0 and step % cfg.eval_every == 0) or step == last:
            record.update(task.evaluate(pm, prepared.val, cfg=cfg))
            progress.say("step {step}: ".format(**record) + ", ".join(
                f"{k} {v:.4f}" for k, v in record.items() if k.startswith("val_")))
        if (cfg.save_every and step % cfg.save_every == 0) or step == last:
            # Pruned by retention once a later step vouches for this one, never here (retention.py).
            # Asynchronous: published while the next steps run (pruning never touches a save in flight)
            saving = time.perf_counter()
            saved = pm.save_checkpoint(cfg.checkpoint_root, optimizer=optimizer, step=step, keep_last=None,
                                       asynchronous=cfg.async_save)
            record["checkpoint_s"] = time.perf_counter() - saving  # how long the save held training
            retention.saved(saved)
            progress.say(f"step {step}: checkpoint {saved}" + (" (writing in the background)" if cfg.async_save else ""))
        log.append(record)
        progress.update(record)
    pm.wait_checkpoint()  # the last checkpoint published before the run says it is done
    progress.close()

    if cfg.export and last == cfg.steps and start < cfg.steps:
        pm.save_pretrained(os.path.join(cfg.output_dir, "model"))
    summary = _summary(cfg, log=log, record=record or {"step": start}, world=world, stopped=last < cfg.steps)
    summary.update(nodes=pm.nodes.count, ranks_per_node=pm.nodes.ranks_per_node)
    if rank == 0:
        if log.records:
            loss_curve(os.path.join(cfg.output_dir, "loss.png"), runs=[(mesh_words(parallel), log.records)],
                       title=f"{cfg.model} ({cfg.task})")
        write_text_atomic(os.path.join(cfg.output_dir, "summary.json"), json.dumps(summary, indent=1))
        print(summary["line"], flush=True)
    dist.barrier()
    if held is not None:
        held.release()
    dist.destroy_process_group()
    return summary


def _diverged(step: int, *, loss: float, norm: float, good: str | None, root: str) -> str:
    what = (f"step {step}: the loss is {loss} and the gradient norm {norm}: training diverged; no update and no "
            f"checkpoint were made at this step")
    if good is None:
        return (f"{what}, and no checkpoint in {root} was followed by a finite step; start over with a lower --lr "
                f"(or --grad-clip)")
    return (f"{what}; {good} is the last good state (the newest checkpoint a finite step started from); resume from "
            f"it (--resume {good}) with a lower --lr (or --grad-clip)")


def _explicit(cfg: TrainConfig, *, world: int) -> tuple[TrainConfig, ParallelConfig]:
    """The run at an explicit mesh, its microbatches resolved (config.yaml records the value used), checked
    against the launch, and the one value every rank parallelizes with (its checks communicate nothing)."""
    if cfg.microbatches is None:
        dp, _, pp = cfg.mesh_for(world)
        cfg = dataclasses.replace(cfg, microbatches=default_microbatches(batch_size=cfg.batch_size, dp=dp, pp=pp))
    _check_launch(cfg, world=world)
    try:
        return cfg, cfg.parallel_config(world=world)
    except ValueError as e:
        raise UsageError(str(e)) from None


def _calibration(cfg: TrainConfig) -> Calibration | None:
    """Mesh auto's calibration file, read before any collective (a wrong path is the user's to fix)."""
    if cfg.calibration is None:
        return None
    try:
        return Calibration.load(cfg.calibration)
    except FileNotFoundError:
        raise UsageError(f"calibration file {cfg.calibration} does not exist (qn-hf-plan MODEL --gpus N --calibrate "
                         f"writes one)") from None
    except (OSError, ValueError) as e:  # json's decode error is a ValueError, as is a wrong format
        raise UsageError(f"calibration file {cfg.calibration} cannot be read: {e}") from None


def _choose(cfg: TrainConfig, *, model: torch.nn.Module, positions: int, world: int,
            calibration: Calibration | None) -> Choice:
    """Mesh auto: the configuration the planner predicts fastest that fits, training exactly
    ``batch_size`` sequences per step, with the parallel options this run set kept. The same on every
    rank (the device memory is agreed over the job when no calibration gives it); a refusal (nothing
    fits, an option no mesh can take) reaches every rank alike."""
    try:
        return auto_choice(model, global_batch=cfg.batch_size, seq_len=positions, world_size=world,
                           calibration=calibration, fixed=cfg.fixed_options())
    except ValueError as e:
        raise UsageError(f"--mesh auto: {e}") from None


def _chose(choice: Choice | None) -> str:
    """config.yaml's first lines under mesh auto: what was chosen, at which calibration."""
    if choice is None:
        return ""
    return ("mesh auto chose the mesh and options below (run again with this file to train the same):\n"
            + choice.summary())


def _check_launch(cfg: TrainConfig, *, world: int) -> None:
    """The mesh against the launched world, and the batch against dp x microbatches, before the
    configuration's own checks (a wrong launch is the likelier mistake, and names its fix)."""
    dims = cfg.mesh_dims(world)
    needed = dims.world_size
    if needed != world:
        cp = f" cp={cfg.cp}" if cfg.cp > 1 else ""
        raise UsageError(f"mesh dp={dims.dp} tp={dims.tp} pp={dims.pp}{cp} needs {plural(needed, 'process')} but "
                         f"{world} {'was' if world == 1 else 'were'} launched; launch {needed} "
                         f"(torchrun --nproc-per-node {needed} ...) or change --mesh" + (" or --cp" if cfg.cp > 1 else ""))
    if cfg.batch_size % (dims.dp * cfg.microbatches):
        raise UsageError(f"batch_size={cfg.batch_size} must be a multiple of dp*microbatches="
                         f"{dims.dp * cfg.microbatches}")


def _check_output_dir(path: str) -> None:
    try:
        os.makedirs(path, exist_ok=True)
        fd, probe = tempfile.mkstemp(dir=path, prefix=".write-test-")  # a new name: no planted link is followed
        os.close(fd)
        os.unlink(probe)
    except OSError as e:
        raise UsageError(f"output directory {path} is not writable: {e.strerror}") from None


def _hold_output_dir(cfg: TrainConfig) -> HeldDirectory | None:
    """Rank 0 holds the output directory, so a second job on it (whose saves would delete this one's
    checkpoints and interleave its metrics) is refused with a message naming this one's host and pid.
    The verdict reaches every rank in the job's first collective, before anything depends on it."""
    held, refusal = None, [None]
    if dist.get_rank() == 0:
        try:
            held = hold_directory(cfg.output_dir, purpose=f"the output directory of scripts/train_{cfg.task}.py",
                                  fix="Give this job another --output-dir, or wait for that job to end (a killed "
                                      "job's lock goes with its process)")
        except DirectoryInUse as e:
            refusal = [str(e)]
    dist.broadcast_object_list(refusal, src=0)
    if refusal[0] is not None:
        raise UsageError(refusal[0])
    return held


def _rank0_first(prepare: Callable[[], T]) -> T:
    """Run ``prepare`` on rank 0, then (if it succeeded) everywhere else: ``datasets`` writes its
    cache once, and a data error on rank 0 reaches every rank instead of leaving them waiting."""
    result, error = None, [None]
    if dist.get_rank() == 0:
        try:
            result = prepare()
        except UsageError as e:
            error = [str(e)]
        except Exception as e:  # not a known mistake: tell the others, keep the traceback here
            dist.broadcast_object_list([f"rank 0 failed to prepare the data: {type(e).__name__}: {e}"], src=0)
            raise
    dist.broadcast_object_list(error, src=0)
    if error[0] is not None:
        raise UsageError(error[0])
    if dist.get_rank() != 0:
        result = prepare()
    return result  # type: ignore[return-value]


def _build_model(cfg: TrainConfig, *, task: Any, config: Any, model_dir: str | None) -> torch.nn.Module:
    if model_dir is not None:
        # No weights in memory: parallelize materializes this rank's shard and reads only its slices.
        with torch.device("meta"):
            return task.auto_class.from_config(config)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(cfg.seed)  # the same initial weights on every rank and in the 1-process baseline
        return task.auto_class.from_config(config)


def _adamw(pm: ParallelModel, cfg: TrainConfig, *, rank: int) -> torch.optim.Optimizer:
    """AdamW without weight decay on biases and norms (1-D tensors), as is usual for transformers;
    float32 masters under mixed precision, 1/dp of the state per rank with ``zero``. The library's
    warnings (``zero`` where no other rank holds the same weights shards nothing) reach the user
    once, from rank 0, as one line each."""
    decay = [p for _, p in pm.named_parameters() if p.requires_grad and p.dim() >= 2]
    keep = [p for _, p in pm.named_parameters() if p.requires_grad and p.dim() < 2]
    groups = [{"params": decay, "weight_decay": cfg.weight_decay}, {"params": keep, "weight_decay": 0.0}]
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        built = optimizer(pm, torch.optim.AdamW, zero=cfg.zero, param_groups=groups, lr=cfg.lr)
    for warning in caught if rank == 0 else ():
        print(f"warning: {warning.message}", file=sys.stderr, flush=True)
    return built


def _recorded_step(pm: ParallelModel, batch: dict[str, torch.Tensor], *, path: str, step: int, cfg: TrainConfig) -> torch.Tensor:
    """One train step with the pipeline executor's timeline recorded on every rank, drawn by rank 0."""
    dist.barrier()
    pm.executor.events = []
    t0 = time.perf_counter()
    loss = pm.train_step(batch)
    events = [(str(e.op), e.chunk, e.mb, e.start - t0, e.stop - t0) for e in pm.executor.events]
    pm.executor.events = None
    gathered: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, (dict(pm.coords), events))
    if dist.get_rank() == 0:
        rows = [(f"stage {c['pp']} (dp {c['dp']}, tp {c['tp']})", evs)
                for c, evs in sorted(gathered, key=lambda g: (g[0]["dp"], g[0]["tp"], g[0]["pp"]))
                if c["dp"] == 0 and c["tp"] == 0]
        virtual = f" x {plural(pm.stage.plan.virtual, 'chunk')}" if pm.stage.plan.virtual > 1 else ""
        pipeline_timeline(path, ranks=rows, title=f"step {step}: {cfg.schedule}, pp={pm.dims.pp}{virtual}, "
                                                    f"{plural(cfg.microbatches, 'microbatch')} (measured)")
    return loss


def _summary(cfg: TrainConfig, *, log: MetricsLog, record: dict, world: int, stopped: bool) -> dict[str, Any]:
    records = log.records
    out: dict[str, Any] = {"steps": record.get("step", 0), "world_size": world, "stopped_early": stopped}
    if records:
        out["first_loss"] = records[0]["loss"]
        out["final_loss"] = records[-1]["loss"]
        evals = [r for r in records if "val_loss" in r]
        if evals:
            out.update({k: v for k, v in evals[-1].items() if k.startswith("val_")})
        unit = next(k for k in records[-1] if k.endswith("_per_s"))
        timed = records[1:] or records  # the first step includes warm-up allocations
        out[unit] = sum(r[unit] for r in timed) / len(timed)
        out["elapsed_s"] = records[-1]["elapsed_s"]
    parts = [f"{'stopped' if stopped else 'done'}: step {out['steps']}/{cfg.steps}"]
    if records:
        parts.append(f"loss {out['first_loss']:.4f} -> {out['final_loss']:.4f}")
        if "val_loss" in out:
            parts.append(f"val loss {out['val_loss']:.4f}")
        if "val_accuracy" in out:
            parts.append(f"val accuracy {100 * out['val_accuracy']:.1f}%")
        parts.append(f"{out[unit]:,.0f} {unit.replace('_per_s', '/s')}")
        parts.append(f"{out['elapsed_s']:.1f} s")
    parts.append(f"outputs in {cfg.output_dir}")
    out["line"] = ", ".join(parts)
    return out
