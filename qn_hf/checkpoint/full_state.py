"""``pm.state_dict()``: the whole model's tensors under their Hugging Face names, on every rank.

What comes back is what ``model.state_dict()`` of the unsharded model holds: every tensor whole
(gathered over tp, or over the ep group for MoE experts, padding cut), collected from every pipeline
stage, in module order, a tied weight under both of its names as one tensor (as HF gives it).

Which tensors: the module's own, so under mixed precision the compute-dtype weights the forward
uses and ``save_pretrained`` writes. The float32 master weights are optimizer state (``qn_hf.optimizer``,
split over dp under ZeRO): ``optimizer.state_dict()`` and ``save_checkpoint`` hold them.

Memory: every rank ends up holding the whole model, on the CPU. Each tensor is gathered on the
device and copied off it at once, so device memory never holds more than one whole tensor beside
the shard; the host holds the full copy on each of a node's ranks. That is what a model sharded
*because* it is big cannot afford, so the call is refused above ``max_bytes``: by default half the
host memory available now, divided among this node's ranks (each keeps a copy), the half leaving room
for the shards, the activations and what the caller does with the dict. The bound is the smallest
over all ranks, agreed on with one all-reduce before any tensor moves, so every rank refuses or none
does. ``pm.save_pretrained(dir)`` streams tensor by tensor instead and has no such limit.

Collective: every rank must call it, in the same order of operations as the others.
"""

from __future__ import annotations

import os

import torch
import torch.distributed as dist
from torch import nn

from ..comm import group_size
from ..data_parallel.sharded import gathered_state
from ..launch.nodes import ranks_per_node
from ..placement import ShardPlacement
from .format import global_shape

HOST_FRACTION = 0.5  # share of the available host memory the default bound lets the copies take
FALLBACK_HOST_BYTES = 4 * 2**30  # where the available host memory cannot be read

# (name, whole shape, dtype, the name it is tied to or None): what a stage says of each tensor
Entry = tuple[str, tuple[int, ...], torch.dtype, "str | None"]


def full_state_dict(module: nn.Module, *, placement: ShardPlacement, max_bytes: int | None = None) -> dict[str, torch.Tensor]:
    """The unsharded model's state dict on every rank (CPU tensors, a snapshot: later steps do not
    change it). Raises ``ValueError`` on every rank when it would exceed ``max_bytes`` (default:
    ``default_max_bytes()``, the smallest over the ranks)."""
    groups = placement.groups
    local = gathered_state(module.state_dict(keep_vars=True))  # the parameters: ties show as one object
    stages: list[list[Entry]] = [[] for _ in range(group_size(groups.pp))]
    dist.all_gather_object(stages, _entries(local, placement), group=groups.pp)

    order: list[tuple[int, Entry]] = []  # the first stage holding each name (shared buffers repeat)
    seen: set[str] = set()
    for stage, entries in enumerate(stages):
        for entry in entries:
            if entry[0] not in seen:
                seen.add(entry[0])
                order.append((stage, entry))
    size = sum(torch.Size(shape).numel() * _itemsize(dtype) for _, (_, shape, dtype, alias) in order if alias is None)
    bound = torch.tensor([default_max_bytes() if max_bytes is None else max_bytes], dtype=torch.int64,
                         device=placement.device)
    dist.all_reduce(bound, op=dist.ReduceOp.MIN)
    if size > bound.item():
        raise ValueError(
            f"the whole model is {size / 2**30:.3g} GiB ({size} bytes), above max_bytes={bound.item()} "
            f"({bound.item() / 2**30:.3g} GiB){' (half the available host memory per rank)' if max_bytes is None else ''}, "
            f"and state_dict() puts a full copy on every rank; write it to disk with pm.save_pretrained(dir), which "
            f"streams tensor by tensor, or pass a larger max_bytes"
        )

    values: dict[str, torch.Tensor] = {}
    for stage, (name, shape, dtype, alias) in order:
        if alias is not None:
            continue
        whole = placement.whole(name, local[name].detach()) if stage == groups.coords.pp else None
        if group_size(groups.pp) > 1:
            whole = _broadcast(whole, shape=shape, dtype=dtype, src=stage, placement=placement)
        values[name] = whole.to("cpu", copy=True)
        del whole  # the device holds at most one whole tensor at a time
    return {name: values[alias if alias is not None else name] for _, (name, _, _, alias) in order}


def default_max_bytes() -> int:
    """``HOST_FRACTION`` of the host memory available now, divided among this node's ranks."""
    ranks = ranks_per_node() or (dist.get_world_size() if dist.is_initialized() else 1)
    return int(_available_host_bytes() * HOST_FRACTION) // max(ranks, 1)


def _available_host_bytes() -> int:
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    try:
        return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (AttributeError, ValueError, OSError):
        return FALLBACK_HOST_BYTES


def _entries(local: dict[str, torch.Tensor], placement: ShardPlacement) -> list[Entry]:
    """This stage's tensors: whole shapes, and ties. A tensor seen under an earlier name (a tie
    inside the stage) and the last stage's copy of a weight tied across stages point at the name
    that holds it."""
    first_name: dict[int, str] = {}
    out: list[Entry] = []
    for name, tensor in local.items():
        first = first_name.setdefault(id(tensor), name)
        alias = first if first != name else (placement.owner(name) if placement.is_follower(name) else None)
        out.append((name, tuple(global_shape(tensor.shape, placement.spec(name))), tensor.dtype, alias))
    return out


def _broadcast(tensor: torch.Tensor | None, *, shape: tuple[int, ...], dtype: torch.dtype, src: int,
               placement: ShardPlacement) -> torch.Tensor:
    """Stage ``src``'s whole tensor on every stage of this (dp, tp) column."""
    group = placement.groups.pp
    if tensor is None:
        tensor = torch.empty(shape, dtype=dtype, device=placement.device)
    buffer = tensor.contiguous()
    wire = buffer.view(torch.uint8) if dtype == torch.bool else buffer  # gloo broadcasts no bool
    dist.broadcast(wire, src=dist.get_global_rank(group, src), group=group)
    return buffer


def _itemsize(dtype: torch.dtype) -> int:
    return torch.empty((), dtype=dtype).element_size()
