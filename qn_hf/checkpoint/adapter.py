"""A PEFT model's adapter directory, written from the sharded model.

The adapter is small (LoRA's A and B per target), so it is assembled whole on rank 0: within each
stage the tp ranks of dp replica 0 gather every adapter tensor (the ep group, every rank of it, the
factors of LoRA on experts); the stage's tp rank 0 lets peft pick
and name the adapter's entries from that state dict (``get_peft_model_state_dict``, which finds
them by walking the LoRA layers, so each stage must do it on its own layers) and hands them to rank
0, which writes ``adapter_model.safetensors`` and ``adapter_config.json`` as
``PeftModel.save_pretrained`` does. Each file is written beside its final name, as a new file or in a
new directory (never through a link left there), and renamed into place, so a crash never leaves a
half-written file.
"""

from __future__ import annotations

import os

import torch
import torch.distributed as dist
from safetensors.torch import save
from torch import nn

from ..comm import barrier
from ..data_parallel.sharded import model_class
from ..peft.lora import Adapter
from ..placement import ShardPlacement
from ..tensor_parallel.shard import over_experts
from .atomic import fresh_dir, write_bytes_atomic
from .export import unique_state

# The HF model inside a PEFT model: PeftModel.base_model (the tuner) .model (the HF model).
_PEFT_PREFIX = "base_model.model."
ADAPTER_WEIGHTS = "adapter_model.safetensors"
ADAPTER_CONFIG = "adapter_config.json"


def _adapter_names(state: dict[str, torch.Tensor], adapter: Adapter) -> list[str]:
    """A superset of what peft keeps: LoRA tensors, and biases when the config trains them."""
    bias = getattr(adapter.peft_model.peft_config[adapter.name], "bias", "none")
    return [n for n in state if "lora_" in n or (bias != "none" and n.endswith(".bias"))]


def save_adapter(module: nn.Module, path: str, *, placement: ShardPlacement, adapter: Adapter) -> None:
    """Every rank calls this; rank 0 writes ``path`` (a subdirectory named after a non-default
    adapter, as peft does)."""
    from peft import get_peft_model_state_dict

    coords = placement.coords
    state = {n: t.detach() for n, t in unique_state(module).items() if not placement.is_follower(n)}
    names = _adapter_names(state, adapter)  # the same order on every rank of the stage
    # LoRA factors of experts (ep) are gathered over the ep group, which spans dp x tp: every rank
    # takes part; the rest over tp, by the ranks of dp (x cp) replica 0 only
    experts = [n for n in names if over_experts(placement.spec(n))]
    whole = {n: placement.whole(n, state[n]) for n in experts}
    full: dict[str, torch.Tensor] = {}
    if placement.replica_rank == 0:
        for name in names:
            tensor = whole[name] if name in whole else placement.whole(name, state[name])
            full[_PEFT_PREFIX + name] = tensor.cpu().contiguous()
    mine: dict[str, torch.Tensor] = {}
    if placement.replica_rank == 0 and coords.tp == 0:
        mine = get_peft_model_state_dict(adapter.peft_model, state_dict=full, adapter_name=adapter.name,
                                         save_embedding_layers=False)
    parts: list[dict[str, torch.Tensor]] | None = [{} for _ in range(dist.get_world_size())] if dist.get_rank() == 0 else None
    dist.gather_object(mine, parts, dst=0)
    if dist.get_rank() == 0:
        _write(path, adapter, {n: t for part in parts for n, t in part.items()})
    barrier(placement.device)


def _write(path: str, adapter: Adapter, state: dict[str, torch.Tensor]) -> None:
    target = path if adapter.name == "default" else os.path.join(path, adapter.name)
    os.makedirs(target, exist_ok=True)
    # in memory at once: an adapter is small (LoRA's A and B)
    write_bytes_atomic(os.path.join(target, ADAPTER_WEIGHTS), save(state, metadata={"format": "pt"}))
    config = adapter.peft_model.peft_config[adapter.name]
    # What PeftModel.save_pretrained writes, field for field: the base model's path when none is set
    # (peft keeps it on the config), and without a task type the base class, which
    # AutoPeftModelForCausalLM needs to know what to build.
    base = adapter.peft_model.base_model.model
    if config.base_model_name_or_path is None:
        config.base_model_name_or_path = base.__dict__.get("name_or_path", None) or None
    auto_mapping = None
    if config.task_type is None:
        cls = model_class(base)  # at dp_shard, the class under FSDP's wrapper
        auto_mapping = {"base_model_class": cls.__name__, "parent_library": cls.__module__}
    training, config.inference_mode = config.inference_mode, True  # as PeftModel.save_pretrained saves it
    try:
        staging = os.path.join(target, ".adapter_config.tmp")
        fresh_dir(staging)
        config.save_pretrained(staging, auto_mapping_dict=auto_mapping)
        os.replace(os.path.join(staging, ADAPTER_CONFIG), os.path.join(target, ADAPTER_CONFIG))
        os.rmdir(staging)
    finally:
        config.inference_mode = training
