"""What ``qn_hf.Trainer`` accepts: its ``parallel=`` keywords (or ``"auto"``: ``auto_mesh``), and the
``TrainingArguments`` that would fight the mesh. Every check is a pure function of the arguments and the launcher's world size, so each rank raises the same
``ValueError`` (naming the value and the fix) before any collective or any training step.

Not supported (each refused with a ``ValueError`` before training): DeepSpeed, FSDP, accelerate's
``parallelism_config`` (qn_hf is the parallelism); ``gradient_checkpointing`` (use ``parallel=dict(recompute=)``);
``fp16``/``bf16`` flags (use ``parallel=dict(mixed_precision=)``: accelerate's autocast keeps no float32 masters);
``compute_metrics``/``preprocess_logits_for_metrics`` and predictions from ``predict`` (the logits stay on the last
stage, split over tp); ``label_smoothing_factor`` (use ``compute_loss_func``); ``model_init`` and
``auto_find_batch_size`` (the model is parallelized once); Liger kernels and NEFTune (they replace or hook forwards
qn_hf drives); ``torch_compile_backend`` other than inductor and ``torch_compile_mode`` (``torch_compile=True``
compiles each block with inductor's defaults: ``parallelize(compile=True)``, qn_hf/step/compile.py); ``group_by_length``
sampling; ``push_to_hub``; an optimizer built over the unsharded model. A ``compute_loss`` override is not called
for training (TRL's token accuracy and entropy metrics are not logged): the loss is the built-in one, or
``compute_loss_func`` summed over rows and normalised by ``num_items_in_batch``, or TRL's ``RewardTrainer``'s pairwise
loss (preference.py); an override computing anything else (``check_compute_loss``: a subclass's own, SFTTrainer with a
``loss_type`` other than ``nll``) is refused. With fp16 an overflow skips the optimizer step, but the LR scheduler
still steps.
"""

from __future__ import annotations

import copy
import copyreg
import functools
import inspect
import os
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch.distributed as dist

from ...config.dims import MESH_DEGREES
from ...config.options import Precision
from ...config.parallel_config import ParallelConfig
from ...config.schedule import Schedule
from ...data_parallel.optimizer import ParallelOptimizer
from ...entry.parallelize import parallelize
from ...launch.nodes import local_rank
from ...planner.auto import AUTO, Choice, auto_choice
from ...planner.calibration import Calibration

# the keywords that say how to parallelize (ParallelConfig's); the rest say where (seed, mesh, device, ...)
CONFIG_KEYS = ParallelConfig.keyword_names()
# parallelize's keywords (its own and the configuration's), plus the optimizer's ZeRO-1 switch
# (qn_hf.optimizer(zero=...)), which the Trainer builds.
PARALLEL_KEYS = tuple(name for name, p in inspect.signature(parallelize).parameters.items()
                      if p.kind is inspect.Parameter.KEYWORD_ONLY) + CONFIG_KEYS + ("zero",)
SAMPLING = ("random", "sequential")  # samplers rebuilt exactly as one process draws them (trainer_data.py)
AUTO_KEYS = ("mesh", "seq_len", "calibration")  # parallel= keys that say how mesh="auto" chooses, not what to keep


@dataclass(frozen=True)
class TrainerMesh:
    """The resolved ``parallel=`` options: the configuration, checked once as ``parallelize`` will check it
    (``microbatches`` is per optimizer step: the per-accumulation-batch count times
    ``gradient_accumulation_steps``); ``parallelize``'s other keywords (``where``: the seed, a mesh, a
    device, ...); ZeRO-1 for the optimizer; and which of the configuration's keywords were set (``given``:
    by ``parallel=``, or resolved here), which a wrong launch's message quotes back as the user wrote them."""

    config: ParallelConfig
    where: dict[str, Any]
    zero: bool
    given: frozenset[str] = frozenset()
    # per-device batches in one loader batch: dp (None), or under mesh="auto" the launched processes (auto_mesh)
    batch_devices: int | None = None
    choice: Choice | None = None  # mesh="auto": the planner's answer

    @property
    def world_size(self) -> int:
        return self.config.dims.world_size

    @property
    def parallelize(self) -> dict[str, Any]:
        """The keywords ``parallelize`` takes for this mesh: those of the configuration that were set (it
        rebuilds the same configuration from them), and ``where``."""
        return {**{k: v for k, v in self.config.keywords().items() if k in self.given}, **self.where}


