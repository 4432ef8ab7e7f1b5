"""Sharded data parallelism (``dp_shard`` > 1): weights, gradients and optimizer state sharded over
groups of ``dp_shard`` dp ranks (ZeRO-3 / FSDP), gradients all-reduced across the groups (hybrid
sharding), with torch's own ``fully_shard`` (FSDP2) doing all of it.

``fully_shard`` serves as it is: it keeps the module tree and the parameter names (each parameter
becomes a DTensor sharded on dim 0 over the dp_shard ranks, so ``pm.named_parameters()`` stays HF's),
all-gathers a block's weights before its forward and backward and reduce-scatters its gradients
after, prefetching the next block's all-gather, and it takes whatever qn_hf's tensor parallelism left
on the module as plain tensors (the local tp shard, sharded again over dp_shard). What qn_hf sets:

* one FSDP group per block (``stage_plan.layers``) and one for the rest (the root: embeddings, final
  norm, head), so a few blocks' weights are whole at a time besides the root's: the one running and
  the next, prefetched (its all-gather issued before the running block's compute, in forward and in
  backward; each block's reduce-scatter issued as its backward ends, before the previous block's
  backward), and in forward the running block's all-gather output, which FSDP keeps a while;
* gradients summed, not averaged: qn_hf's loss is already each rank's share of the global mean (its
  targets over the global count, ``step/step_loss.py``), as the dp buckets sum it. FSDP's default
  divides by the data-parallel size, and a divide factor of 1 reduces with a pre-multiplied sum that
  gloo lacks, so the sum is forced (``set_force_sum_reduction_for_comms``);
* every parameter of a block has a gradient when FSDP reduce-scatters the block's: FSDP2 sends only the
  gradients that exist, so where a rank's rows leave a parameter unused and another rank's do not (a MoE whose
  tokens on one rank all go to LongCat's identity experts, leaving the expert weights without a gradient),
  the ranks' reduce-scatters would differ in size (gloo aborts; NCCL would hang or mix tensors). A block that
  routes tokens to experts (``routes_tokens``) has its inputs pass through ``_GradientsForEveryWeight``, whose backward runs just before FSDP's own (which wraps
  the same inputs first) and gives every weight of the block still without one a zero gradient, as the dp
  buckets send zeros for an unused parameter (``grad_sync``);
* under mixed precision FSDP's own policy: the sharded parameters stay float32 (they are the master
  weights, so ``qn_hf.optimizer`` keeps no copy), all-gathered in the compute dtype, gradients
  reduce-scattered in float32 — the memory the issue asks for (16/S bytes per parameter for AdamW).

Under a pipeline (pp > 1) a stage runs many microbatches' forwards and backwards in one step, each
its own autograd call, and earlier chunks run the base model alone (no head). So:

* the root group stays the task model's (embeddings, final norm, head, a tie inside the stage), and
  every chunk's forward enters through the task model, so FSDP's root hooks gather it first: an
  earlier chunk, which runs the base model alone without FSDP, takes the base model's (or its last
  block's) output from there (``StageModules.enter_at_top``);
* gradients are reduced once per step, not per microbatch: during the step FSDP only accumulates
  them whole (``set_requires_gradient_sync(False)``, weights kept gathered after backward), and
  after the schedule's last backward and weight pass ``finish_backward`` runs FSDP's post-backward
  for every group, as torch's own pipelining does (``PipelineStage.perform_reduce_grad``); ZB-H1's
  deferred weight gradients land in the gathered weights before that;
* ``Gather.STEP`` (the default, torchtitan's under pp) keeps a stage's weights gathered from the
  first microbatch's forward to the end of the step: one all-gather per group per step, and the whole
  stage's weights in memory meanwhile; ``Gather.MICROBATCH`` frees a block's weights after each
  forward and each backward and gathers them again for the next: at most the blocks in flight
  gathered, two all-gathers per block and microbatch (not with ZB-H1, whose weight passes need the
  weights after later forwards). Either way the gradients accumulate whole until the step's end.
  The experts' own groups (under ep) follow the blocks' gather mode.
"""

from __future__ import annotations

import functools

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import FSDPModule, MixedPrecisionPolicy, fully_shard
from torch.distributed.tensor import DTensor, distribute_tensor

