"""The machines a job runs on: how many nodes, how many ranks each, and which one is this rank's, as the
launcher's environment says and every rank agrees. qn_hf numbers its mesh so that the groups that talk most
stay inside a node (``config/layout.py``); that holds where a node's ranks are numbered consecutively, as
torchrun numbers them, and ``agreed_nodes`` says so where they are not.

Launchers, in the order their variables are read:

* torchrun (directly, under SLURM's ``srun`` one agent a node, or in a Kubernetes PyTorchJob, whose ``PET_*``
  variables are torchrun's own arguments): ``LOCAL_RANK``, ``LOCAL_WORLD_SIZE``, ``GROUP_RANK`` (the node);
* ``srun`` starting every rank itself: ``SLURM_PROCID``, ``SLURM_NTASKS``, ``SLURM_LOCALID``, ``SLURM_NODEID``,
  ``SLURM_TASKS_PER_NODE`` (``"4(x2)"``: 4 tasks on each of 2 nodes);
* Open MPI's ``mpirun``: ``OMPI_COMM_WORLD_RANK``, ``OMPI_COMM_WORLD_SIZE``, ``OMPI_COMM_WORLD_LOCAL_RANK``,
  ``OMPI_COMM_WORLD_LOCAL_SIZE``;
* none of these (a lone process, a notebook, qn_hf's own local worlds): one node holding every rank.
"""

from __future__ import annotations

import os
import re
import warnings
from collections.abc import Mapping
from dataclasses import dataclass

import torch.distributed as dist

from ..config.dims import Axis, ParallelDims
from ..config.layout import crosses_nodes


@dataclass(frozen=True)
class Launch:
    """What one rank's environment says of its place: its global and local rank, and its node."""

    launcher: str
    rank: int
    world_size: int
    local_rank: int
    ranks_per_node: int
    node: int