def trainer_mesh(parallel: Mapping[str, Any] | None, *, args) -> TrainerMesh:
    """Check ``parallel`` and turn it into ``TrainerMesh``. ``microbatches`` counts the microbatches of one
    accumulation batch of a dp replica (``per_device_train_batch_size`` rows); the accumulation batches of one
    optimizer step run in one ``train_step``, so the model is parallelized with microbatches x accumulation steps."""
    parallel = dict(parallel or {})
    unknown = sorted(set(parallel) - set(PARALLEL_KEYS))
    if unknown:
        raise ValueError(f"parallel= has unknown keys {unknown}; the accepted keys are {list(PARALLEL_KEYS)}")
    zero = bool(parallel.pop("zero", False))
    micro = parallel.get("microbatches", 1)
    if not isinstance(micro, int) or isinstance(micro, bool) or micro < 1:
        raise ValueError(f"parallel microbatches={micro!r} must be a positive integer")
    batch = args.per_device_train_batch_size
    if batch < micro:
        raise ValueError(f"per_device_train_batch_size={batch} is less than parallel microbatches={micro}: each "
                         f"accumulation batch of a dp replica is cut into microbatches; use microbatches <= {batch}")
    parallel["microbatches"] = micro * args.gradient_accumulation_steps
    _where(parallel, args=args)
    config = ParallelConfig.from_keywords(**{k: v for k, v in parallel.items() if k in CONFIG_KEYS})
    return TrainerMesh(config=config, where={k: v for k, v in parallel.items() if k not in CONFIG_KEYS}, zero=zero,
                       given=frozenset(k for k in parallel if k in CONFIG_KEYS))


def _where(parallel: dict[str, Any], *, args) -> None:
    """The ``TrainingArguments`` that say where to run, into ``parallel``: compilation and the seed."""
    if getattr(args, "torch_compile", False):  # accelerate never gets the model: qn_hf compiles its blocks
        if parallel.get("compile", True) is not True:
            raise ValueError(f"torch_compile=True with parallel compile={parallel['compile']!r}: set one of them "
                             f"(parallel=dict(compile=True) is what torch_compile=True asks for)")
        parallel["compile"] = True
    parallel.setdefault("seed", args.seed)  # dropout streams follow the run's seed, as in one process


def is_auto(parallel: Mapping[str, Any] | str | None) -> bool:
    """``parallel="auto"`` or ``parallel=dict(mesh="auto", ...)``."""
    return isinstance(parallel, str) or isinstance(parallel, Mapping) and isinstance(parallel.get("mesh"), str)


def auto_mesh(parallel: Mapping[str, Any] | str, *, args, model, world_size: int, train_dataset: Any = None,
              data_collator: Any = None) -> TrainerMesh:
    """``parallel="auto"`` (or ``dict(mesh="auto", ...)``): the configuration ``qn_hf.auto_choice`` predicts
    fastest that fits, at the global batch these ``TrainingArguments`` train on ``world_size`` processes,
    ``per_device_train_batch_size x world_size x gradient_accumulation_steps`` (as under DDP: per device is per
    process here, since dp is what auto chooses), keeping the configuration keywords given beside it. The
    sequence length: ``seq_len`` in the dict, else ``sequence_length`` of the data; ``calibration``: a
    ``qn-hf-plan --calibrate`` file or its ``Calibration`` (default: this machine's, measured and kept; planner/machine.py)."""
    if isinstance(parallel, str) and parallel != AUTO:
        raise ValueError(f"parallel={parallel!r}: parallel= takes {AUTO!r} or a dict of qn_hf.parallelize's keywords")
    parallel = {"mesh": AUTO} if isinstance(parallel, str) else dict(parallel)
    if parallel["mesh"] != AUTO:
        raise ValueError(f"parallel mesh={parallel['mesh']!r}: the one name mesh takes is {AUTO!r} (or a DeviceMesh)")
    unknown = sorted(set(parallel) - set(PARALLEL_KEYS))
    if unknown:
        raise ValueError(f"parallel= has unknown keys {unknown}; the accepted keys are {list(PARALLEL_KEYS)}")
    rows = args.per_device_train_batch_size * world_size * args.gradient_accumulation_steps
    for key, why in (("microbatches", "they follow from the global batch, dp and the micro-batch size auto chooses"),
                     ("global_batch", f"the TrainingArguments set it: per_device_train_batch_size x {world_size} "
                                      f"processes x gradient_accumulation_steps = {rows}")):
        if key in parallel:
            raise ValueError(f"parallel {key}={parallel[key]!r} with mesh='auto': {why}; leave it out")
    zero = bool(parallel.pop("zero", False))
    seq_len = (parallel["seq_len"] if "seq_len" in parallel
               else sequence_length(train_dataset, data_collator=data_collator, rows=rows))
    if seq_len is None:
        raise ValueError("parallel mesh='auto' needs the sequence length a step trains, and neither the data collator "
                         "(padding='max_length') nor the first examples of train_dataset (their input_ids) say it: "
                         "pass parallel=dict(mesh='auto', seq_len=N)")
    calibration = _calibration(parallel.get("calibration"))
    parallel = {k: v for k, v in parallel.items() if k not in AUTO_KEYS}
    _where(parallel, args=args)
    fixed = {k: v for k, v in parallel.items() if k in CONFIG_KEYS}
    if "virtual_stages" in fixed:  # auto would choose the schedule and its chunks together
        fixed.setdefault("schedule", Schedule.ONE_F_ONE_B)
    if "schedule" in fixed:  # the member: auto.py tells schedules apart by identity
        fixed["schedule"] = Schedule(fixed["schedule"])
    choice = auto_choice(model, global_batch=rows, seq_len=seq_len, world_size=world_size, calibration=calibration,
                         fixed=fixed)
    return TrainerMesh(config=choice.config, where={k: v for k, v in parallel.items() if k not in CONFIG_KEYS},
                       zero=zero, given=frozenset(CONFIG_KEYS), batch_devices=world_size, choice=choice)


