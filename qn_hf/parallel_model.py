"""``ParallelModel``: a sharded Hugging Face model and its training and evaluation steps."""

from __future__ import annotations

import contextlib
import weakref
from collections.abc import Iterable, Iterator, Mapping, Sequence

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh

from .checkpoint.background import DEFAULT_TIMEOUT, BackgroundSaves
from .checkpoint.methods import CheckpointMethods
from .checkpoint.view import CheckpointView
from .config.composition import check_and_warn
from .config.dims import ParallelDims
from .config.features import Feature
from .config.parallel_config import ParallelConfig
from .config.schedule import Schedule
from .context_parallel.apply import AttentionSwitch
from .context_parallel.ring_attention import PieceLayout
from .data_parallel.buckets import GradBuckets
from .data_parallel.grad_sync import GradSync
from .data_parallel.optimizer import ParallelOptimizer, Trainee
from .data_parallel.precision import LossScaler
from .data_parallel.sharded import ShardedParameters
from .failure import FailTogether
from .launch.nodes import Nodes
from .mesh import Coords, Groups
from .peft.lora import Adapter
from .pipeline.runtime import StageExecutor
from .pipeline.stage import StageModules
from .placement import ShardPlacement
from .policies.tp_plan import TpPlan
from .step.batch import dp_rows
from .step.generation import parallel_generate, switched_off
from .step.logits import LogitsFn, collect_logits
from .step.runner import StepContext
from .step.step_loss import LocalLoss, LossFn, StepLoss
from .tensor_parallel.apply import VocabShard
from .tensor_parallel.rng import RngStreams
from .tensor_parallel.sequence_hooks import SequenceParallelSwitch
from .tensor_parallel.shard import ShardSpec


