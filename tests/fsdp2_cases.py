"""A reference training job on torch's own FSDP2 (``fully_shard``), no qn_hf in it, for tests of DCP
(``torch.distributed.checkpoint``) checkpoints moving between FSDP2 jobs and qn_hf. Runs inside the
test worlds (every rank); ``test_fsdp2_reference.py`` proves it equals the plain model.

The model: ``fully_shard`` on each transformer block (transformers' ``_no_split_modules`` classes, as
accelerate's FSDP2 transformer wrap policy picks them), then on the root, over a 1-D mesh of the whole
world, float32. Each rank's loss is the mean over its own rows (HF's causal-LM loss); with unpadded
equal-length rows every rank holds the same number of targets, so the mean of the ranks' means is the
global batch's mean, and FSDP's default reduction (the ranks' gradients averaged) gives its gradient.
``set_force_sum_reduction_for_comms(True)`` on every FSDP group makes FSDP reduce-scatter with
``ReduceOp.SUM`` and divide by the world size afterwards (``_get_gradient_divide_factors`` in torch
2.13) rather than ask the backend for ``ReduceOp.AVG`` (which torch 2.13's gloo does run; it refuses
``PREMUL_SUM``, what a divide factor other than the world size would take without it).

Checkpoint layouts (``case_fsdp2_train_save``):
  "torch"      ``dcp.save({"model": msd, "optim": osd})`` from ``get_state_dict`` (torch's recipe);
  "flat"       the same with ``StateDictOptions(flatten_optimizer_state_dict=True)`` (torchtitan's);
  "accelerate" accelerate 1.x's FSDP2 SHARDED_STATE_DICT: ``<ckpt>/pytorch_model_fsdp_0`` holding
               ``{"model": get_model_state_dict(model)}`` and ``<ckpt>/optimizer_0`` holding
               ``{"optimizer": get_optimizer_state_dict(model, opt)}``, each through a
               ``FileSystemWriter`` and a ``DefaultSavePlanner`` (``save_fsdp_model``/``save_fsdp_optimizer``).
"""

from __future__ import annotations

import os

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner, DefaultSavePlanner
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_optimizer_state_dict,
    get_state_dict,
    set_model_state_dict,
    set_optimizer_state_dict,
    set_state_dict,
)
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import FSDPModule, fully_shard

from tests.models import dp_slice, load, make_batch

LAYOUTS = ("torch", "flat", "accelerate")
LR = 1e-3
# accelerate's directory names (accelerate.utils.constants FSDP_MODEL_NAME / OPTIMIZER_NAME, index 0)
ACCELERATE_MODEL_DIR = "pytorch_model_fsdp_0"
ACCELERATE_OPTIMIZER_DIR = "optimizer_0"


def blocks(model: torch.nn.Module) -> list[torch.nn.Module]:
    """The transformer blocks: the modules of the classes the model declares unsplittable."""
    names = set(getattr(model, "_no_split_modules", None) or ())
    found = [m for m in model.modules() if type(m).__name__ in names]
    if not found:
        raise ValueError(f"{type(model).__name__}: no module of the classes {sorted(names)}")
    return found


def fsdp2_model(kind: str, model_dir: str) -> torch.nn.Module:
    model = load(kind, model_dir).float()
    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    for block in blocks(model):
        fully_shard(block, mesh=mesh)
    fully_shard(model, mesh=mesh)
    for unit in model.modules():
        if isinstance(unit, FSDPModule):  # per FSDP group, not inherited from the root
            unit.set_force_sum_reduction_for_comms(True)
    return model


def fsdp2_optimizer(model: torch.nn.Module) -> torch.optim.Optimizer:
    return torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=0.01)


def _backward(model: torch.nn.Module, kind: str, seed: int) -> float:
    """Forward and backward on this rank's rows of the global batch qn_hf's checkpoint tests use
    (unpadded); the global batch's mean loss."""
    world, rank = dist.get_world_size(), dist.get_rank()
    batch = dp_slice(make_batch(kind, size=8, seed=seed, padded=False), dp=world, dp_rank=rank)
    model.train()
    loss = model(**batch).loss
    loss.backward()
    total = loss.detach().clone()
    dist.all_reduce(total)  # the sum, then the mean: ReduceOp.AVG is not needed
    return (total / world).item()


def fsdp2_step(model: torch.nn.Module, opt: torch.optim.Optimizer, kind: str, seed: int) -> float:
    """One AdamW step on this rank's rows of the global batch; the global batch's mean loss."""
    opt.zero_grad()
    loss = _backward(model, kind, seed)
    opt.step()
    return loss


