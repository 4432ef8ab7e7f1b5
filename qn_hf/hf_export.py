"""Consolidating a ParallelModel into a Hugging Face directory.

Only the tp group of dp rank 0 gathers (dp replicas are identical); global rank 0 writes. Each tensor
is gathered on its own, so ranks other than rank 0 never hold more than one full tensor.
"""

from __future__ import annotations

import os
import tempfile
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist
from safetensors.torch import save_file

from .comm import all_gather_tensors, barrier

if TYPE_CHECKING:
    from .parallel_model import ParallelModel


def unique_state(module: torch.nn.Module) -> dict[str, torch.Tensor]:
    """The state dict with tied tensors kept once, under their first name (as HF saves them)."""
    seen: set[int] = set()
    out: dict[str, torch.Tensor] = {}
    for name, tensor in module.state_dict(keep_vars=True).items():
        if id(tensor) not in seen:
            seen.add(id(tensor))
            out[name] = tensor
    return out


def save_pretrained(pm: ParallelModel, path: str) -> None:
    if pm.coords["dp"] == 0:
        full: dict[str, torch.Tensor] = {}
        for name, tensor in unique_state(pm.module).items():
            spec = pm.specs.get(name)
            value = tensor.detach()
            if spec is not None:
                value = spec.unshard(all_gather_tensors(value, group=pm.groups.tp))
            if dist.get_rank() == 0:
                full[name] = value.to("cpu").contiguous()
        if dist.get_rank() == 0:
            _write_hf_dir(pm.module, full, path)
    barrier(pm.device)


def _write_hf_dir(module: torch.nn.Module, tensors: dict[str, torch.Tensor], path: str) -> None:
    os.makedirs(path, exist_ok=True)
    module.config.save_pretrained(path)
    generation_config = getattr(module, "generation_config", None)
    if generation_config is not None and getattr(module, "can_generate", lambda: False)():
        generation_config.save_pretrained(path)
    # Write beside the target and rename, so a crash never leaves a half-written model.safetensors.
    fd, tmp = tempfile.mkstemp(dir=path, prefix=".model.safetensors.")
    os.close(fd)
    try:
        save_file(tensors, tmp, metadata={"format": "pt"})
        with open(tmp, "rb") as f:
            os.fsync(f.fileno())
        os.replace(tmp, os.path.join(path, "model.safetensors"))
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
