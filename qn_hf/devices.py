"""Where a rank's tensors live: its device (one GPU per local rank, or the CPU), the backend that
device talks over, and host-to-device copies that do not make the host wait."""

from __future__ import annotations

from collections.abc import Mapping

import torch

from .launch.nodes import local_rank


def default_device() -> torch.device:
    """One CUDA device per local rank (``nodes.local_rank``: torchrun's, srun's or mpirun's) when CUDA is present,
    the CPU otherwise."""
    if torch.cuda.is_available():
        return torch.device("cuda", local_rank() % torch.cuda.device_count())
    return torch.device("cpu")


def backend_for(device: torch.device) -> str:
    return "nccl" if device.type == "cuda" else "gloo"


def on_device(tensor: torch.Tensor, device: torch.device) -> torch.Tensor:
    """``tensor`` on ``device`` without making the host wait for it: a host tensor bound for a CUDA
    device is copied through pinned memory (unless it is pinned already) with a non-blocking copy, as
    a DataLoader with ``pin_memory=True`` would hand it over. A plain ``.to(device)`` of pageable
    memory waits on the host until the copy is done, every step. The pinned copy's memory returns to
    torch's pinned pool only once the transfer on the current stream is done (the caching host
    allocator records it)."""
    if tensor.device == device or device.type != "cuda" or tensor.device.type != "cpu":
        return tensor.to(device)
    return (tensor if tensor.is_pinned() else tensor.pin_memory()).to(device, non_blocking=True)


def to_device(batch: Mapping[str, torch.Tensor], device: torch.device) -> dict[str, torch.Tensor]:
    """Every tensor of ``batch`` on ``device`` (``on_device``)."""
    return {k: on_device(v, device) for k, v in batch.items()}