def launch_environment(env: Mapping[str, str] | None = None) -> Launch:
    """This rank's place as its launcher's variables give it (module docstring); raises ValueError where they
    contradict each other."""
    env = os.environ if env is None else env
    if "LOCAL_WORLD_SIZE" in env or ("LOCAL_RANK" in env and "RANK" in env):
        rank, world = int(env.get("RANK", "0")), int(env.get("WORLD_SIZE", "1"))
        local_size = int(env.get("LOCAL_WORLD_SIZE", world))
        node = int(env["GROUP_RANK"]) if "GROUP_RANK" in env else rank // local_size
        found = Launch("torchrun", rank, world, int(env.get("LOCAL_RANK", "0")), local_size, node)
    elif "SLURM_PROCID" in env and "SLURM_NTASKS" in env:
        per_node = _slurm_tasks_per_node(env.get("SLURM_TASKS_PER_NODE", env["SLURM_NTASKS"]))
        found = Launch("srun", int(env["SLURM_PROCID"]), int(env["SLURM_NTASKS"]), int(env.get("SLURM_LOCALID", "0")),
                       per_node, int(env.get("SLURM_NODEID", "0")))
    elif "OMPI_COMM_WORLD_RANK" in env:
        rank, local_size = int(env["OMPI_COMM_WORLD_RANK"]), int(env.get("OMPI_COMM_WORLD_LOCAL_SIZE", "1"))
        found = Launch("mpirun", rank, int(env["OMPI_COMM_WORLD_SIZE"]), int(env.get("OMPI_COMM_WORLD_LOCAL_RANK", "0")),
                       local_size, rank // local_size)
    else:
        rank, world = int(env.get("RANK", "0")), int(env.get("WORLD_SIZE", "1"))
        found = Launch("none", rank, world, rank, world, 0)
    if found.ranks_per_node < 1 or found.world_size % found.ranks_per_node or not 0 <= found.local_rank < found.ranks_per_node:
        raise ValueError(f"{found.launcher}'s environment gives {found.world_size} ranks, {found.ranks_per_node} a node "
                         f"and local rank {found.local_rank}: the ranks per node must divide the world and hold the "
                         f"local rank; launch every node with the same number of processes")
    return found


def _slurm_tasks_per_node(value: str) -> int:
    """SLURM_TASKS_PER_NODE (``"4(x2)"``, ``"4,4"``, ``"4"``) as one count; nodes of different counts refused."""
    counts = {int(m.group(1)) for m in re.finditer(r"(\d+)(?:\(x\d+\))?", value)}
    if len(counts) != 1:
        raise ValueError(f"SLURM_TASKS_PER_NODE={value!r}: nodes run different numbers of tasks; qn_hf lays ranks out "
                         f"by nodes of one size: give every node the same --ntasks-per-node")
    return counts.pop()


def local_rank() -> int:
    """This rank's index on its node (which GPU it takes), from whichever launcher started it."""
    return launch_environment().local_rank


@dataclass(frozen=True)
class Nodes:
    """The job's nodes as every rank agrees: ``count`` nodes of ``ranks_per_node`` ranks; this rank's ``node``;
    ``consecutive``: each node's ranks are numbered one after another (node n holds ranks n * ranks_per_node
    onwards), as the layout assumes."""

    count: int
    ranks_per_node: int
    node: int
    consecutive: bool
    launcher: str


def agreed_nodes(group: dist.ProcessGroup | None = None) -> Nodes:
    """Every rank's node, gathered over ``group`` (the world; a host group serves, as gloo's): one collective,
    every rank must call it. Nodes of different sizes are refused on every rank; ranks numbered otherwise than
    node by node (SLURM's ``--distribution=cyclic``) warn, on rank 0, that groups the layout keeps inside a node
    cross nodes there."""
    mine = launch_environment()
    world = dist.get_world_size(group)
    places: list = [None] * world
    dist.all_gather_object(places, (mine.node, mine.ranks_per_node), group=group)
    sizes = {n: sum(1 for node, _ in places if node == n) for n in {node for node, _ in places}}
    if len(set(sizes.values())) != 1:
        raise ValueError(f"the job's nodes hold different numbers of ranks ({dict(sorted(sizes.items()))}); qn_hf lays "
                         f"ranks out by nodes of one size: launch every node with the same --nproc-per-node")
    per_node = next(iter(sizes.values()))
    order = sorted(sizes)
    consecutive = all(order.index(node) == r // per_node for r, (node, _) in enumerate(places))
    if not consecutive and dist.get_rank() == 0:
        warnings.warn(f"the launcher numbers ranks across {len(sizes)} nodes otherwise than node by node (rank -> node: "
                      f"{[node for node, _ in places][:16]}...); qn_hf keeps tp, cp and ep groups among consecutive "
                      f"ranks, which cross nodes here: launch with block distribution (srun --distribution=block, "
                      f"torchrun's default)", stacklevel=3)
    return Nodes(count=len(sizes), ranks_per_node=per_node, node=order.index(mine.node), consecutive=consecutive,
                 launcher=mine.launcher)


def warn_groups_across_nodes(dims: ParallelDims, nodes: Nodes) -> None:
    """Warns, on rank 0, where a group the layout keeps inside a node cannot stay there: tp's, cp's or ep's
    collectives run in every layer, so over the network they take most of a step."""
    if nodes.count == 1 or dist.get_rank() != 0:
        return
    inner = (Axis.TP.value, Axis.CP.value, Axis.EP.value)
    across = [kind for kind, crossing in crosses_nodes(dims, nodes.ranks_per_node).items() if crossing and kind in inner]
    if across:
        warnings.warn(f"{', '.join(f'{kind}={getattr(dims, kind)}' for kind in across)}: these groups span nodes of "
                      f"{nodes.ranks_per_node} ranks, so their collectives (in every layer) cross the network; keep "
                      f"tp x cp, and ep's blocks of a stage's dp x tp ranks, within {nodes.ranks_per_node} ranks",
                      stacklevel=3)