from ..config.options import Gather
from ..expert_parallel.apply import EXPERTS_MODULE
from ..policies.packed_inputs import item_towers
from .fsdp_internals import fsdp_root


class ShardedParameters:
    """The FSDP groups of one rank's model: applied once, then gradient sync switched per step."""

    def __init__(self, model: nn.Module, *, mesh: DeviceMesh, blocks: list[nn.Module],
                 compute_dtype: torch.dtype | None, experts: list[nn.Module] = (),
                 expert_mesh: DeviceMesh | None = None, pipelined: bool = False,
                 gather: Gather = Gather.STEP) -> None:
        """``experts``: the modules expert parallelism sharded over ep. Their weights differ between ep
        ranks, so they get groups of their own over ``expert_mesh`` (the ranks holding the same experts,
        as their gradients are summed today), first, before the blocks that hold them; without such
        ranks (each expert block held once) FSDP leaves them alone. ``pipelined``: the model is a
        pipeline stage; ``gather``: how often its blocks are gathered in a step."""
        policy = MixedPrecisionPolicy(param_dtype=compute_dtype, reduce_dtype=torch.float32 if compute_dtype else None)
        ignored = set(kept_whole(model))
        if expert_mesh is not None:
            for module in experts:
                fully_shard(module, mesh=expert_mesh, mp_policy=policy, ignored_params=ignored or None)
        elif experts:
            ignored |= {p for module in experts for p in module.parameters()}
        ignored = ignored or None
        for block in blocks:
            fully_shard(block, mesh=mesh, mp_policy=policy, ignored_params=ignored)
            if routes_tokens(block):
                # after FSDP's own pre-forward hook (prepended), so its backward runs before FSDP's reduce-scatter
                block.register_forward_pre_hook(_zero_gradients_for_unused_weights, with_kwargs=True)
        fully_shard(model, mesh=mesh, mp_policy=policy, ignored_params=ignored)
        towers = item_towers(model)  # left to the root group by repeated_blocks
        if towers:
            # after FSDP's root pre-forward hook (prepended), which has gathered the towers' weights
            model.register_forward_pre_hook(functools.partial(_zero_gradients_for_towers, towers))
        self.root = fsdp_root(model)  # FSDP's private state, for what no public call does
        self.pipelined, self.gather = pipelined, gather
        if not pipelined:
            # Explicit forward prefetch: each group's pre-forward issues the next block's all-gather before
            # its own compute is issued (on GPU it runs on FSDP's all-gather stream meanwhile). FSDP's own
            # forward order issues it only at the next block's pre-forward, leaving the overlap to the CPU
            # running ahead of the GPU. The price: FSDP keeps a forward all-gather's output until the next
            # copy-out, so three blocks' weights are whole at once in forward, not two (the planner counts
            # it). Backward prefetches one block ahead by default. Under a pipeline a chunk's next block
            # may run in another chunk, so the default stays (and "step" gathers once anyway).
            for unit, following in zip([model, *blocks], blocks):
                unit.set_modules_to_forward_prefetch([following])
        if pipelined:
            # FSDP finds the groups under its root at the root's first forward; with several chunks per
            # rank that forward runs in one chunk's view, which hides the other chunks' blocks (they
            # would each become a root of their own, left out of the step's reduction). Now the model
            # holds all of this rank's blocks. No public call does it: FSDP's own state method.
            self.root.find_groups()
        # what a pipeline's gather mode governs: the blocks, and the experts' own groups inside them
        self.blocks = [*blocks, *(experts if expert_mesh is not None else ())]
        self.model = model
        self.mesh = mesh
        self.experts_sharded = bool(experts) and expert_mesh is not None
        self.units: list[FSDPModule] = [m for m in model.modules() if isinstance(m, FSDPModule)]
        for unit in self.units:  # every group: the factor is per group, not inherited from the root
            unit.set_gradient_divide_factor(1.0)
            unit.set_force_sum_reduction_for_comms(True)

    def reshard(self) -> None:
        """After a forward-only pass (evaluation, logits): FSDP leaves the root's weights gathered
        after its forward, for the backward that would follow; free them, so that parameters are the
        sharded DTensors again (a checkpoint reads the shards)."""
        for unit in self.units:
            unit.reshard()

    def set_gradient_sync(self, sync: bool) -> None:
        """Inside ``pm.no_sync()``: keep the whole gradients and reduce them at the next synced step."""
        for unit in self.units:
            unit.set_requires_gradient_sync(sync, recurse=False)

    def start_backward(self, *, sync: bool) -> None:
        """Before a training step's schedule. Without a pipeline FSDP's hooks reduce each group's
        gradients as backward leaves it (``sync``); under one, nothing is reduced or freed until
        ``finish_backward``, and with ``Gather.STEP`` the blocks stay gathered after their forwards."""
        if not self.pipelined:
            self.set_gradient_sync(sync)
            return
        per_microbatch = self.gather is Gather.MICROBATCH
        for unit in self.units:
            unit.set_requires_gradient_sync(False, recurse=False)
            unit.set_reshard_after_backward(False, recurse=False)
        for block in self.blocks:
            block.set_reshard_after_forward(per_microbatch, recurse=False)
            block.set_reshard_after_backward(per_microbatch, recurse=False)
        self.model.set_is_last_backward(False)

    def finish_backward(self, *, sync: bool) -> None:
        """After the schedule's last backward and weight pass (pipeline only): every group's
        post-backward, once, reducing the gradients accumulated over the step's microbatches (or,
        inside ``no_sync``, keeping them whole) and freeing the gathered weights. FSDP has no public
        call for it; torch's pipelining calls the same (``PipelineStage.perform_reduce_grad``)."""
        if not self.pipelined:
            return
        for unit in self.units:
            unit.set_requires_gradient_sync(sync, recurse=False)
            unit.set_reshard_after_backward(True, recurse=False)
        for block in self.blocks:
            block.set_reshard_after_forward(True, recurse=False)  # evaluation frees each block again
        self.model.set_is_last_backward(True)
        self.root.post_backward()


