"""``qn_hf.Trainer``: Hugging Face's ``Trainer`` loop (logging, evaluation, LR schedules, checkpoints, callbacks,
``report_to``) driving a ``ParallelModel``; ``ParallelTrainerMixin`` does the same for ``Trainer`` subclasses
such as TRL's ``SFTTrainer`` and ``RewardTrainer`` (its pairwise loss: preference.py).

Which ``Trainer`` methods are replaced, and why (everything else is transformers' own code):

* ``get_*_dataloader``: every rank iterates the loader one process would, batches of ``per_device x dp`` rows
  (trainer_data.py), instead of accelerate's per-process shards, which know nothing of tp and pp ranks.
* ``get_batch_samples``/``training_step``: the accumulation batches of one optimizer step are merged and run as
  ONE ``pm.train_step`` (accumulation becomes microbatches: ``parallel microbatches x gradient_accumulation_steps``
  per step); the earlier ones return a zero loss, the last the step's global loss, so the logged sum is the step's.
  The built-in loss is the mean over every target of the step, which is what ``Trainer``'s ``num_items_in_batch``
  normalisation gives in one process.
* ``_prepare_for_training``: the optimizer and scheduler without ``accelerator.prepare``: accelerate would wrap the
  sharded model in DDP, whose constructor broadcasts rank 0's shards over every rank.
* ``create_optimizer``: ``qn_hf.optimizer`` over this rank's trainable shards, with ``Trainer``'s decay groups and
  ``optim`` class. ``_clip_grad_norm``/``_get_grad_norm``: the global norm over every shard.
* ``evaluation_loop``: ``pm.eval_step`` per batch (the logits stay on the last stage).
* ``save_model``: ``pm.save_pretrained`` (an HF directory, or the adapter of a PEFT model); inside a checkpoint the
  sharded format with the optimizer state, which loads at any mesh (``_load_from_checkpoint``,
  ``_load_optimizer_and_scheduler``, ``_load_best_model``); ``_save_optimizer_and_scheduler`` keeps the scheduler.
* ``get_total_train_batch_size``, ``floating_point_ops``, ``_track_num_input_tokens``: counts over dp replicas, not
  over processes that all hold the same global batch.

What is refused or not supported, and why: trainer_args.py.
"""

from __future__ import annotations

import inspect
import os
import sys
from collections.abc import Mapping
from typing import Any

import torch
import transformers
from transformers.trainer import SCHEDULER_NAME, TRAINING_ARGS_NAME
from transformers.trainer_utils import PREFIX_CHECKPOINT_DIR, EvalLoopOutput, has_length

from ...checkpoint import CheckpointError, checkpoint_dir, read_index
from ...config.dims import MESH_DEGREES
from ...config.features import Feature
from ...data_parallel.grad_norm import clip_grad_norm_
from ...entry.parallelize import parallelize
from ...mesh import launched_world_size
from ...parallel_model import ParallelModel, optimizer
from ...step.compile import is_compiled
from ...tensor_parallel.rng import device_rng_state, set_device_rng_state
from .args import (
    TrainerMesh,
    auto_mesh,
    check_compiled,
    check_compute_loss,
    check_trainer_inputs,
    check_training_args,
    check_user_optimizer,
    is_auto,
    job_args,
    trainer_mesh,
)
from .data import count_items, merge_batches, one_process_loader, rows_of, user_loss
from .preference import MARGIN, is_reward_trainer, paired_rows, pairs_whole, reward_loss

SHARDED = "sharded"  # the sub-directory of checkpoint-N holding pm.save_checkpoint's format
TRAINER_STATE = "trainer_state.json"  # what Trainer._save_checkpoint writes last into checkpoint-N