class ParallelModel(CheckpointMethods):
    """This rank's shard of a model, with ``train_step``/``eval_step`` over the whole mesh. The wrapped Hugging Face
    model is ``module``; its parameter names are unchanged, so ``named_parameters()`` yields HF names with local
    shards, ready for any ``torch.optim`` optimizer."""

    def __init__(self, *, context: StepContext, grads: GradSync, rng: RngStreams, scaler: LossScaler | None,
                 deferred: frozenset[str] = frozenset(), adapter: Adapter | None = None,
                 switches: tuple[SequenceParallelSwitch | None, AttentionSwitch | None] = (None, None),
                 sharded: ShardedParameters | None = None, saves: BackgroundSaves | None = None) -> None:
        self.context = context  # what every step reads (step/runner.py)
        # the composition table's features this model uses (composition.py), LoRA included
        self.features = context.config.features | ({Feature.LORA} if adapter is not None else set())
        self._warned: set[frozenset[Feature]] = set()  # the untested pairs a warning has named
        self.adapter = adapter  # the PEFT model ``module`` came from: save_pretrained writes its adapter
        self.grads, self.rng = grads, rng
        precision = context.config.mixed_precision
        self.precision = precision.dtype if precision else None  # the compute dtype (None: the model's own)
        self.scaler = scaler  # float16's loss scale
        self.sp_switch, self.attention_switch = switches  # sp and cp, off while generating
        self.step_loss = StepLoss(context, grads=grads, scaler=scaler, deferred=deferred, sp_switch=self.sp_switch)
        self.deferred = deferred  # names of the parameters whose gradients come in W passes (zb_h1)
        self.optimizer = None  # the qn_hf.optimizer built over this model, if any
        self.failures, self._sync = FailTogether(), True
        # Every step the hosts agree on each replica's batch, shapes and host contents (agreement.py; False: shapes
        # only); the first step also the contents on the device (one all-reduce, one host read; True: every step)
        self.agree_batch_contents, self.check_every_batch, self.closed = True, False, False
        # what its checkpoints read of it (checkpoint/view.py), the save in flight and the roots it saves to with it
        self.checkpoint_view = CheckpointView(
            module=context.module, placement=context.placement, config=context.stage.config, failures=self.failures,
            adapter=adapter, scaler=scaler, cast=precision is not None, virtual_stages=context.stage.plan.virtual,
            ready_method=weakref.WeakMethod(self._weights_ready),
            saves=saves or BackgroundSaves(timeout=DEFAULT_TIMEOUT))
        self.sharded = sharded  # dp_shard > 1: FSDP's groups (data_parallel/sharded.py)

    def _run(self, batch: Mapping[str, torch.Tensor], loss_fn: LossFn | None, *, backward: bool,
             num_items: torch.Tensor | float | None = None, loss_keys: Sequence[str] = ()) -> LocalLoss:
        """The step's loss (step/step_loss.py) under this model's switches: no_sync, the batch checks."""
        return self.step_loss.run(batch, loss_fn, backward=backward, sync=self._sync,
                                  check_every_batch=self.check_every_batch, agree_contents=self.agree_batch_contents,
                                  num_items=num_items, loss_keys=loss_keys)

    # -- what parallelize fixed (step/runner.py's context) ---------------------------------------
    module: nn.Module = property(lambda self: self.context.module)
    parallel_config: ParallelConfig = property(lambda self: self.context.config)  # how it was parallelized
    placement: ShardPlacement = property(lambda self: self.context.placement)
    plan: TpPlan = property(lambda self: self.context.plan)
    stage: StageModules = property(lambda self: self.context.stage)
    executor: StageExecutor = property(lambda self: self.context.executor)
    vocab: VocabShard | None = property(lambda self: self.context.vocab)
    cp_layout: PieceLayout = property(lambda self: self.context.cp_layout)  # which pieces of each sequence cp ranks hold
    microbatches: int = property(lambda self: self.context.config.microbatches)
    schedule: Schedule = property(lambda self: self.context.config.schedule)
    buckets: GradBuckets | None = property(lambda self: self.grads.buckets)

    def close(self) -> None:
        """Release (every rank) the process groups parallelize made: not the world's, not a mesh= given."""
        self._weights_ready()
        view = self.checkpoint_view
        # on the way out, whatever raises: the save's host buffers, then the groups, then the held roots (an
        # ExitStack calls them last added first)
        with contextlib.ExitStack() as after:
            after.callback(view.held_roots.release)
            after.callback(self.placement.groups.release)
            after.callback(view.saves.close)
            self.wait_checkpoint()
        self.closed = True

    # -- where this rank sits (read from the placement) ------------------------------------------
    mesh: DeviceMesh = property(lambda self: self.placement.groups.mesh)
    dims: ParallelDims = property(lambda self: self.placement.dims)
    groups: Groups = property(lambda self: self.placement.groups)
    coords: Coords = property(lambda self: self.placement.coords)  # one per axis, by attribute or as a mapping
    nodes: Nodes = property(lambda self: self.placement.groups.nodes)  # the job's nodes, as every rank agreed
    specs: Mapping[str, ShardSpec | None] = property(lambda self: self.placement.specs)
    device: torch.device = property(lambda self: self.placement.device)

    # -- the torch.nn.Module-like surface users expect -------------------------------------------
    def parameters(self) -> Iterator[nn.Parameter]:
        self._weights_ready()
        return self.module.parameters()

    def named_parameters(self) -> Iterator[tuple[str, nn.Parameter]]:
        self._weights_ready()
        return self.module.named_parameters()

    def named_grads(self) -> Iterator[tuple[str, torch.Tensor]]:
        """Synchronized gradients by HF name: ``.grad``, or under ZeRO the flat pieces this dp rank owns."""
        return self.grads.named_grads()

    grads_split_over_dp: bool = property(lambda self: self.grads.dense_sharded)  # ZeRO-1's pieces over dp x cp
    expert_grads_split: bool = property(  # ... over the expert replicas (ZeRO-1's pieces, or dp_shard's rows)
        lambda self: self.grads.experts_sharded or (self.sharded is not None and self.sharded.experts_sharded))

    def trainee(self) -> Trainee:
        """What ``qn_hf.optimizer`` reads of this model."""
        return Trainee(module=self.module, grads=self.grads, placement=self.placement, precision=self.precision,
                       scaler=self.scaler, fsdp_masters=self.sharded is not None,
                       check_zero=lambda: self.check_composes_with(Feature.ZERO))

    def _weights_ready(self) -> None:
        """ZeRO-1 gathers the updated weights asynchronously after a step: wait for all of them."""
        if self.closed:
            raise ValueError("this ParallelModel was closed (pm.close() released its process groups); parallelize a "
                             "fresh copy of the model")
        self.grads.wait_weights()

    def train(self, mode: bool = True) -> ParallelModel:
        self.module.train(mode)
        return self

    def eval(self) -> ParallelModel:
        return self.train(False)

    def __call__(self, **inputs: torch.Tensor):
        """The HF forward on this rank's shard (vocab-parallel logits stay sharded; see ``full_logits``).
        With pipeline stages a forward spans ranks: use ``train_step``/``eval_step``."""
        self._weights_ready()
        if self.stage.stages > 1:
            raise ValueError(f"a forward call needs the whole pipeline (pp={self.stage.stages}); use eval_step or train_step")
        return self.module(**inputs, **self.plan.policy.forward_kwargs)

    def full_logits(self, logits: torch.Tensor) -> torch.Tensor:
        """All vocabulary columns from vocab-sharded logits (autograd-aware; padding removed)."""
        return self.context.full_logits(logits)

    # -- steps -----------------------------------------------------------------------------------
    def train_step(self, batch: Mapping[str, torch.Tensor], loss_fn: LossFn | None = None, *,
                   num_items_in_batch: torch.Tensor | int | None = None, loss_keys: Sequence[str] = ()) -> torch.Tensor:
        """Forward and backward over every microbatch in training mode, then every gradient sum; gradients
        accumulate into ``.grad`` (zero them between steps), except inside ``no_sync()`` unsynchronized.
        Returns the mean loss over the global batch, detached, identical on every rank. Accumulating,
        ``num_items_in_batch=pm.count_items(batches)`` (transformers' name) divides by every batch's count:
        the gradients equal one step on all the batches, whose loss the returned ones sum to. ``loss_keys``: batch
        keys only ``loss_fn`` reads (a preference pair's margin), never given to the model's forward."""
        self.module.train()
        if self.closed:
            self._weights_ready()  # raises: the groups are gone
        if self.precision is not None and self.optimizer is None and self.sharded is None:
            raise ValueError(
                f"mixed_precision keeps float32 gradients for the float32 master weights of qn_hf.optimizer: build the "
                f"optimizer with qn_hf.optimizer(pm, torch.optim.AdamW, ...) before train_step (a torch optimizer over "
                f"pm.parameters() would step the {self.precision} weights themselves)")
        if self.grads.reduced:
            raise ValueError("zero=True reduce-scatters gradients in place: call optimizer.zero_grad() after each "
                             "optimizer.step() (accumulate over several train_step calls inside pm.no_sync())")
        if self.sharded is not None:
            self.sharded.start_backward(sync=self._sync)
        with self.failures.guard("train_step"):
            local = self._run(batch, loss_fn, backward=True, num_items=num_items_in_batch, loss_keys=loss_keys)
            if self.sharded is not None:  # under a pipeline: one reduction after the step's last backward
                self.sharded.finish_backward(sync=self._sync)
            if self._sync:
                self.grads.sync()
            # the loss's sums come after the gradients' on the same groups: a rank whose backward left a
            # parameter without a gradient (a branch its rows never took) starts its buckets only in
            # sync(), and every rank must issue the same collectives in the same order
            return self.step_loss.reduced(local)

    def count_items(self, batches: Sequence[Mapping[str, torch.Tensor]], loss_fn: LossFn | None = None) -> torch.Tensor:
        """What one step on all of this dp rank's ``batches`` would average its loss over, summed over dp
        (targets, or rows with a ``loss_fn``; question answering: its starts and its ends): a ``[K]`` device
        tensor for ``train_step(num_items_in_batch=)``."""
        return self.step_loss.count_items(batches, loss_fn)

    @contextlib.contextmanager
    def no_sync(self) -> Iterator[None]:
        """Accumulate gradients over several ``train_step`` calls unsynchronized, as DDP's ``no_sync``: the
        first ``train_step`` after the block syncs it all (the loss still takes two scalar all-reduces)."""
        previous, self._sync = self._sync, False
        try:
            yield
        finally:
            self._sync = previous

    @torch.no_grad()
    def eval_step(self, batch: Mapping[str, torch.Tensor], loss_fn: LossFn | None = None, *,
                  loss_keys: Sequence[str] = ()) -> torch.Tensor:
        """Forward only, in evaluation mode (restored afterwards); the same loss as ``train_step``."""
        with self._forward_only("eval_step"):
            return self.step_loss.reduced(self._run(batch, loss_fn, backward=False, loss_keys=loss_keys))

    @contextlib.contextmanager
    def _forward_only(self, what: str, *, evaluate: bool = True) -> Iterator[None]:
        was_training = self.module.training
        self._weights_ready()
        self.module.train(was_training and not evaluate)
        try:
            with self.failures.guard(what):
                yield
        finally:
            self.module.train(was_training)
            if self.sharded is not None:  # FSDP keeps its root gathered for a backward that never comes
                self.sharded.reshard()

    def local_batch(self, batch: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """This dp replica's contiguous rows of a *global* batch (the same dict on every rank), padded
        first, if ``dp * microbatches`` does not divide it, with rows that carry no loss (``batch.dp_rows``)."""
        return dp_rows(batch, dp=self.dims.dp, dp_rank=self.coords.dp, multiple=self.microbatches,
                       config=self.module.config)

    @torch.no_grad()
    def logits(self, batch: Mapping[str, torch.Tensor], *, reduce: LogitsFn | None = None,
               broadcast: bool = True) -> torch.Tensor | None:
        """This dp rank's batch's whole logits at any mesh (or ``reduce(logits, microbatch)`` of each
        microbatch's), on every rank of the replica (``broadcast=False``: the last stage's only; None
        elsewhere). Evaluation mode, restored afterwards; logits.py says how."""
        with self._forward_only("logits"):
            return collect_logits(self.context, batch, reduce=reduce, broadcast=broadcast)

    # the whole model's HF config (a stage's modules may hold a cut copy) and generate's defaults, as on the plain
    # model, so code written for a PreTrainedModel reads them unchanged; how it was parallelized: parallel_config
    config = property(lambda self: self.stage.config)
    generation_config = property(lambda self: self.module.generation_config)

    def __getattr__(self, name: str):  # reached only for what ParallelModel lacks
        context = self.__dict__.get("context")
        known = context is not None and not name.startswith("__") and hasattr(context.module, name)
        raise AttributeError(context.placement.surface_refusal(name) if known else
                             f"'ParallelModel' object has no attribute {name!r}")

    def check_composes_with(self, *features: Feature) -> None:
        """The composition table's refusal of ``features`` with this model's, or its warning (rank 0, once)."""
        values = self.parallel_config.values(model_type=self.config.model_type) if self.parallel_config else {}
        check_and_warn(self.features | set(features), values, warned=self._warned,
                       rank=dist.get_rank() if dist.is_initialized() else 0)

    def generate(self, input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None, **generate_kwargs):
        """HF's ``generate``, equal to the plain model's; every rank of a dp replica passes the same
        inputs. KV cache at pp=1; at pp>1 each token re-runs the pipeline without one (generation.py)."""
        self.check_composes_with(Feature.GENERATE)  # in the mode the caller set, as HF's generate
        with self._forward_only("generate", evaluate=False), switched_off(self.sp_switch, self.attention_switch):
            return parallel_generate(self.module, input_ids, attention_mask, stage=self.stage, placement=self.placement,
                                     full_logits=self.full_logits if self.vocab is not None else None,
                                     generate_kwargs=generate_kwargs)


def optimizer(pm: ParallelModel, optimizer_class: type, *, zero: bool = False, param_groups: Iterable[dict] | None = None,
              skip_nonfinite: bool = False, **kwargs) -> ParallelOptimizer:
    """A torch optimizer over ``pm``'s trainable parameters (or ``param_groups`` of them, as a torch optimizer's first
    argument takes them), holding float32 master weights under ``mixed_precision``; ``zero=True`` keeps only this dp
    rank's 1/dp of the masters and state (ZeRO-1). ``skip_nonfinite=True`` skips (on every rank) a step whose gradients
    hold inf or NaN anywhere in the job, as float16's loss scaling does, counting it in ``skipped_steps``; it costs one
    small all-reduce and one host read per step. ``kwargs`` go to ``optimizer_class`` (``lr=``, ...)."""
    if pm.optimizer is not None:
        raise ValueError("this ParallelModel already has a qn_hf.optimizer; build one optimizer per model")
    pm.optimizer = ParallelOptimizer(pm.trainee(), optimizer_class, zero=zero, param_groups=param_groups,
                                     skip_nonfinite=skip_nonfinite, **kwargs)
    return pm.optimizer
