"""The figures ``mesh="auto"`` prices with when it is given no calibration.

On a GPU whose kind the stated figures describe (``RECOGNISED``: cost.Hardware states an H100's, which an
H200 computes as), those. On any other machine, a CPU or another GPU, they would rank configurations for a
machine that is not there (on a 2-core CPU they chose FSDP at 1.30x the fastest measured step), so every
rank of the job measures this one at once, quickly (``calibrate.measure(quick=True)``: about 10 s at two
CPU ranks), and the figures are kept per machine and job shape (host, device, world size, ranks per node,
threads, torch, calibration format) under ``$QN_HF_CACHE`` (default ``~/.cache/qn_hf``): a later job of
the same shape reads them. Rank 0's cache decides, its file's text broadcast, so every rank prices with
the same figures; a job planned for another world size than its own (``world_size=`` from one process)
is priced at the stated figures, named among the assumed ones.
"""

from __future__ import annotations

import datetime
import hashlib
import json
import os
import socket

import torch
import torch.distributed as dist

from ..devices import default_device
from ..launch.nodes import ranks_per_node
from ..mesh import init_distributed, launched_world_size
from .calibrate import measure
from .calibration import FORMAT, Calibration

RECOGNISED = ("H100", "H200")  # GPU names the stated figures describe
CACHE_ENV = "QN_HF_CACHE"


def recognised_gpu(device: torch.device) -> str | None:
    """The kind of ``device`` the stated figures describe, or None (a CPU, another GPU)."""
    if device.type != "cuda":
        return None
    name = torch.cuda.get_device_name(device).upper()
    return next((kind for kind in RECOGNISED if kind in name), None)


def cache_path(device: torch.device, *, world: int, per_node: int) -> str:
    """Where this machine's figures for a job of ``world`` ranks are kept."""
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
    shape = [socket.gethostname(), name, world, per_node, torch.get_num_threads(), torch.__version__, FORMAT]
    key = hashlib.sha256(json.dumps(shape).encode()).hexdigest()[:16]
    folder = os.environ.get(CACHE_ENV) or os.path.join(os.path.expanduser("~"), ".cache", "qn_hf")
    return os.path.join(folder, f"calibration-{key}.json")


def machine_calibration(*, world_size: int | None = None) -> Calibration | None:
    """This machine's figures for ``mesh="auto"`` (module docstring), the same on every rank; None: the
    stated figures (a recognised GPU, or a job planned for another world size than the launched one)."""
    world = launched_world_size()
    device = default_device()
    if world_size not in (None, world) or recognised_gpu(device) is not None:
        return None
    # a launched job whose group is not up yet joins it here, as parallelize would (a lone process: its own)
    init_distributed(device=device, timeout=datetime.timedelta(minutes=10))
    per_node = min(ranks_per_node() or world, world)
    path = cache_path(device, world=world, per_node=per_node)
    text = _from_rank_0(_read(path) if dist.get_rank() == 0 else None, device)
    if text is not None:
        return Calibration.from_json(json.loads(text))
    cal = measure(quick=True)
    if dist.get_rank() == 0:
        try:
            os.makedirs(os.path.dirname(path), exist_ok=True)
            cal.save(path)
        except OSError:  # a read-only home: measured again next time, nothing else lost
            pass
    return cal


def _read(path: str) -> str | None:
    """The cached figures' text, or None where there are none this release reads."""
    try:
        with open(path) as f:
            text = f.read()
        Calibration.from_json(json.loads(text))
    except (OSError, ValueError):  # absent, torn or from another format: measured again
        return None
    return text


def _from_rank_0(text: str | None, device: torch.device) -> str | None:
    """Rank 0's ``text`` (None: it has none) on every rank."""
    if device.type == "cuda" and dist.get_backend() != "nccl":
        device = torch.device("cpu")
    data = torch.frombuffer(bytearray(text.encode()), dtype=torch.uint8) if text else torch.empty(0, dtype=torch.uint8)
    size = torch.tensor([data.numel()], dtype=torch.int64, device=device)
    dist.broadcast(size, src=0)
    n = int(size.item())
    if n == 0:
        return None
    buffer = data.to(device) if dist.get_rank() == 0 else torch.empty(n, dtype=torch.uint8, device=device)
    dist.broadcast(buffer, src=0)
    return bytes(buffer.cpu().numpy()).decode()