def last_complete_checkpoint(output_dir: str) -> str | None:
    """The newest ``checkpoint-N`` in ``output_dir`` whose save finished (None: there is none).

    Hugging Face's ``get_last_checkpoint`` takes the highest-numbered directory, but ``Trainer``
    writes ``checkpoint-N`` in place and a killed save leaves it half written: a finished one has
    ``trainer_state.json`` (written last) and a sharded checkpoint whose sealed index reads back."""
    prefix = PREFIX_CHECKPOINT_DIR + "-"
    names = os.listdir(output_dir) if os.path.isdir(output_dir) else []
    steps = sorted((int(n[len(prefix):]), n) for n in names if n.startswith(prefix) and n[len(prefix):].isdigit())
    for _, name in reversed(steps):
        path = os.path.join(output_dir, name)
        if not os.path.isfile(os.path.join(path, TRAINER_STATE)):
            continue
        try:
            read_index(checkpoint_dir(os.path.join(path, SHARDED)))
        except (CheckpointError, OSError):
            continue
        return path
    return None


class ParallelTrainerMixin:
    """Makes a ``transformers.Trainer`` (sub)class train a model parallelized over ``parallel=dict(dp=, tp=, pp=,
    microbatches=, schedule=, ..., zero=)`` (the ``qn_hf.parallelize`` keywords, plus ``zero`` for ZeRO-1).

    ``per_device_train_batch_size`` (and eval) is per dp replica: a step's global batch is ``per_device x dp x
    gradient_accumulation_steps`` examples, the very examples, in order, that ``transformers.Trainer`` draws in one
    process with ``per_device x dp`` and the same seed, so logged losses match it. ``model`` may be a Hugging Face or
    PEFT model (parallelized here) or a ``ParallelModel`` (then ``parallel`` is not given); ``trainer.pm`` is the
    ``ParallelModel``. Gradient accumulation runs as microbatches of one ``pm.train_step`` per optimizer step.

    ``parallel="auto"`` (or ``dict(mesh="auto", ...)``) lets the planner choose the configuration
    (``qn_hf.auto_choice``): the fastest it predicts that fits, keeping the other keywords given (``cp``,
    ``mixed_precision``, ``recompute``, ``zero``, ...; ``microbatches`` is refused: auto chooses them). dp being its
    choice, ``per_device_train_batch_size`` is then per launched process, as under DDP: a step's global batch is
    ``per_device x processes x gradient_accumulation_steps``, the batch ``transformers.Trainer`` draws in one process
    with ``per_device x processes``, whatever dp is chosen. The sequence length it plans for is ``seq_len`` in the
    dict, else the collator's ``max_length`` when it pads to it, else the longest ``input_ids`` of the first global
    batch of examples of ``train_dataset`` (a ``ValueError`` asks for ``seq_len`` when none of these says it);
    ``calibration`` in the dict is a ``qn-hf-plan --calibrate`` file (default: this machine's, measured). Rank 0
    prints the choice's summary; ``trainer.auto_choice`` holds it (None for an explicit mesh).

    Not supported, each refused with a ``ValueError`` naming the fix (reasons in trainer_args.py): DeepSpeed, FSDP,
    ``parallelism_config``; ``gradient_checkpointing`` (-> ``parallel=dict(recompute="full")``); ``fp16``/``bf16``
    (-> ``parallel=dict(mixed_precision=)``); ``compute_metrics`` and predicted logits (they stay on the last stage);
    ``label_smoothing_factor``; ``model_init``; ``auto_find_batch_size``; a ``torch_compile_backend`` other than
    inductor and ``torch_compile_mode`` (``torch_compile=True`` compiles each block, as ``parallel=dict(compile=True)``
    does); Liger; NEFTune; ``group_by_length``; ``push_to_hub``; an optimizer over the unsharded model. A
    ``compute_loss`` override is not called for training (the built-in loss, or ``compute_loss_func``, is).
    """

    def __init__(self, model=None, args=None, *rest, parallel: Mapping[str, Any] | str | None = None,
                 **kwargs) -> None:
        if args is None:
            raise ValueError("qn_hf.Trainer needs args=TrainingArguments(...) (output_dir, batch sizes, seed)")
        check_compute_loss(type(self), args)
        check_trainer_inputs(model=model, model_init=kwargs.get("model_init"),
                             compute_metrics=kwargs.get("compute_metrics"),
                             preprocess_logits_for_metrics=kwargs.get("preprocess_logits_for_metrics"),
                             peft_config=kwargs.get("peft_config"))
        if isinstance(model, ParallelModel):
            if parallel is not None:
                raise ValueError("model= is already a ParallelModel: leave parallel= out (its mesh is fixed)")
            fixed = TrainerMesh(config=model.parallel_config, where={}, zero=False,
                                given=frozenset(MESH_DEGREES))
            check_training_args(args, mesh=fixed, world_size=model.dims.world_size,
                                compute_loss_func=kwargs.get("compute_loss_func"))
            check_compiled(args, compiled=is_compiled(model.module, layers=model.stage.plan.layers))
            pm, self._zero, mesh, self.auto_choice = model, False, fixed, None
        else:
            if is_auto(parallel):
                data = self._data_arguments(model, args, *rest, **kwargs)
                mesh = auto_mesh(parallel, args=args, model=model, world_size=launched_world_size(), **data)
            else:
                mesh = trainer_mesh(parallel, args=args)
            check_training_args(args, mesh=mesh, world_size=launched_world_size(),
                                compute_loss_func=kwargs.get("compute_loss_func"))
            pm, self._zero = parallelize(model, mesh.config, **mesh.where), mesh.zero
            self.auto_choice = mesh.choice
            if mesh.choice is not None and torch.distributed.get_rank() == 0:
                print("\n".join(f"qn_hf.Trainer mesh='auto': {line}" for line in mesh.choice.summary().splitlines()),
                      file=sys.stderr, flush=True)
        self.pm = pm
        # per-device batches in one loader batch: dp, or the launched processes under mesh="auto" (args.auto_mesh)
        self._batch_devices = mesh.batch_devices or pm.dims.dp
        # the table's refusals and warnings for the Trainer (and ZeRO, which its optimizer will shard) with the mesh
        pm.check_composes_with(Feature.TRAINER, *([Feature.ZERO] if self._zero and pm.dims.replicas > 1 else []))
        self._window: list[Mapping] = []  # the accumulation batches of the current optimizer step
        hf_model = pm.adapter.peft_model if pm.adapter is not None else pm.module
        # Trainer's constructor seeds the device generator with args.seed on every rank; that generator is
        # qn_hf's shared dropout stream, seeded per dp replica and stage (rng.py): keep ours.
        streams = device_rng_state(pm.device)
        super().__init__(hf_model, job_args(args), *rest, **kwargs)
        set_device_rng_state(pm.device, streams)
        if self.args.n_gpu > 1:
            raise ValueError(f"this process sees {self.args.n_gpu} GPUs and Trainer would use torch DataParallel; "
                             f"launch one process per GPU (torchrun --nproc-per-node N)")
        if self.is_deepspeed_enabled or self.is_fsdp_enabled:
            raise ValueError("accelerate is configured for DeepSpeed/FSDP; launch without that config (qn_hf shards "
                             "the model itself)")
        check_user_optimizer(self.optimizer, pm=pm, zero=self._zero)

    def _data_arguments(self, model, args, *rest, **kwargs) -> dict[str, Any]:
        """``train_dataset`` and ``data_collator`` as the Trainer class after this mixin takes them (mesh="auto"
        reads the sequence length from them before that class is built)."""
        try:
            bound = inspect.signature(super().__init__).bind_partial(model, args, *rest, **kwargs).arguments
        except TypeError:  # the Trainer's own constructor will say what is wrong
            bound = kwargs
        return {"train_dataset": bound.get("train_dataset"), "data_collator": bound.get("data_collator")}

    # -- data ------------------------------------------------------------------------------------
    def _loader(self, dataset, *, batch_size: int, description: str, training: bool):
        collator = self.data_collator
        if hasattr(dataset, "column_names") and hasattr(dataset, "remove_columns"):  # a datasets.Dataset
            dataset = self._remove_unused_columns(dataset, description=description)
        else:
            collator = self._get_collator_with_removed_columns(collator, description=description)
        return one_process_loader(dataset, args=self.args, batch_size=batch_size * self._batch_devices,
                                  collate_fn=collator, training=training)

    def get_train_dataloader(self):
        if self.train_dataset is None:
            raise ValueError("Trainer: training requires a train_dataset.")
        return self._loader(self.train_dataset, batch_size=self._train_batch_size, description="Training", training=True)

    def get_eval_dataloader(self, eval_dataset=None):
        if eval_dataset is None and self.eval_dataset is None:
            raise ValueError("Trainer: evaluation requires an eval_dataset.")
        if isinstance(eval_dataset, str):
            eval_dataset = self.eval_dataset[eval_dataset]
        dataset = eval_dataset if eval_dataset is not None else self.eval_dataset
        return self._loader(dataset, batch_size=self.args.eval_batch_size, description="Evaluation", training=False)

    def get_test_dataloader(self, test_dataset):
        return self._loader(test_dataset, batch_size=self.args.eval_batch_size, description="test", training=False)

    def get_total_train_batch_size(self, args) -> int:
        return self._train_batch_size * args.gradient_accumulation_steps * self._batch_devices

    # -- one optimizer step ----------------------------------------------------------------------
    def get_batch_samples(self, epoch_iterator, num_batches, device):
        """Trainer's own prefetch of one step's accumulation batches, remembered so that the last
        ``training_step`` of the step runs them all; ``num_items_in_batch`` counted without a gather."""
        batches = []
        for _ in range(num_batches):
            try:
                batches.append(next(epoch_iterator))
            except StopIteration:
                break
        self._window = batches
        return batches, count_items(batches, shifts_labels=self._loss_shifts_labels)

    def training_step(self, model, inputs, num_items_in_batch=None) -> torch.Tensor:
        """The whole optimizer step's forward and backward on the last accumulation batch (earlier ones: zero)."""
        window = self._window if any(b is inputs for b in self._window) else [inputs]
        if inputs is not window[-1]:
            return torch.zeros((), device=self.args.device)
        self._window = []
        if num_items_in_batch is None:
            num_items_in_batch = count_items(window, shifts_labels=self._loss_shifts_labels)
        # zero_grad of the optimizer, not of the module: ZeRO-1 also resets its reduced gradient pieces
        self.optimizer.zero_grad(set_to_none=True)
        if is_reward_trainer(self):  # TRL's pairs, kept whole in every dp rank and microbatch (preference.py)
            window = [paired_rows(b) for b in window]
        batch = merge_batches(window)
        loss = self.pm.train_step(self._rows(batch), loss_fn=self._loss_fn(batch, num_items_in_batch),
                                  loss_keys=self._loss_keys)
        return loss.to(self.args.device)

    @property
    def _loss_keys(self) -> tuple[str, ...]:
        """Batch keys only the loss reads (a reward batch's margins), never given to the model."""
        return (MARGIN,) if is_reward_trainer(self) else ()

    def _rows(self, batch: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        return self.pm.local_batch(batch)

    def _loss_fn(self, batch: Mapping[str, torch.Tensor], num_items: torch.Tensor | None):
        """None (the built-in loss), ``compute_loss_func`` as ``pm.train_step``'s ``loss_fn`` (trainer_data.py), or
        TRL's ``RewardTrainer``'s pairwise loss (preference.py)."""
        if is_reward_trainer(self):
            pairs_whole(rows=rows_of(batch), dp=self.pm.dims.dp, microbatches=self.pm.microbatches)
            return reward_loss(center_rewards_coefficient=getattr(self.args, "center_rewards_coefficient", None))
        if self.compute_loss_func is None:
            return None
        return user_loss(self.compute_loss_func, batch=batch, num_items=num_items, dp=self.pm.dims.dp,
                         microbatches=self.pm.microbatches)

    def _prepare_for_training(self, max_steps, train_dataloader, resume_from_checkpoint):
        if self._created_lr_scheduler:  # a second train() gets a fresh schedule, as in Trainer
            self.lr_scheduler, self._created_lr_scheduler = None, False
        self.create_optimizer()
        self.create_scheduler(num_training_steps=max_steps)
        self.model_wrapped = self.model
        if resume_from_checkpoint is not None:
            self._load_optimizer_and_scheduler(resume_from_checkpoint)
        for attr in ("model", "optimizer", "lr_scheduler"):
            setattr(self.callback_handler, attr, getattr(self, attr))
        self.callback_handler.train_dataloader = train_dataloader
        return self.model, train_dataloader

    def create_optimizer(self, model=None):
        if self.optimizer is not None:
            return self.optimizer
        decay = set(self.get_decay_parameter_names(self.pm.module))
        trainable = [(n, p) for n, p in self.pm.named_parameters() if p.requires_grad]
        groups = [{"params": [p for n, p in trainable if n in decay], "weight_decay": self.args.weight_decay},
                  {"params": [p for n, p in trainable if n not in decay], "weight_decay": 0.0}]
        cls, kwargs = self.optimizer_cls_and_kwargs or self.get_optimizer_cls_and_kwargs(self.args, self.model)
        if not (isinstance(cls, type) and issubclass(cls, torch.optim.Optimizer)) or {"params", "model",
                                                                                      "optimizer_dict"} & set(kwargs):
            raise ValueError(f"optim={self.args.optim!r} builds {cls!r} with its own parameter handling; qn_hf.Trainer "
                             f"needs a torch.optim.Optimizer class (e.g. optim='adamw_torch')")
        self.optimizer = optimizer(self.pm, cls, zero=self._zero and self.pm.dims.replicas > 1, param_groups=groups,
                                   **kwargs)
        return self.optimizer

    def _clip_grad_norm(self, model):
        return clip_grad_norm_(self.pm, self.args.max_grad_norm)

    def _get_grad_norm(self, model, grad_norm=None):
        return clip_grad_norm_(self.pm, float("inf")) if grad_norm is None else grad_norm

    def floating_point_ops(self, inputs) -> int:
        # every dp replica counts the whole global batch over its shards; store_flos sums all ranks
        return super().floating_point_ops(inputs) // self.pm.dims.dp

    def _track_num_input_tokens(self, inputs) -> None:
        # accelerate's gather sums the same global batch from every process: keep one copy
        before = self.state.num_input_tokens_seen
        super()._track_num_input_tokens(inputs)
        self.state.num_input_tokens_seen = before + (self.state.num_input_tokens_seen - before) // self.args.world_size

    # -- evaluation ------------------------------------------------------------------------------
    def evaluation_loop(self, dataloader, description, prediction_loss_only=None, ignore_keys=None,
                        metric_key_prefix: str = "eval") -> EvalLoopOutput:
        """The loss of each global batch from ``pm.eval_step``, averaged over rows as one process's loop does
        (each batch's token-mean loss counted once per row)."""
        self.callback_handler.eval_dataloader = dataloader
        total, rows = 0.0, 0
        for inputs in dataloader:
            batch = merge_batches([inputs])
            reward = is_reward_trainer(self)  # TRL's reward model: its pairwise loss, counted per pair
            if reward or "labels" in batch:  # as one process: batches without labels give no loss
                batch = paired_rows(batch) if reward else batch
                count = None if reward else count_items([batch], shifts_labels=self._loss_shifts_labels)
                step = self.pm.eval_step(self._rows(batch), loss_fn=self._loss_fn(batch, count), loss_keys=self._loss_keys)
                total += step.item() * (rows_of(batch) // 2 if reward else rows_of(batch))
                rows += rows_of(batch) // 2 if reward else rows_of(batch)
            self.control = self.callback_handler.on_prediction_step(self.args, self.state, self.control)
        metrics = {f"{metric_key_prefix}_loss": total / rows} if rows else {}
        if description == "Prediction":
            raise ValueError("predict() returns predictions, which stay on the last pipeline stage split over tp; "
                             "use evaluate() for the loss, or save_model(dir) and predict with the plain model")
        samples = len(dataloader.dataset) if has_length(getattr(dataloader, "dataset", None)) else rows
        return EvalLoopOutput(predictions=None, label_ids=None, metrics=metrics, num_samples=samples)

    # -- saving and resuming ---------------------------------------------------------------------
    def train(self, resume_from_checkpoint: str | bool | None = None, *args, **kwargs):
        """``resume_from_checkpoint=True``: the newest checkpoint whose save finished
        (``last_complete_checkpoint``), where Hugging Face's would take a half-written one."""
        if resume_from_checkpoint is True:
            resume_from_checkpoint = last_complete_checkpoint(self.args.output_dir)
            if resume_from_checkpoint is None:
                raise ValueError(f"no complete checkpoint in {self.args.output_dir} to resume from (a checkpoint-N "
                                 f"with {TRAINER_STATE}); start without resume_from_checkpoint")
        return super().train(resume_from_checkpoint, *args, **kwargs)

    def save_model(self, output_dir: str | None = None, _internal_call: bool = False) -> None:
        """``save_model(dir)``: a plain HF directory (a PEFT model: its adapter), from every rank's shards. Inside a
        checkpoint (``_internal_call``, from ``Trainer._save_checkpoint``): the sharded format under
        ``checkpoint-N/sharded`` with the optimizer state, which resumes at any mesh."""
        output_dir = output_dir if output_dir is not None else self.args.output_dir
        if _internal_call:
            opt = None if self.args.save_only_model else self.optimizer
            self.pm.save_checkpoint(os.path.join(output_dir, SHARDED), optimizer=opt, step=self.state.global_step)
        else:
            self.pm.save_pretrained(output_dir)
        if self.args.should_save:
            os.makedirs(output_dir, exist_ok=True)
            tokenizer = self.processing_class or getattr(self.data_collator, "tokenizer", None)
            if tokenizer is not None:
                tokenizer.save_pretrained(output_dir)
            torch.save(self.args, os.path.join(output_dir, TRAINING_ARGS_NAME))

    def _load_rng_state(self, checkpoint: str | None) -> None:
        # Python's and numpy's states as Trainer restores them, not the device generator (qn_hf's shared dropout
        # stream): process k saved the stream of its coordinates at the saving mesh, so at another mesh the tp ranks
        # of a replica would differ. Dropout streams go on from this run's seeds (other masks than uninterrupted).
        streams = device_rng_state(self.pm.device)
        super()._load_rng_state(checkpoint)
        set_device_rng_state(self.pm.device, streams)

    def _save_optimizer_and_scheduler(self, output_dir: str) -> None:
        # the optimizer state is in the sharded checkpoint save_model wrote; the scheduler is the same on every rank
        if self.args.should_save:
            torch.save(self.lr_scheduler.state_dict(), os.path.join(output_dir, SCHEDULER_NAME))

    def _sharded(self, checkpoint: str) -> tuple[str, bool]:
        """The sharded checkpoint inside ``checkpoint`` and whether it holds optimizer state."""
        path = os.path.join(checkpoint, SHARDED)
        if not os.path.isdir(path):
            raise ValueError(f"{checkpoint} has no {SHARDED}/ directory: it is not a qn_hf.Trainer checkpoint; resume "
                             f"from one this Trainer saved (an HF directory loads with from_pretrained before training)")
        return path, read_index(checkpoint_dir(path)).get("optimizer") is not None

    def _load_from_checkpoint(self, resume_from_checkpoint: str, model=None) -> None:
        # With optimizer state, the weights are read together with it once the optimizer exists
        # (_load_optimizer_and_scheduler); a save_only_model checkpoint has only weights, read here.
        path, has_optimizer = self._sharded(resume_from_checkpoint)
        if not has_optimizer:
            self.pm.load_checkpoint(path)

    def _load_optimizer_and_scheduler(self, checkpoint: str | None) -> None:
        if checkpoint is None:
            return
        path, has_optimizer = self._sharded(checkpoint)
        if has_optimizer:
            self.pm.load_checkpoint(path, optimizer=self.optimizer)
        scheduler = os.path.join(checkpoint, SCHEDULER_NAME)
        if os.path.isfile(scheduler):
            self.lr_scheduler.load_state_dict(torch.load(scheduler, weights_only=True))

    def _load_best_model(self) -> None:
        self.pm.load_checkpoint(os.path.join(self.state.best_model_checkpoint, SHARDED))


class Trainer(ParallelTrainerMixin, transformers.Trainer):
    """``transformers.Trainer`` over a model parallelized with ``parallel=dict(dp=, tp=, pp=, ...)`` (or
    ``parallel="auto"``: the planner's choice); see
    ``ParallelTrainerMixin`` and the module docstring (what is replaced, what is refused and why)."""