def sequence_length(train_dataset: Any, *, data_collator: Any = None, rows: int) -> int | None:
    """What the Trainer knows of a step's sequence length before training: a collator that pads every batch to its
    ``max_length``, else the longest ``input_ids`` among the first ``rows`` examples of a sized dataset (the first
    global batch in order: all of them for blocks of a fixed length), else None."""
    padding, length = getattr(data_collator, "padding", None), getattr(data_collator, "max_length", None)
    if padding == "max_length" and isinstance(length, int):
        return length
    if not (hasattr(train_dataset, "__len__") and hasattr(train_dataset, "__getitem__")):
        return None  # an iterable dataset: reading ahead would consume it
    lengths = []
    for i in range(min(len(train_dataset), rows)):
        example = train_dataset[i]
        ids = example.get("input_ids") if isinstance(example, Mapping) else None
        if ids is None or not hasattr(ids, "__len__"):
            return None
        lengths.append(len(ids))
    return max(lengths, default=None)


def _calibration(calibration: Calibration | str | os.PathLike | None) -> Calibration | None:
    if calibration is None or isinstance(calibration, Calibration):
        return calibration
    try:
        return Calibration.load(os.fspath(calibration))
    except FileNotFoundError:
        raise ValueError(f"parallel calibration={calibration!r}: no such file (qn-hf-plan MODEL --gpus N --calibrate "
                         f"writes one)") from None
    except (OSError, ValueError) as e:
        raise ValueError(f"parallel calibration={calibration!r} cannot be read: {e}") from None


def check_training_args(args, *, mesh: TrainerMesh, world_size: int, compute_loss_func: Any = None) -> None:
    """Refuse the ``TrainingArguments`` (and launcher settings) that conflict with the mesh."""
    if mesh.world_size != world_size:
        named = [k for k in MESH_DEGREES if k in mesh.given]
        dims = ", ".join(f"{k}={getattr(mesh.config.dims, k)}" for k in named) or "dp=1"
        raise ValueError(f"parallel=dict({dims}) needs {mesh.world_size} processes but {world_size} were launched; "
                         f"launch {mesh.world_size} (torchrun --nproc-per-node {mesh.world_size} ...) or change "
                         f"parallel= so that dp*tp*pp*cp = {world_size}")
    for message in _conflicts(args, mesh=mesh, compute_loss_func=compute_loss_func):
        raise ValueError(message)


