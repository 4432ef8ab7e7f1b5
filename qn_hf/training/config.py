"""``TrainConfig``: every option of the training scripts, from defaults, a YAML file and the CLI.

Precedence is defaults < YAML < command line, and the YAML keys are exactly the option names with
dashes as underscores (``mesh: [dp, tp, pp]``, ``schedule: 1f1b``, ``batch_size: 64`` ...), so a
config file and a command line say the same things. The effective config is written next to the
run's outputs, which makes every run reproducible from its own directory; under ``mesh: auto`` it
records the configuration the planner chose (``TrainConfig.chosen``), so a rerun from it trains the same.
"""

from __future__ import annotations

import argparse
import dataclasses
import enum
import os
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import yaml

from .errors import UsageError
from .presets import TASK_PRESETS

if TYPE_CHECKING:
    from ..config.dims import ParallelDims
    from ..config.parallel_config import ParallelConfig

TASKS = ("lm", "vit")
AUTO = "auto"  # mesh: the planner's choice (qn_hf.auto_choice), made when the run starts (loop.py)
# What each script uses where it differs from TrainConfig's defaults: the one source for the
# scripts, their --help and load_config.
TASK_DEFAULTS: dict[str, dict[str, Any]] = {
    "lm": {"model": "tiny-gpt2", "output_dir": "runs/lm", "val_fraction": 0.05},
    "vit": {"model": "tiny-vit", "output_dir": "runs/vit", "val_fraction": 0.2, "batch_size": 64, "lr": 2e-3,
            "steps": 400, "weight_decay": 0.05, "warmup_steps": 25},
}