class _GradientsForEveryWeight(torch.autograd.Function):
    """The identity on a block's inputs; its backward gives each weight of the block without a gradient a
    zero one (module docstring: FSDP reduce-scatters only the gradients that exist)."""

    @staticmethod
    def forward(ctx, block: nn.Module, *inputs: torch.Tensor):
        ctx.block = block
        return tuple(x.view_as(x) for x in inputs)

    @staticmethod
    def backward(ctx, *grads: torch.Tensor):
        # the block's weight gradients are accumulated by now: autograd runs a ready AccumulateGrad before any
        # other node, and the gradients of the inputs come after the whole block's backward
        for p in ctx.block.parameters():
            if p.requires_grad and p.grad is None:
                p.grad = torch.zeros_like(p)
        return (None, *grads)


def routes_tokens(block: nn.Module) -> bool:
    """Whether ``block`` holds an experts module (transformers' name for an MoE layer's routed experts): where a
    rank's rows decide which weights run. Other blocks run every weight on any rows, so they need no zeros, and
    their compiled graphs stay whole (the zeros' side effect in backward would break a compiled block's graph)."""
    return any(name.rpartition(".")[2] == EXPERTS_MODULE for name, _ in block.named_modules())


def _zero_gradients_for_unused_weights(block: nn.Module, args: tuple, kwargs: dict):
    """Forward pre-hook: the block's inputs that carry a gradient pass through ``_GradientsForEveryWeight``
    (one call, so that its backward runs once, after every input's gradient is in)."""
    if not torch.is_grad_enabled():
        return None
    flat = [*args, *kwargs.values()]
    carried = [i for i, x in enumerate(flat) if isinstance(x, torch.Tensor) and x.requires_grad]
    if not carried:
        return None
    passed = iter(_GradientsForEveryWeight.apply(block, *(flat[i] for i in carried)))
    flat = [next(passed) if i in set(carried) else x for i, x in enumerate(flat)]
    return tuple(flat[: len(args)]), dict(zip(kwargs, flat[len(args):]))