def _options(layout: str) -> StateDictOptions | None:
    if layout not in LAYOUTS:
        raise ValueError(f"layout {layout!r}: one of {LAYOUTS}")
    return StateDictOptions(flatten_optimizer_state_dict=True) if layout == "flat" else None


def _save(model: torch.nn.Module, opt: torch.optim.Optimizer, ckpt: str, layout: str) -> None:
    options = _options(layout)
    if layout == "accelerate":
        model_dir, optim_dir = os.path.join(ckpt, ACCELERATE_MODEL_DIR), os.path.join(ckpt, ACCELERATE_OPTIMIZER_DIR)
        for path in (model_dir, optim_dir):
            os.makedirs(path, exist_ok=True)
        dcp.save({"model": get_model_state_dict(model)}, storage_writer=dcp.FileSystemWriter(model_dir),
                 planner=DefaultSavePlanner())
        dcp.save({"optimizer": get_optimizer_state_dict(model, opt)}, storage_writer=dcp.FileSystemWriter(optim_dir),
                 planner=DefaultSavePlanner())
        return
    msd, osd = get_state_dict(model, opt, options=options)
    dcp.save({"model": msd, "optim": osd}, checkpoint_id=ckpt)


def _load(model: torch.nn.Module, opt: torch.optim.Optimizer, ckpt: str, layout: str) -> None:
    options = _options(layout)
    if layout == "accelerate":  # as accelerate's load_fsdp_model / load_fsdp_optimizer
        msd = {"model": get_model_state_dict(model)}
        dcp.load(msd, storage_reader=dcp.FileSystemReader(os.path.join(ckpt, ACCELERATE_MODEL_DIR)),
                 planner=DefaultLoadPlanner())
        set_model_state_dict(model, msd["model"])
        osd = {"optimizer": get_optimizer_state_dict(model, opt)}
        dcp.load(osd, storage_reader=dcp.FileSystemReader(os.path.join(ckpt, ACCELERATE_OPTIMIZER_DIR)),
                 planner=DefaultLoadPlanner())
        set_optimizer_state_dict(model, opt, osd["optimizer"])
        return
    msd, osd = get_state_dict(model, opt, options=options)
    dcp.load({"model": msd, "optim": osd}, checkpoint_id=ckpt)
    set_state_dict(model, opt, model_state_dict=msd, optim_state_dict=osd, options=options)


def write_full(model: torch.nn.Module, kind: str, model_dir: str, out: str) -> None:
    """The whole weights as a HF directory (rank 0 writes; collective)."""
    full = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
    if dist.get_rank() == 0:
        plain = load(kind, model_dir).float()
        plain.load_state_dict(full)
        plain.save_pretrained(out)
    dist.barrier()


def case_fsdp2_train_save(*, kind: str, model_dir: str, ckpt: str, out: str, layout: str = "torch") -> float:
    """Step (seed 1), DCP checkpoint at ``ckpt`` in ``layout``, the weights to ``out + "-step1"``, step
    (seed 2), the weights to ``out``; the second step's loss."""
    model = fsdp2_model(kind, model_dir)
    opt = fsdp2_optimizer(model)
    fsdp2_step(model, opt, kind, seed=1)
    _save(model, opt, ckpt, layout)
    write_full(model, kind, model_dir, out + "-step1")
    loss = fsdp2_step(model, opt, kind, seed=2)
    write_full(model, kind, model_dir, out)
    return loss


def case_fsdp2_load_step(*, kind: str, model_dir: str, ckpt: str, out: str, seed: int = 2,
                         layout: str = "torch") -> float:
    """A fresh FSDP2 model and AdamW loaded from the DCP checkpoint at ``ckpt`` (``layout`` as saved),
    one step (``seed``), the weights to ``out``; the step's loss."""
    model = fsdp2_model(kind, model_dir)
    opt = fsdp2_optimizer(model)
    _load(model, opt, ckpt, layout)
    loss = fsdp2_step(model, opt, kind, seed=seed)
    write_full(model, kind, model_dir, out)
    return loss


def case_fsdp2_grads(*, kind: str, model_dir: str, seed: int = 1) -> dict:
    """One forward and backward: the global loss and, on rank 0, every whole gradient (AdamW's first
    steps hardly depend on the gradients' scale, so the steps alone would not show a wrong mean)."""
    model = fsdp2_model(kind, model_dir)
    loss = _backward(model, kind, seed)
    grads = {n: p.grad.full_tensor() for n, p in model.named_parameters()}  # collective, same order on every rank
    return {"loss": loss, "grads": grads if dist.get_rank() == 0 else None}
