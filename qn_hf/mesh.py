"""Parallel degrees, their validation, and the ("dp", "pp", "tp") device mesh.

Validation here is pure arithmetic: it runs on every rank before any process group exists, so a bad
configuration raises the same ``ValueError`` everywhere instead of hanging in a rendezvous.
"""

from __future__ import annotations

import datetime
import os
import socket
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

MESH_DIMS = ("dp", "pp", "tp")


@dataclass(frozen=True)
class ParallelDims:
    """Degrees of data, pipeline and tensor parallelism; ``world_size == dp * pp * tp``."""

    dp: int = 1
    tp: int = 1
    pp: int = 1

    def __post_init__(self) -> None:
        for name in ("dp", "tp", "pp"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{name}={value!r} must be a positive integer")

    @property
    def world_size(self) -> int:
        return self.dp * self.pp * self.tp

    def check_world_size(self, world_size: int) -> None:
        if world_size != self.world_size:
            raise ValueError(
                f"world size {world_size} != dp*tp*pp = {self.dp}*{self.tp}*{self.pp} = {self.world_size}; "
                f"launch {self.world_size} processes (e.g. torchrun --nproc-per-node {self.world_size}) "
                f"or change dp/tp/pp so that their product is {world_size}"
            )

    def coords(self, rank: int) -> dict[str, int]:
        """Mesh coordinates of a global rank: tp varies fastest, then pp, then dp."""
        return {"dp": rank // (self.pp * self.tp), "pp": (rank // self.tp) % self.pp, "tp": rank % self.tp}


def launched_world_size() -> int:
    """World size without any communication: the live group's, else the launcher's environment."""
    if dist.is_available() and dist.is_initialized():
        return dist.get_world_size()
    return int(os.environ.get("WORLD_SIZE", "1"))


def default_device() -> torch.device:
    """One CUDA device per local rank when CUDA is present, the CPU otherwise."""
    if torch.cuda.is_available():
        return torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")) % torch.cuda.device_count())
    return torch.device("cpu")


def backend_for(device: torch.device) -> str:
    return "nccl" if device.type == "cuda" else "gloo"


def init_distributed(*, device: torch.device, timeout: datetime.timedelta) -> None:
    """Join the default process group unless the caller already has.

    Under torchrun/accelerate the rendezvous comes from the environment. A lone process with no
    launcher environment gets a private one-rank group on a free local port, so ``dp=tp=pp=1``
    works in a notebook too.
    """
    if dist.is_initialized():
        return
    if device.type == "cuda":
        torch.cuda.set_device(device)
    backend = backend_for(device)
    if "MASTER_ADDR" in os.environ and "RANK" in os.environ:
        dist.init_process_group(backend=backend, timeout=timeout)
        return
    dist.init_process_group(
        backend=backend, init_method=f"tcp://127.0.0.1:{free_local_port()}", rank=0, world_size=1, timeout=timeout
    )


def free_local_port() -> int:
    """A TCP port on 127.0.0.1 that nothing listens on now (for a local process group's rendezvous)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def build_mesh(dims: ParallelDims, *, device: torch.device, timeout: datetime.timedelta | None = None) -> DeviceMesh:
    """A 3-D mesh over all ranks; every rank must call this (it creates the sub-groups).

    With ``timeout``, every dp/pp/tp group gets it: ``init_device_mesh`` would give its groups
    torch's default (30 minutes for gloo) whatever the default group's timeout is, so a rank that
    stops answering would hold the others in a tp all-reduce or a pipeline receive for half an hour.
    """
    if timeout is None:
        return init_device_mesh(device.type, (dims.dp, dims.pp, dims.tp), mesh_dim_names=MESH_DIMS)
    grid = torch.arange(dims.world_size).reshape(dims.dp, dims.pp, dims.tp)
    groups = []
    for d, size in enumerate(grid.shape):
        ranks = grid.movedim(d, -1).reshape(-1, size).tolist()  # every group along dim d
        mine, _ = dist.new_subgroups_by_enumeration(ranks, timeout=timeout)
        groups.append(mine)
    return DeviceMesh.from_group(groups, device.type, mesh=grid, mesh_dim_names=MESH_DIMS)


def check_mesh(mesh: DeviceMesh, dims: ParallelDims) -> None:
    """A caller-supplied mesh must have our dim names and the requested degrees."""
    if mesh.mesh_dim_names != MESH_DIMS:
        raise ValueError(f"mesh dims {mesh.mesh_dim_names} must be {MESH_DIMS}")
    shape = tuple(mesh.mesh.shape)
    if shape != (dims.dp, dims.pp, dims.tp):
        raise ValueError(f"mesh shape {shape} does not match (dp, pp, tp) = {(dims.dp, dims.pp, dims.tp)}")