def _zero_gradients_for_towers(towers: list[nn.Module], model: nn.Module, args: tuple) -> None:
    """Forward pre-hook of the root: each trainable weight of the towers a batch's packed items run through
    (Qwen2-VL's ``visual``) gets a zero gradient where it has none, before the forward runs the towers or not.
    FSDP2 reduce-scatters the gradients of a group that exist: a rank whose rows hold no image would leave the
    towers' out, and the ranks' reductions would no longer pair up. A rank that runs a tower adds its gradients
    to the zeros, exactly. The towers sit in the root group, gathered for the whole step whatever runs, not in
    groups of their own, gathered at each call (a rank would call them a different number of times). torch 2.13's
    ``FSDPModule.set_reduce_scatter_unused_params`` does the same inside FSDP; torch 2.11, which qn_hf supports,
    has no such call, so this hook serves every release alike."""
    if not torch.is_grad_enabled():
        return
    for tower in towers:
        for p in tower.parameters():  # the gathered weights, which FSDP has put in the modules now
            if p.requires_grad and p.grad is None:
                p.grad = torch.zeros_like(p)


def model_class(module: nn.Module) -> type:
    """The class the user built: ``fully_shard`` swaps a module's class for a generated subclass
    (``FSDP<Name>``, defined in torch's own module), which records such as peft's ``base_model_class``
    must not name (a loader would look for it in ``torch.distributed``)."""
    return next(c for c in type(module).__mro__ if not issubclass(c, FSDPModule))


def kept_whole(model: nn.Module) -> list[nn.Parameter]:
    """The parameters FSDP2 cannot shard, kept whole on every rank (plain tensors beside the DTensors) and
    left out of every ``fully_shard`` group; their gradients are summed over dp x cp by qn_hf's own buckets
    (``grad_sync.grad_buckets``): scalars (CLIP's and SigLIP's ``logit_scale``), which ``fully_shard``
    refuses ("change it to a 1D tensor": the model is the user's, so qn_hf does not reshape it), and
    parameters of no elements (DINOv3's register tokens at num_register_tokens=0), whose empty gradient
    its reduce-scatter cannot pack."""
    return [p for p in model.parameters() if p.dim() == 0 or p.numel() == 0]


def local(tensor: torch.Tensor) -> torch.Tensor:
    """This rank's part of a sharded tensor (a view: in-place changes reach the DTensor), or the
    tensor itself."""
    return tensor.to_local() if isinstance(tensor, DTensor) else tensor


@torch.no_grad()
def gathered_state(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """``state`` (a ``state_dict(keep_vars=True)``, whose tied entries are one object) with every
    dp_shard-sharded tensor gathered whole, tied entries still one object. Collective over the
    dp_shard ranks, one tensor at a time, in the state's order (the same on every rank). FSDP's
    own ``unshard`` does not serve here: its state-dict hook hands out the sharded parameters."""
    whole: dict[int, torch.Tensor] = {}
    for tensor in state.values():
        if id(tensor) not in whole:
            whole[id(tensor)] = tensor.detach().full_tensor() if isinstance(tensor, DTensor) else tensor
    return {name: whole[id(tensor)] for name, tensor in state.items()}


def row_range(tensor: torch.Tensor) -> tuple[int, int] | None:
    """For a dp_shard-sharded tensor: the first of this rank's rows along dim 0 and how many it holds
    (torch.chunk's split, which FSDP's Shard(0) follows: ceil(n / S) rows per rank, the last ranks
    fewer or none); None for a tensor held whole. Its rows are a flat range of the whole tensor,
    which is how the checkpoint writes them (as it writes ZeRO-1's pieces)."""
    if not isinstance(tensor, DTensor):
        return None
    mesh, n = tensor.device_mesh, tensor.shape[0]
    size, rank = mesh.size(mesh.ndim - 1), mesh.get_local_rank(mesh.ndim - 1)
    per = -(-n // size)
    first = min(rank * per, n)
    rows = tensor.to_local().shape[0]
    if rows != min(per, n - first):
        raise RuntimeError(f"a dp_shard shard of {rows} rows where torch.chunk gives {min(per, n - first)} of {n}")
    return first, rows


def sharded_like(value: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    """``value`` (whole, on every rank) as ``like`` holds it: this rank's rows of it as a DTensor
    when ``like`` is dp_shard-sharded (no transfer: every rank has the value), else as it is."""
    if not isinstance(like, DTensor):
        return value
    return distribute_tensor(value.to(like.device), like.device_mesh, like.placements, src_data_rank=None)
