"""``qn_hf.parallelize``, the user's one call: the configuration (given, built from ``ParallelConfig``'s keywords,
or chosen by the planner under ``mesh="auto"``), then the model transformed as it says (``transform.build``). Above
both the planner and the transform, so that the planner sits above what it plans for."""

from __future__ import annotations

import datetime

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh

from ..arguments import unknown_keywords
from ..config.dims import MESH_DEGREES, Axis, ParallelDims
from ..config.parallel_config import ParallelConfig
from ..failure import refused_on_every_rank
from ..mesh import launched_world_size
from ..parallel_model import ParallelModel
from ..planner.auto import AUTO, auto_config
from ..planner.calibration import Calibration
from ..policies.model_policy import ModelPolicy
from ..transform.parallelize import JOIN_TIMEOUT, build, prepare_model


def parallelize(
    model: nn.Module,
    config: ParallelConfig | None = None,
    *,
    policy: ModelPolicy | None = None,
    mesh: DeviceMesh | str | None = None,
    device: torch.device | None = None,
    seed: int | None = None,
    checkpoint: str | None = None,
    timeout: datetime.timedelta = JOIN_TIMEOUT,
    global_batch: int | None = None,
    seq_len: int | None = None,
    calibration: Calibration | str | None = None,
    **options: object,
) -> ParallelModel:
    """Shard ``model`` (in place) as ``config`` says, or the ``options`` (``ParallelConfig``'s keywords, which
    its docstring describes: the degrees ``dp``, ``tp``, ``pp``, ``cp``, ``ep``, ``dp_shard``, the schedule,
    precision, recomputation, ...; they build the same value), and return its ``ParallelModel``.

    Every check that can fail runs before the first collective, identically on every rank. What this call takes
    besides says where the model runs and what it starts from: ``policy`` describes an architecture
    (default: the one for ``model.config.model_type``); ``mesh`` reuses an existing ("dp", "pp", "tp") mesh;
    ``seed`` seeds dropout (default: rank 0's ``torch.initial_seed()``, shared with all ranks); ``checkpoint``
    (a Hugging Face directory or a qn_hf checkpoint) supplies the weights: with a model built on the ``meta``
    device, each rank allocates and reads only its own shard, so no rank ever holds the whole model; ``timeout``
    bounds every collective when this call creates the process group.

    ``mesh="auto"`` lets the planner choose the configuration (``qn_hf.auto_config``): the fastest it
    predicts that fits, training exactly ``global_batch`` sequences of ``seq_len`` tokens per step
    (both required then), at ``calibration`` (a ``qn-hf-plan --calibrate`` file, or its value) or this
    machine's (measured quickly, kept; planner/machine.py); the options given beside it are kept.
    ``pm.parallel_config`` says what was chosen; each dp rank's ``train_step`` takes
    ``global_batch / dp`` sequences.
    """
    defaults = ParallelConfig.keyword_defaults()  # the options parallelize takes, and their defaults
    unknown = {name: value for name, value in options.items() if name not in defaults}
    if unknown:  # Python's own TypeError would not say which keyword was meant
        raise refused_on_every_rank(TypeError(unknown_keywords(unknown, parallelize, tuple(defaults))))
    try:
        model, adapter = prepare_model(model, checkpoint=checkpoint)
        # the options given other than at their defaults: what mesh="auto" keeps, what config= leaves no room for
        changed = {name: value for name, value in options.items() if value != defaults[name]}
        if isinstance(mesh, str) or global_batch is not None or seq_len is not None or calibration is not None:
            config = _auto(model, config, mesh=mesh, fixed=changed, global_batch=global_batch, seq_len=seq_len,
                           calibration=calibration)
            mesh = None
            options = {}
        if config is None:
            # The launch first: with the wrong number of processes every other message would name the wrong
            # fix (ep must divide dp*tp, ... of degrees the user did not mean); but dp_shard's, which says what
            # dp it needs (dp_shard=4 alone usually means dp=4 too).
            ParallelDims.of(options, axes=(*MESH_DEGREES, Axis.DP_SHARD)).check_world_size(launched_world_size())
            config = ParallelConfig.from_keywords(**options)
        elif not isinstance(config, ParallelConfig):
            raise ValueError(f"config={config!r} must be a qn_hf.ParallelConfig (or pass the keywords instead)")
        elif changed:
            raise ValueError(f"parallelize(model, config, {', '.join(sorted(changed))}=...): the config already holds "
                             f"every option; put them in it (dataclasses.replace(config, ...)) or pass keywords only")
        return build(model, config, adapter=adapter, policy=policy, mesh=mesh, device=device, seed=seed,
                     checkpoint=checkpoint, timeout=timeout)
    except ValueError as e:  # every refusal is raised alike on every rank, before any collective
        refused_on_every_rank(e)
        raise


def _auto(model: nn.Module, config: ParallelConfig | None, *, mesh: object, fixed: dict[str, object],
          global_batch: int | None, seq_len: int | None, calibration: Calibration | str | None) -> ParallelConfig:
    """``mesh="auto"``: the planner's configuration, the options given beside it kept."""
    if mesh != AUTO:
        raise ValueError(f"mesh={mesh!r} with global_batch/seq_len/calibration: those choose the configuration "
                         f"and go with mesh='auto' only (mesh takes 'auto' or a DeviceMesh)")
    if config is not None:
        raise ValueError("parallelize(model, config, mesh='auto'): pass a configuration or let auto choose one, "
                         "not both")
    if global_batch is None or seq_len is None:
        raise ValueError(f"mesh='auto' needs global_batch= and seq_len= (got global_batch={global_batch}, "
                         f"seq_len={seq_len}): the fastest configuration depends on the step's shape")
    return auto_config(model, global_batch=global_batch, seq_len=seq_len, calibration=calibration, fixed=fixed)
