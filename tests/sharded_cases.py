"""What one rank of a ``dp_shard`` run communicates in a step, against what FSDP's groups must move."""

from __future__ import annotations

import torch
from torch.distributed.fsdp import FSDPModule

import qn_hf
from qn_hf.comm_meter import CommMeter
from tests.cases import mesh_for
from tests.models import dp_slice, load, make_batch


def _shard_bytes(unit: torch.nn.Module, shards: int) -> int:
    """This rank's part of a group's flat all-gather input: each parameter of the group (not of the
    groups inside it) padded to ceil(rows / shards) rows, in float32."""
    inner = {id(p) for m in unit.modules() if m is not unit and isinstance(m, FSDPModule) for p in m.parameters()}
    total = 0
    for p in unit.parameters():
        if id(p) in inner:
            continue
        rows = p.shape[0]
        total += -(-rows // shards) * (p.numel() // rows) * p.element_size()
    return total


def step_traffic(*, kind: str, model_dir: str, dp: int, dp_shard: int, pp: int, microbatches: int,
                 gather: str = "step") -> dict:
    """One warm step metered: calls and bytes on the dp_shard group by operation, and what each FSDP
    group of this rank holds (its all-gather input)."""
    pm = qn_hf.parallelize(load(kind, model_dir), dp=dp, pp=pp, dp_shard=dp_shard, microbatches=microbatches,
                           mesh=mesh_for(dp, 1, pp), dp_shard_gather=gather)
    batch = dp_slice(make_batch(kind, size=dp * 2 * microbatches, seed=3), dp=dp, dp_rank=pm.coords.dp)
    pm.train_step(batch)  # the first step initializes FSDP and the pipeline's header
    for p in pm.parameters():
        p.grad = None
    with CommMeter(pm) as meter:
        pm.train_step(batch)
    units = [m for m in pm.module.modules() if isinstance(m, FSDPModule)]
    return {
        "totals": {f"{g}:{op}": (t.calls, t.nbytes) for (g, op), t in meter.totals().items() if g.startswith("dp_")},
        "unit_bytes": [_shard_bytes(u, dp_shard) for u in units],
        "blocks": len(units) - 1,
    }
