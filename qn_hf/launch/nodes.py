"""The machines a job runs on: how many nodes, how many ranks each, and which one is this rank's, as the
launcher's environment says and every rank agrees. qn_hf numbers its mesh so that the groups that talk most
stay inside a node (``config/layout.py``); that holds where a node's ranks are numbered consecutively, as
torchrun numbers them, and ``agreed_nodes`` says so where they are not.

Launchers, in the order their variables are read:

* torchrun (directly, under SLURM's ``srun`` one agent a node, or in a Kubernetes PyTorchJob, whose ``PET_*``
  variables are torchrun's own arguments): ``LOCAL_RANK``, ``LOCAL_WORLD_SIZE``, ``GROUP_RANK`` (the node);
* ``srun`` starting every rank itself: ``SLURM_PROCID``, ``SLURM_STEP_NUM_TASKS``, ``SLURM_LOCALID``,
  ``SLURM_NODEID``, ``SLURM_STEP_TASKS_PER_NODE`` (``"4(x2)"``: 4 tasks on each of 2 nodes). The step's own
  variables: a batch script's lone process sees the allocation's ``SLURM_NTASKS`` but no step's;
* Open MPI's ``mpirun``: ``OMPI_COMM_WORLD_RANK``, ``OMPI_COMM_WORLD_SIZE``, ``OMPI_COMM_WORLD_LOCAL_RANK``,
  ``OMPI_COMM_WORLD_LOCAL_SIZE`` (no node index: ``--map-by`` may deal ranks out across nodes);
* another launcher setting ``RANK`` and ``LOCAL_RANK`` alone (DeepSpeed's): no node size;
* none of these (a lone process, a notebook): one node holding every rank.

Where the environment names no node, ``agreed_nodes`` tells the nodes apart by host name.
"""

from __future__ import annotations

import os
import re
import socket
import warnings
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import torch.distributed as dist

from ..arguments import Choice
from ..config.dims import Axis, ParallelDims


class Launcher(Choice):
    TORCHRUN = "torchrun"
    SRUN = "srun"
    MPIRUN = "mpirun"
    OTHER = "another launcher"
    NONE = "no launcher"


# the launchers that start every rank themselves and give no rendezvous of their own (MASTER_ADDR is the caller's)
SELF_STARTED = (Launcher.SRUN, Launcher.MPIRUN)


@dataclass(frozen=True)
class Launch:
    """What one rank's environment says of its place: its global and local rank, and its node (None where the
    environment does not say: ``agreed_nodes`` finds it)."""

    launcher: Launcher
    rank: int
    world_size: int
    local_rank: int
    ranks_per_node: int | None
    node: int | None


def launch_environment(env: Mapping[str, str] | None = None) -> Launch:
    """This rank's place as its launcher's variables give it (module docstring); raises ValueError where they
    contradict each other."""
    env = os.environ if env is None else env
    if "LOCAL_WORLD_SIZE" in env:
        rank, world = int(env.get("RANK", "0")), int(env.get("WORLD_SIZE", "1"))
        local_size = int(env["LOCAL_WORLD_SIZE"])
        node = int(env["GROUP_RANK"]) if "GROUP_RANK" in env else None
        found = Launch(Launcher.TORCHRUN, rank, world, int(env.get("LOCAL_RANK", "0")), local_size, node)
    elif "SLURM_PROCID" in env and "SLURM_STEP_NUM_TASKS" in env:
        per_node = _slurm_tasks_per_node(env.get("SLURM_STEP_TASKS_PER_NODE", env.get("SLURM_TASKS_PER_NODE", "")))
        node = int(env["SLURM_NODEID"]) if "SLURM_NODEID" in env else None
        found = Launch(Launcher.SRUN, int(env["SLURM_PROCID"]), int(env["SLURM_STEP_NUM_TASKS"]),
                       int(env.get("SLURM_LOCALID", "0")), per_node, node)
    elif "OMPI_COMM_WORLD_RANK" in env:
        found = Launch(Launcher.MPIRUN, int(env["OMPI_COMM_WORLD_RANK"]), int(env["OMPI_COMM_WORLD_SIZE"]),
                       int(env.get("OMPI_COMM_WORLD_LOCAL_RANK", "0")),
                       int(env["OMPI_COMM_WORLD_LOCAL_SIZE"]) if "OMPI_COMM_WORLD_LOCAL_SIZE" in env else None, None)
    elif "LOCAL_RANK" in env and "RANK" in env:
        found = Launch(Launcher.OTHER, int(env["RANK"]), int(env.get("WORLD_SIZE", "1")), int(env["LOCAL_RANK"]),
                       None, None)
    else:
        rank, world = int(env.get("RANK", "0")), int(env.get("WORLD_SIZE", "1"))
        found = Launch(Launcher.NONE, rank, world, rank, world, 0)
    per_node = found.ranks_per_node
    if per_node is not None and (per_node < 1 or found.world_size % per_node or not 0 <= found.local_rank < per_node):
        raise ValueError(f"{found.launcher}'s environment gives {found.world_size} ranks, {per_node} a node and local "
                         f"rank {found.local_rank}: the ranks per node must divide the world and hold the local rank; "
                         f"launch every node with the same number of processes")
    return found