@dataclass(frozen=True)
class TrainConfig:
    task: str = "lm"
    model: str = "tiny-gpt2"  # a local Hugging Face directory, or a preset name (see presets.py)
    tokenizer: str | None = None  # LM: a tokenizer directory; default: the model's own, else bytes
    data: tuple[str, ...] = ()  # files, directories or globs; empty: the task's offline default
    text_column: str = "text"
    image_column: str = "image"
    label_column: str = "label"
    val_fraction: float = 0.1
    mesh: tuple[int, int, int] | str | None = None  # (dp, tp, pp) or "auto"; default: (world size / cp, 1, 1)
    calibration: str | None = None  # mesh auto: a `qn-hf-plan --calibrate` file; default: the stated GPU figures
    dp_shard: int = 1  # FSDP: weights, gradients and optimizer state sharded over groups of this many dp ranks
    cp: int = 1  # context parallelism: each sequence split over this many ranks (ring attention)
    sequence_parallel: bool = False  # Megatron sequence parallelism inside tp
    ep: int = 1  # expert parallelism: MoE experts sharded over ep of a stage's dp x tp ranks
    expert_dispatch: str = "all_to_all"  # how ep moves tokens: "all_to_all" or "all_gather" (see qn_hf.parallelize)
    schedule: str = "1f1b"
    virtual_stages: int = 1  # chunks per pipeline stage under schedule interleaved_1f1b
    microbatches: int | None = None  # default: default_microbatches(...)
    mixed_precision: str | None = None  # "bf16" or "fp16": see qn_hf.parallelize
    zero: bool = False  # ZeRO-1: each dp rank keeps 1/dp of the optimizer state
    recompute: str | None = None  # "full" or "selective" activation recomputation
    offload: str | None = None  # "activations": what recomputation keeps, held in host memory
    loss_chunk_tokens: int | None = None  # a causal LM's loss this many tokens at a time (see qn_hf.parallelize)
    batch_size: int = 32  # global: split over dp, then into microbatches
    seq_len: int = 128
    steps: int = 200
    lr: float = 1e-3
    min_lr_ratio: float = 0.1
    warmup_steps: int = 10
    weight_decay: float = 0.01
    grad_clip: float = 1.0  # 0 disables clipping (the norm is still logged)
    eval_every: int = 50
    eval_batches: int = 0  # 0: the whole validation split
    save_every: int = 0  # 0: only at the end (and at --stop-after)
    keep_last: int = 3  # checkpoints kept: the newest N (a bad save never takes the last good state)
    stop_after: int | None = None  # stop (with a checkpoint) after this step, as if interrupted
    # "latest": the newest complete checkpoint in output_dir's, when there is one (a restarted job
    # continues with the command that started it); a checkpoint path; None (--no-resume): start over
    resume: str | None = "latest"
    async_save: bool = False  # checkpoints written by a background thread while training goes on
    output_dir: str = "runs/train"
    export: bool = True  # save_pretrained the trained model into output_dir/model
    seed: int = 0
    timeline_step: int | None = None  # record this step's pipeline timeline; default 3 when pp > 1
    timeout_s: float = 600.0  # bound on every collective: a dead rank fails the job, never hangs it
    progress: bool = True
    # Not an option: the options the YAML file or the command line set (load_config), which mesh auto
    # keeps in every configuration it considers, where the planner chooses the others.
    given: frozenset[str] = field(default=frozenset(), compare=False, repr=False)

    @property
    def auto(self) -> bool:
        return self.mesh == AUTO

    def mesh_for(self, world: int) -> tuple[int, int, int]:
        """(dp, tp, pp): ``mesh``, else every process that context parallelism leaves as data parallel."""
        if self.auto:
            raise ValueError("mesh auto has no degrees until the planner chooses them (TrainConfig.chosen)")
        return self.mesh or (max(1, world // self.cp), 1, 1)

    def mesh_dims(self, world: int) -> ParallelDims:
        """The degrees that take processes of their own (``mesh`` and cp), to count the processes they need
        before the configuration's other checks."""
        from ..config.dims import Axis, ParallelDims

        return ParallelDims.of({**dict(zip((Axis.DP.value, Axis.TP.value, Axis.PP.value), self.mesh_for(world))),
                                Axis.CP.value: self.cp})

    def parallel_config(self, *, world: int) -> ParallelConfig:
        """How the run parallelizes its model, as the one value ``parallelize`` takes (its ValueError
        names the option and the fix). Built once per run; ``microbatches`` must be set by then."""
        from ..config.parallel_config import ParallelConfig  # the library, only when a run starts

        dp, tp, pp = self.mesh_for(world)
        # every option of this config that ParallelConfig takes, under the same name (dp_shard, cp, ep,
        # sequence_parallel, schedule, ...): a new parallel option reaches the run by being a field here
        takes = ParallelConfig.keyword_names()
        options = {f.name: getattr(self, f.name) for f in dataclasses.fields(self) if f.name in takes}
        return ParallelConfig.from_keywords(dp=dp, tp=tp, pp=pp, **options)

    def fixed_options(self) -> dict[str, Any]:
        """Mesh auto: the ``ParallelConfig`` keywords this run set, which every candidate keeps. A schedule
        goes with the virtual stages given (auto would otherwise choose both)."""
        from ..config.parallel_config import ParallelConfig
        from ..config.schedule import Schedule

        given = set(self.given) | ({"schedule"} if "virtual_stages" in self.given else set())
        fixed = {name: getattr(self, name) for name in sorted(given & set(ParallelConfig.keyword_names()))}
        if "schedule" in fixed:  # the member: auto.py tells schedules apart by identity
            fixed["schedule"] = Schedule(fixed["schedule"])
        return fixed

    def chosen(self, parallel: ParallelConfig) -> TrainConfig:
        """This run at the configuration mesh auto chose: the explicit mesh and every option of
        ``parallel`` this config holds (``microbatches``, the schedule, ...), as a rerun would set them."""
        keywords = parallel.keywords()
        options = {f.name: keywords[f.name] for f in dataclasses.fields(self) if f.name in keywords}
        options = {name: value.value if isinstance(value, enum.Enum) else value for name, value in options.items()}
        return dataclasses.replace(self, mesh=(parallel.dims.dp, parallel.dims.tp, parallel.dims.pp), calibration=None,
                                   **options)

    @property
    def checkpoint_root(self) -> str:
        return os.path.join(self.output_dir, "checkpoints")

    def to_yaml_dict(self) -> dict[str, Any]:
        out = dataclasses.asdict(self)
        del out["given"]
        out["data"] = list(self.data)
        out["mesh"] = list(self.mesh) if self.mesh is not None else None
        return out


_FIELDS = {f.name: f for f in dataclasses.fields(TrainConfig) if f.name != "given"}
_HELP = {
    "model": "local Hugging Face model directory, or a preset: {presets}",
    "tokenizer": "LM tokenizer directory (default: the model directory's tokenizer, else UTF-8 bytes)",
    "data": "data files, directories or globs (LM: .txt/.parquet/.json[l]; ViT: an image folder or .parquet); "
    "default: offline built-in data (LM: Python's reference manual text; ViT: scikit-learn digits)",
    "mesh": "dp tp pp (world size must equal dp*tp*pp*cp), or auto: the configuration the planner predicts fastest "
    "that fits, training exactly --batch-size sequences of --seq-len per step, keeping the parallel options given "
    "(--cp, --dp-shard, --ep, --sequence-parallel, --schedule, --mixed-precision, --recompute); default: all ranks "
    "not used by --cp data parallel",
    "calibration": "with --mesh auto: the machine's figures, a JSON file written by qn-hf-plan --calibrate (default: "
    "this machine, measured quickly by every rank and kept; the stated figures on an H100 or H200)",
    "dp_shard": "FSDP (ZeRO-3): shard weights, gradients and optimizer state over groups of this many dp ranks "
    "(must divide dp; gradients are all-reduced across the dp/dp_shard groups); 1: plain data parallelism",
    "cp": "context parallelism: split each sequence over this many ranks (ring attention); the world size is "
    "dp*tp*pp*cp, and seq_len must divide by 2*cp",
    "sequence_parallel": "Megatron sequence parallelism: split the activations between tensor-parallel regions "
    "over the tp ranks along the sequence (needs tp > 1)",
    "ep": "expert parallelism: shard each MoE layer's experts over this many of a stage's dp x tp ranks (ep must "
    "divide dp*tp and the number of experts); 1: experts replicated over dp, split over tp",
    "expert_dispatch": "with --ep: all_to_all (the least traffic, one device wait per MoE call) or all_gather (no "
    "wait, ep times the tokens moved and held; every rank's batch the same shapes)",
    "schedule": "pipeline schedule: 1f1b, gpipe, interleaved_1f1b (with --virtual-stages) or zb_h1",
    "virtual_stages": "chunks per pipeline stage for schedule interleaved_1f1b (the model is cut into pp x this "
    "many chunks, rank r running chunks r, r+pp, ...)",
    "microbatches": "microbatches per step and dp rank (default: 2*pp when the batch per dp rank divides by it, "
    "else the largest number up to that which divides it; 1 without pipeline parallelism)",
    "mixed_precision": "bf16 or fp16: low-precision compute, float32 gradients, master weights and AdamW moments "
    "(default: the model's dtype)",
    "zero": "ZeRO-1: each dp rank keeps 1/dp of the master weights and optimizer state",
    "recompute": "full or selective: recompute each block's activations in backward (default: keep them)",
    "offload": "activations: hold what recomputation keeps of each block (its inputs) in host memory, copied "
    "there and back on a side stream (needs --recompute); default: on the device",
    "loss_chunk_tokens": "lm: compute the loss this many tokens at a time, forward and backward, so the whole "
    "vocabulary's logits never exist at once (long sequences, large vocabularies); default: at once",
    "batch_size": "global batch size (examples per optimizer step, split over dp and microbatches)",
    "seq_len": "LM tokens per example",
    "min_lr_ratio": "cosine decay ends at lr * min_lr_ratio",
    "grad_clip": "clip the global gradient norm to this (0: no clipping)",
    "eval_batches": "validation batches per evaluation (0: the whole validation split)",
    "save_every": "write a sharded checkpoint every N steps (0: only at the end)",
    "keep_last": "keep the newest N checkpoints, removing older ones after each save",
    "stop_after": "stop after this step with a checkpoint, as if interrupted (the LR schedule still spans --steps)",
    "resume": "resume from the newest complete checkpoint in --output-dir (the default, when there is one) or from "
    "a checkpoint path; --no-resume starts over",
    "async_save": "write checkpoints from a background thread: a save copies this rank's shards to host memory and "
    "training goes on (one save in flight; a kill mid-write keeps the previous checkpoint)",
    "timeline_step": "record this step's pipeline timeline as timeline.png (default: step 3 when pp > 1; 0: never)",
    "timeout_s": "seconds any collective may wait before the job fails",
}


def build_parser(*, task: str, description: str) -> argparse.ArgumentParser:
    """A parser with one option per config field; unset options stay absent so YAML values win."""
    parser = argparse.ArgumentParser(description=description, formatter_class=_Formatter,
                                     argument_default=argparse.SUPPRESS)
    parser.add_argument("--config", help="YAML file with any of the options below (command line wins)")
    defaults = task_defaults(task)
    for name, f in _FIELDS.items():
        if name == "task":
            continue
        flag = "--" + name.replace("_", "-")
        kind = _kind(f)
        helptext = _HELP.get(name, "").format(presets=", ".join(TASK_PRESETS[task]))
        default = defaults.get(name, f.default)
        if default not in (None, ()):  # None and () mean "derived", which the help text explains
            helptext = f"{helptext} (default {default})".lstrip()
        if name == "mesh":
            parser.add_argument(flag, type=_degree, nargs="+", help=helptext)  # three degrees, or auto
        elif name == "data":
            parser.add_argument(flag, nargs="+", help=helptext)
        elif name == "resume":
            parser.add_argument(flag, nargs="?", const="latest", help=helptext)
            parser.add_argument("--no-resume", dest=name, action="store_const", const=None,
                                help="start over, even where --output-dir holds checkpoints")
        elif kind is bool:
            parser.add_argument(flag, action=argparse.BooleanOptionalAction, help=helptext)
        else:
            parser.add_argument(flag, type=kind, help=helptext)
    parser.set_defaults(task=task)
    return parser


class _Formatter(argparse.RawDescriptionHelpFormatter):
    def _format_args(self, action: argparse.Action, default_metavar: str) -> str:
        if action.dest == "mesh":  # nargs "+" takes either form; say which
            return f"DP TP PP | {AUTO}"
        return super()._format_args(action, default_metavar)


def _degree(text: str) -> int | str:
    """One word of ``--mesh``: a degree, or ``auto`` (``_mesh`` checks the whole)."""
    return text if text == AUTO else int(text)


def default_microbatches(*, batch_size: int, dp: int, pp: int) -> int:
    """Enough microbatches to keep the pipeline's bubble small ((pp-1)/(M+pp-1) of a step): 2*pp when
    the per-dp batch divides by it, else the largest number below that which divides it."""
    if pp == 1 or batch_size % dp:
        return 1
    per_rank = batch_size // dp
    return next(m for m in range(min(2 * pp, per_rank), 0, -1) if per_rank % m == 0)


def task_defaults(task: str) -> dict[str, Any]:
    """The values a script for ``task`` starts from, before YAML and the command line."""
    return {"task": task, **TASK_DEFAULTS[task]}


def load_config(args: argparse.Namespace) -> TrainConfig:
    """Merge the task's defaults, the YAML file named by ``--config`` and the command line."""
    values: dict[str, Any] = task_defaults(args.task)
    cli = vars(args).copy()
    path = cli.pop("config", None)
    given: set[str] = set()
    if path is not None:
        yaml_values = read_yaml(path)
        values.update(yaml_values)
        given |= {name for name, value in yaml_values.items() if value is not None}
    values.update(cli)
    given |= set(cli) - {"task"}  # argparse leaves out the options not on the command line
    return make_config(values, given=given)


def read_yaml(path: str) -> dict[str, Any]:
    try:
        with open(path) as f:
            loaded = yaml.safe_load(f)
    except FileNotFoundError:
        raise UsageError(f"config file {path} does not exist") from None
    except yaml.YAMLError as e:
        raise UsageError(f"config file {path} is not valid YAML: {e}") from None
    if loaded is None:
        return {}
    if not isinstance(loaded, dict):
        raise UsageError(f"config file {path} must hold a mapping of option: value, got {type(loaded).__name__}")
    unknown = sorted(set(loaded) - set(_FIELDS))
    if unknown:
        raise UsageError(f"config file {path}: unknown option(s) {unknown}; valid: {sorted(_FIELDS)}")
    return loaded


def make_config(values: dict[str, Any], *, given: Iterable[str] | None = None) -> TrainConfig:
    """Type-check and normalise raw values (from YAML or argparse) into a ``TrainConfig``; ``given``:
    the options the user set (default: every one in ``values`` but the task)."""
    out: dict[str, Any] = {}
    for name, value in values.items():
        f = _FIELDS[name]
        if value is None:
            if "None" not in str(f.type):
                raise UsageError(f"{name} needs a value (got null)")
            out[name] = None
        elif name == "mesh":
            out[name] = _mesh(value)
        elif name == "data":
            out[name] = (value,) if isinstance(value, str) else tuple(str(v) for v in value)
        else:
            kind = _kind(f)
            if kind is bool and not isinstance(value, bool):
                raise UsageError(f"{name} must be true or false, got {value!r}")
            try:
                out[name] = kind(value)
            except (TypeError, ValueError):
                raise UsageError(f"{name} must be a {kind.__name__}, got {value!r}") from None
    given = set(values) - {"task"} if given is None else set(given)
    cfg = TrainConfig(**out, given=frozenset(name for name in given if out.get(name) is not None))
    _check(cfg)
    return cfg


def _mesh(value: Any) -> tuple[int, int, int] | str:
    if value == AUTO or isinstance(value, (list, tuple)) and list(value) == [AUTO]:  # YAML `mesh: auto`, --mesh auto
        return AUTO
    if not isinstance(value, (list, tuple)) or len(value) != 3 or not all(isinstance(v, int) for v in value):
        raise UsageError(f"mesh must be three integers [dp, tp, pp] or {AUTO}, got {value!r}")
    return tuple(value)  # type: ignore[return-value]


def _check(cfg: TrainConfig) -> None:
    from ..config.options import Dispatch, Offload, Precision, Recompute
    from ..config.schedule import SCHEDULES

    if cfg.task not in TASKS:
        raise UsageError(f"task {cfg.task!r} is not one of {TASKS}")
    if cfg.schedule not in SCHEDULES:
        raise UsageError(f"schedule {cfg.schedule!r} is not one of {sorted(SCHEDULES)}")
    for name, value, choices in (("mixed_precision", cfg.mixed_precision, Precision.values()),
                                 ("recompute", cfg.recompute, Recompute.values()),
                                 ("expert_dispatch", cfg.expert_dispatch, Dispatch.values()),
                                 ("offload", cfg.offload, Offload.values())):
        if value is not None and value not in choices:
            raise UsageError(f"{name} {value!r} is not one of {sorted(choices)}")
    positive = {"batch_size": cfg.batch_size, "steps": cfg.steps, "seq_len": cfg.seq_len, "ep": cfg.ep,
                "dp_shard": cfg.dp_shard, "cp": cfg.cp,
                "virtual_stages": cfg.virtual_stages, "keep_last": cfg.keep_last,
                **{name: value for name, value in (("microbatches", cfg.microbatches),
                                                   ("loss_chunk_tokens", cfg.loss_chunk_tokens)) if value is not None}}
    for name, value in positive.items():
        if value < 1:
            raise UsageError(f"{name} must be at least 1, got {value}")
    if cfg.auto and cfg.microbatches is not None:
        raise UsageError(f"microbatches={cfg.microbatches} with mesh auto: the planner chooses them with the mesh (the "
                         f"global batch over dp and its micro-batch size); leave out --microbatches (microbatches: "
                         f"null), or give an explicit --mesh")
    if cfg.calibration is not None and not cfg.auto:
        raise UsageError(f"calibration {cfg.calibration} is read by --mesh auto only (it prices the configurations "
                         f"the planner compares); pass --mesh auto, or leave out --calibration")
    if cfg.mesh is not None and not cfg.auto and min(cfg.mesh) < 1:
        raise UsageError(f"mesh degrees must be at least 1, got {list(cfg.mesh)}")
    if not 0.0 < cfg.val_fraction < 1.0:
        raise UsageError(f"val_fraction must be between 0 and 1, got {cfg.val_fraction}")
    if cfg.stop_after is not None and not 1 <= cfg.stop_after <= cfg.steps:
        raise UsageError(f"stop_after={cfg.stop_after} must lie in 1..steps={cfg.steps}")
    if cfg.lr <= 0 or cfg.warmup_steps < 0 or not 0.0 <= cfg.min_lr_ratio <= 1.0:
        raise UsageError(f"need lr > 0, warmup_steps >= 0 and 0 <= min_lr_ratio <= 1; got lr={cfg.lr}, "
                         f"warmup_steps={cfg.warmup_steps}, min_lr_ratio={cfg.min_lr_ratio}")


def _kind(f: dataclasses.Field) -> type:
    """The scalar type of a field from its annotation string (``int | None`` -> int)."""
    base = str(f.type).split("|")[0].strip()
    return {"int": int, "float": float, "str": str, "bool": bool}.get(base, str)


def effective_yaml(cfg: TrainConfig, *, comment: str = "") -> str:
    """The options as YAML that ``--config`` reads back, after ``comment`` (each line a ``#`` line)."""
    head = "".join(f"# {line}\n" for line in comment.splitlines())
    return head + yaml.safe_dump(cfg.to_yaml_dict(), sort_keys=False)


__all__ = ["AUTO", "TASKS", "TrainConfig", "build_parser", "effective_yaml", "load_config", "make_config"]