def _conflicts(args, *, mesh: TrainerMesh, compute_loss_func: Any):
    """Each conflicting setting, as the message that names it and the fix (first one raised)."""
    if getattr(args, "deepspeed", None) or os.environ.get("ACCELERATE_USE_DEEPSPEED", "").lower() == "true":
        yield ("deepspeed is set: qn_hf shards the model itself over dp x tp x pp, and DeepSpeed would wrap and "
               "re-shard it; remove the DeepSpeed config (parallel=dict(zero=True) shards the optimizer state)")
    if getattr(args, "fsdp", None) or os.environ.get("ACCELERATE_USE_FSDP", "").lower() == "true":
        yield (f"fsdp={getattr(args, 'fsdp', None)!r} (or an accelerate FSDP config): FSDP would wrap the already "
               f"sharded model; remove it (parallel=dict(zero=True) shards the optimizer state over dp)")
    if getattr(args, "parallelism_config", None) is not None:
        yield "parallelism_config is set: the mesh comes from parallel=dict(dp=, tp=, pp=, cp=); remove it"
    if getattr(args, "activation_checkpointing", False) or getattr(args, "gradient_checkpointing", False):
        yield ("gradient_checkpointing=True: HF's checkpointing wraps layers the pipeline stages drive; use "
               "parallel=dict(recompute='full') (or 'selective'), which gives the same results")
    # TrainingArguments names its autocast flags after the precisions
    for flag in (*Precision.values(), *(f"{p}_full_eval" for p in Precision)):
        if getattr(args, flag, False):
            dtype = flag[:4]
            yield (f"{flag}=True: accelerate's autocast would run without float32 master weights; set {flag}=False "
                   f"and pass parallel=dict(mixed_precision='{dtype}') (low-precision compute, float32 masters and "
                   f"gradient reduction)")
    if args.label_smoothing_factor:
        yield (f"label_smoothing_factor={args.label_smoothing_factor}: the built-in parallel loss is plain "
               f"cross-entropy; pass compute_loss_func= for a smoothed loss")
    backend = getattr(args, "torch_compile_backend", None)
    if getattr(args, "torch_compile", False) and backend not in (None, "inductor"):
        yield (f"torch_compile_backend={backend!r}: qn_hf compiles each block with inductor "
               f"(parallelize(compile=True)); unset it or set it to 'inductor'")
    if getattr(args, "torch_compile_mode", None) is not None:
        yield (f"torch_compile_mode={args.torch_compile_mode!r}: qn_hf compiles each block in inductor's default mode "
               f"(parallelize(compile=True)); unset it")
    if getattr(args, "use_liger_kernel", False):
        yield "use_liger_kernel=True replaces Hugging Face forwards and losses, which qn_hf drives; remove it"
    if getattr(args, "neftune_noise_alpha", None) is not None:
        yield (f"neftune_noise_alpha={args.neftune_noise_alpha}: NEFTune's embedding hook does not see the "
               f"vocabulary-parallel embedding's layout; remove it")
    if args.auto_find_batch_size:
        yield "auto_find_batch_size=True retries by rebuilding the model's wrapping; set per_device_train_batch_size"
    if args.train_sampling_strategy not in SAMPLING:
        yield (f"train_sampling_strategy={args.train_sampling_strategy!r}: only {list(SAMPLING)} are rebuilt exactly "
               f"as one process draws them")
    if args.push_to_hub:
        yield "push_to_hub=True is not supported; save_model(dir) writes an HF directory to push with huggingface_hub"
    if compute_loss_func is not None and mesh.config.dims.cp > 1:
        yield (f"compute_loss_func with cp={mesh.config.dims.cp}: each rank holds part of every sequence; use the "
               f"built-in loss (labels) or cp=1")


def check_compiled(args, *, compiled: bool) -> None:
    """``torch_compile=True`` with a ``ParallelModel`` given as ``model=``: its blocks must be compiled already."""
    if getattr(args, "torch_compile", False) and not compiled:
        raise ValueError("torch_compile=True but model= is a ParallelModel whose blocks are not compiled: build it "
                         "with qn_hf.parallelize(..., compile=True), or set torch_compile=False")


def check_trainer_inputs(*, model: Any, model_init: Any, compute_metrics: Any, preprocess_logits_for_metrics: Any,
                         peft_config: Any = None) -> None:
    """Refuse the ``Trainer`` arguments that need something the pipeline does not hand back."""
    if model_init is not None or model is None:
        raise ValueError("model_init= is not supported (the model is parallelized once, at construction): pass "
                         "model= (a Hugging Face or PEFT model)")
    if compute_metrics is not None or preprocess_logits_for_metrics is not None:
        raise ValueError("compute_metrics/preprocess_logits_for_metrics need the logits, which stay on the last "
                         "pipeline stage, split over tp: evaluation reports the loss only; remove them")
    if peft_config is not None:
        raise ValueError("peft_config= would wrap the model after it is parallelized; wrap it first "
                         "(model = peft.get_peft_model(model, config)) and pass that model")