def _slurm_tasks_per_node(value: str) -> int | None:
    """SLURM_STEP_TASKS_PER_NODE (``"4(x2)"``, ``"4,4"``, ``"4"``) as one count (None: not given); nodes of
    different counts refused."""
    counts = {int(m.group(1)) for m in re.finditer(r"(\d+)(?:\(x\d+\))?", value)}
    if len(counts) > 1:
        raise ValueError(f"SLURM_STEP_TASKS_PER_NODE={value!r}: nodes run different numbers of tasks; qn_hf lays ranks "
                         f"out by nodes of one size: give every node the same --ntasks-per-node")
    return counts.pop() if counts else None


def local_rank() -> int:
    """This rank's index on its node (which GPU it takes), from whichever launcher started it."""
    return launch_environment().local_rank


def ranks_per_node() -> int | None:
    """How many ranks each node runs, as the launcher says without communication (None: it does not say)."""
    return launch_environment().ranks_per_node


@dataclass(frozen=True)
class Nodes:
    """The job's nodes as every rank agrees: ``count`` nodes of ``ranks_per_node`` ranks; this rank's ``node``;
    ``of_rank``: every rank's node (numbered in order of their first rank); ``consecutive``: each node's ranks
    are numbered one after another, as the layout assumes."""

    count: int
    ranks_per_node: int
    node: int
    of_rank: tuple[int, ...]
    consecutive: bool
    launcher: Launcher


def agreed_nodes(group: dist.ProcessGroup | None = None) -> Nodes:
    """Every rank's node, gathered over ``group`` (the world; a host group serves, as gloo's): one collective,
    every rank must call it. A node is the launcher's node index where every rank's environment names one, else
    its host name. Nodes of different sizes are refused on every rank alike; ranks numbered otherwise than node
    by node (SLURM's ``--distribution=cyclic``, ``mpirun --map-by node``) warn, on rank 0, that groups the layout
    keeps inside a node cross nodes there."""
    mine = launch_environment()
    places: list = [None] * dist.get_world_size(group)
    dist.all_gather_object(places, (mine.node, socket.gethostname()), group=group)
    named = all(node is not None for node, _ in places)
    keys = [node if named else host for node, host in places]
    order = list(dict.fromkeys(keys))  # nodes in order of their first rank
    of_rank = tuple(order.index(key) for key in keys)
    sizes = {n: of_rank.count(n) for n in range(len(order))}
    if len(set(sizes.values())) != 1:
        raise ValueError(f"the job's nodes hold different numbers of ranks ({sizes}); qn_hf lays ranks out by nodes "
                         f"of one size: launch every node with the same number of processes")
    per_node = sizes[0]
    consecutive = all(node == r // per_node for r, node in enumerate(of_rank))
    if not consecutive and dist.get_rank() == 0:
        warnings.warn(f"the launcher numbers ranks across {len(order)} nodes otherwise than node by node (rank -> node: "
                      f"{list(of_rank[:16])}...); qn_hf keeps tp, cp and ep groups among consecutive ranks, which "
                      f"cross nodes here: launch with block distribution (srun --distribution=block, torchrun's "
                      f"default, mpirun --map-by slot)", stacklevel=3)
    return Nodes(count=len(order), ranks_per_node=per_node, node=of_rank[dist.get_rank()], of_rank=of_rank,
                 consecutive=consecutive, launcher=mine.launcher)


def warn_groups_across_nodes(groups: Mapping[str, Sequence[Sequence[int]]], dims: ParallelDims, nodes: Nodes) -> None:
    """Warns, on rank 0, where a group the layout keeps inside a node does not stay there (``groups``: the ones
    built, by kind): tp's, cp's or ep's collectives run in every layer, so over the network they take most of a
    step."""
    if nodes.count == 1 or dist.get_rank() != 0:
        return
    inner = (Axis.TP, Axis.CP, Axis.EP)
    across = [kind for kind in inner if any(len({nodes.of_rank[r] for r in g}) > 1 for g in groups.get(kind, ()))]
    if across:
        warnings.warn(f"{', '.join(f'{kind}={getattr(dims, kind)}' for kind in across)}: these groups span nodes of "
                      f"{nodes.ranks_per_node} ranks, so their collectives (in every layer) cross the network; keep "
                      f"tp x cp, and ep's blocks of a stage's dp x tp ranks, within {nodes.ranks_per_node} ranks",
                      stacklevel=3)
