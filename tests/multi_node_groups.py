"""Run under torchrun on each simulated node (tests/test_multi_node.py): build the groups of a mesh and write
this rank's node and groups to OUT/rank<r>.json."""

from __future__ import annotations

import datetime
import json
import os
import sys

import torch
import torch.distributed as dist

from qn_hf.config.dims import ParallelDims
from qn_hf.mesh import build_groups, init_distributed


def main() -> None:
    out, degrees = sys.argv[1], dict(arg.split("=") for arg in sys.argv[2:])
    device = torch.device("cpu")
    timeout = datetime.timedelta(seconds=60)
    init_distributed(device=device, timeout=timeout)
    groups = build_groups(ParallelDims(**{k: int(v) for k, v in degrees.items()}), device=device, timeout=timeout)
    record = {"rank": dist.get_rank(), "node": int(os.environ["GROUP_RANK"]),
              "nodes": [groups.nodes.count, groups.nodes.ranks_per_node, groups.nodes.node],
              "groups": {kind: dist.get_process_group_ranks(getattr(groups, kind))
                         for kind in ("tp", "ep", "dp", "pp", "experts") if getattr(groups, kind) is not None}}
    with open(os.path.join(out, f"rank{dist.get_rank()}.json"), "w") as f:
        json.dump(record, f)
    groups.release()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