def check_user_optimizer(opt: Any, *, pm: Any, zero: bool) -> None:
    """An ``optimizers=(opt, sched)`` optimizer must step this rank's shards (one built before parallelizing holds
    the unsharded weights), and be a ``qn_hf.optimizer`` where only that can step (float32 masters, ZeRO-1)."""
    if opt is None:
        return
    if isinstance(opt, ParallelOptimizer):
        if opt.trainee.module is not pm.module:
            raise ValueError("optimizers= holds a qn_hf.optimizer of another ParallelModel; build it over trainer.pm")
        return
    ours = {id(p) for p in pm.module.parameters()}
    tensors = [p for group in opt.param_groups for p in group["params"]]
    stale = sum(id(p) not in ours for p in tensors)
    name = type(opt).__name__
    if stale:
        raise ValueError(f"optimizers=({name}, ...) steps tensors that are not this rank's shards of the parallelized "
                         f"model (it was built before parallelizing: {len(tensors)} tensors); pass "
                         f"optimizer_cls_and_kwargs=({name}, {{...}}) instead")
    if pm.precision is not None or zero:
        raise ValueError(f"mixed_precision/zero keep float32 masters or shards that only qn_hf.optimizer steps; pass "
                         f"optimizer_cls_and_kwargs=({name}, {{...}}) instead of optimizers=")


# The Trainer classes whose compute_loss trains what qn_hf trains in its place: transformers' own (the model's
# loss), TRL's SFTTrainer with its default nll loss (the built-in causal LM loss; its metrics are not logged), TRL's
# RewardTrainer (its pairwise loss, preference.py). (module prefix, class name) -> the args' loss_type it allows.
KNOWN_COMPUTE_LOSS: dict[tuple[str, str], tuple[str | None, ...] | None] = {
    ("transformers", "Trainer"): None,
    ("trl", "SFTTrainer"): ("nll",),
    ("trl", "RewardTrainer"): None,
}


def check_compute_loss(trainer_class: type, args) -> None:
    """The ``compute_loss`` the Trainer class would call is one whose loss qn_hf trains (``KNOWN_COMPUTE_LOSS``): a
    subclass's own would be silently left out."""
    owner = next(c for c in trainer_class.__mro__ if "compute_loss" in vars(c))
    key = next(((prefix, owner.__name__) for prefix, name in KNOWN_COMPUTE_LOSS
                if owner.__name__ == name and owner.__module__.startswith(prefix)), None)
    if key is None:
        raise ValueError(f"{owner.__name__}.compute_loss is not called by qn_hf.Trainer (each step runs "
                         f"pm.train_step, whose loss is the model's own); pass its loss as "
                         f"compute_loss_func=(outputs, labels, num_items_in_batch) -> loss instead of overriding "
                         f"compute_loss")
    allowed = KNOWN_COMPUTE_LOSS[key]
    loss_type = getattr(args, "loss_type", None)
    if allowed is not None and loss_type not in allowed:
        raise ValueError(f"{owner.__name__} with loss_type={loss_type!r}: qn_hf.Trainer trains the model's own loss, "
                         f"which is loss_type={allowed[0]!r}; use that, or pass compute_loss_func")


def job_args(args: Any) -> Any:
    """``args`` as the job's ranks are, when accelerate read them otherwise. ``TrainingArguments`` learns its
    process index from accelerate when built; on a CPU without ``use_cpu=True``, or under srun or mpirun
    without torchrun, it takes every rank for a lone process 0, and the Trainer then draws its progress bar and
    prints its logs on every rank, and every rank writes what rank 0 alone writes (trainer state, scheduler,
    ``rng_state_0.pth``), racing. The copy answers ``process_index``, ``local_process_index`` and ``world_size``
    from the job's process group (the same object otherwise); pickled (``torch.save(args)``), it is the user's
    class again."""
    ranks = (dist.get_rank(), local_rank(), dist.get_world_size())
    if (args.process_index, args.local_process_index, args.world_size) == ranks:
        return args
    job = copy.copy(args)
    job.__class__ = _job_class(type(args))
    job.job_ranks = ranks
    return job


@functools.cache
def _job_class(base: type) -> type:
    """``base`` (the user's TrainingArguments class: TRL's configs too) answering the three from ``job_ranks``."""

    def reduce(self, protocol):
        # the stdlib's own reconstructor (loadable without qn_hf), of ``base``, with the fields but ``job_ranks``
        return copyreg._reconstructor, (base, object, None), {k: v for k, v in self.__dict__.items() if k != "job_ranks"}

    return type(base.__name__, (base,), {
        "process_index": property(lambda self: self.job_ranks[0]),
        "local_process_index": property(lambda self: self.job_ranks[1]),
        "world_size": property(lambda self: self.job_ranks[2]),
        "__reduce_ex__": reduce, "__module__": base.__module__})
