"""Activation recomputation, through transformers' own per-block checkpointing hook.

Every decoder/encoder block of a transformers 5 model is a ``GradientCheckpointingLayer``: when its
``gradient_checkpointing`` flag is set (in training), its forward runs through the block's
``_gradient_checkpointing_func``. qn_hf sets that function per block of this stage, so no forward is
replaced:

* ``"full"``: torch's non-reentrant checkpoint; only the block's inputs are kept, everything inside
  is recomputed in backward (tensor-parallel collectives inside the block included).
* ``"selective"``: the same, with a policy that keeps the outputs of matrix products (linear layers,
  ``bmm``/``mm`` of eager attention, fused attention kernels) and of the tensor-parallel collectives
  (the all-reduces, and under sequence parallelism the all-gathers and reduce-scatters, inside a
  block), and recomputes the cheap elementwise parts: norms, activations, softmax, dropout. So the
  recomputation does no communication: comm.py's collectives are functional (a new output tensor,
  which the cache can hand back; the output of an in-place collective could not be, the recomputed
  buffer would stay unreduced). Each kept collective output is one more activation per layer (under
  sequence parallelism an entry's gathered input is the whole sequence).

Dropout masks replay exactly: torch's checkpoint restores the default generator for the
recomputation, and qn_hf's other random streams (rng.py) are rewound to where they stood when the
block first ran, then put back, so the results equal the run without recomputation bit for bit.
"""

from __future__ import annotations

import contextlib
import functools

import torch
from torch import nn
from torch.utils.checkpoint import CheckpointPolicy, checkpoint, create_selective_checkpoint_contexts
from transformers.modeling_layers import GradientCheckpointingLayer

from ..arguments import check_choice
from ..config.options import Recompute
from ..tensor_parallel.rng import RngStreams
from .offload import ActivationOffload

_aten = torch.ops.aten
# What selective recomputation keeps: the products that cost FLOPs.
SAVED_OPS = {_aten.mm.default, _aten.addmm.default, _aten.bmm.default, _aten.baddbmm.default,
             _aten._scaled_dot_product_flash_attention_for_cpu.default,
             _aten._scaled_dot_product_flash_attention.default, _aten._scaled_dot_product_efficient_attention.default,
             _aten._scaled_dot_product_cudnn_attention.default, _aten.convolution.default}
_functional = torch.ops._c10d_functional
# ... and the collectives that cost communication (comm.py's, out of place).
SAVED_COLLECTIVES = {_functional.all_reduce.default, _functional.all_gather_into_tensor.default,
                     _functional.reduce_scatter_tensor.default}


def check_recompute(model: nn.Module, *, recompute: str | None, layers: str | None) -> None:
    """``recompute`` is None or a known mode, and every block of ``model``'s ``layers`` list can
    take it (raised before any collective)."""
    if recompute is None:
        return
    check_choice("recompute", recompute, Recompute.values())
    if layers is None:
        raise ValueError(f"recompute={recompute!r}: {type(model).__name__} has no list of blocks qn_hf found to "
                         f"recompute; use recompute=None")
    for block in model.get_submodule(layers):
        if not isinstance(block, GradientCheckpointingLayer):
            raise ValueError(f"recompute={recompute!r}: {type(block).__name__} (in {layers}) is not a transformers "
                             f"GradientCheckpointingLayer, so its forward cannot be recomputed without replacing it; "
                             f"use recompute=None")


def apply_recompute(model: nn.Module, *, recompute: str, layers: str, rng: RngStreams,
                    offload: ActivationOffload | None = None) -> int:
    """Turn recomputation on for every block of ``layers`` held on this stage (what each keeps held on the
    host by ``offload``, when given: offload.py); return how many."""
    count = 0
    for block in model.get_submodule(layers):
        if isinstance(block, GradientCheckpointingLayer):  # not another stage's stand-in
            block.gradient_checkpointing = True
            block._gradient_checkpointing_func = functools.partial(_recompute_block, rng=rng, recompute=recompute,
                                                                   offload=offload)
            count += 1
    return count


def selective_policy(ctx, op, *args, **kwargs) -> CheckpointPolicy:
    # tp collectives run inside autograd Functions' forwards (no grad mode) and are kept all the same:
    # the recomputation needs their outputs, and would otherwise communicate to get them again.
    if op in SAVED_COLLECTIVES:
        return CheckpointPolicy.MUST_SAVE
    # Products inside an autograd Function's forward (ring attention's blocks) run without grad mode:
    # autograd never reads them, the Function saves what its own backward needs.
    if op in SAVED_OPS and torch.is_grad_enabled():
        return CheckpointPolicy.MUST_SAVE
    return CheckpointPolicy.PREFER_RECOMPUTE


def checkpoint_options(recompute: Recompute | str) -> dict:
    """torch's ``checkpoint`` arguments for a mode (the planner's trace checkpoints with them too)."""
    options: dict = {"use_reentrant": False}
    if recompute == Recompute.SELECTIVE:
        options["context_fn"] = functools.partial(create_selective_checkpoint_contexts, selective_policy)
    return options


def _recompute_block(function, *args, rng: RngStreams, recompute: str, offload: ActivationOffload | None):
    """torch's checkpoint of ``function``; the recomputation runs with qn_hf's streams rewound. What the
    checkpoint keeps goes through ``offload``'s hooks (the block's inputs; its recomputation's are its own)."""
    first = rng.snapshot()
    calls = 0

    def run(*inputs):
        nonlocal calls
        calls += 1
        if calls == 1:
            return function(*inputs)
        now = rng.snapshot()
        rng.restore(first)
        try:
            return function(*inputs)
        finally:  # the recomputation may stop early (torch stops once it has what backward needs)
            rng.restore(now)

    with offload.hooks() if offload is not None else contextlib.nullcontext():
        return checkpoint(run, *args, preserve_rng_state=True, **checkpoint_options(recompute))
