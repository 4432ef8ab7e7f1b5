"""Parallel degrees, their validation, the ("dp", "pp", "tp") device mesh (("dp", "pp", "cp", "tp")
with context parallelism) over the ranks as ``config/layout.py`` numbers them, and the one function that
builds every process group a rank needs (``build_groups``), from the layout's lists of groups.

Validation here is pure arithmetic: it runs on every rank before any process group exists, so a bad
configuration raises the same ``ValueError`` everywhere instead of hanging in a rendezvous.
"""

from __future__ import annotations

import datetime
import os
import warnings
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from types import MappingProxyType

import torch
import torch.distributed as dist
from torch.distributed import ProcessGroup
from torch.distributed.device_mesh import DeviceMesh

from .comm import member_groups
from .config.dims import MESH_AXES, Axis, ParallelDims
from .config.layout import GroupRole, full_grid, rank_grid, rank_groups
from .devices import backend_for
from .launch.nodes import SELF_STARTED, Nodes, agreed_nodes, launch_environment, warn_groups_across_nodes
from .local_world import free_local_port
from .pipeline.p2p import Link, Peers, build_links

# A rank's coordinates: one per mesh axis (its place on the mesh), then its expert block and which copy of it
_PLACES: tuple[str, ...] = (*(spec.axis.value for spec in MESH_AXES), Axis.EP.value, "expert_replica")


class Coords(Mapping):
    """This rank's place on the mesh: one coordinate per mesh axis (``config/dims.MESH_AXES``), ``cp`` 0 without
    context parallelism; with expert parallelism also ``ep`` (its block of experts) and ``expert_replica``
    (which copy of that block). It reads as a mapping of the coordinates it holds (``dict(pm.coords)``) and by
    attribute (``pm.coords.dp``; an expert coordinate None without expert parallelism)."""

    __slots__ = ("_places",)

    def __init__(self, places: Mapping[str, int | None]) -> None:
        unknown = set(places) - set(_PLACES)
        if unknown:
            raise ValueError(f"Coords: {sorted(unknown)} are no coordinates (they are {_PLACES})")
        object.__setattr__(self, "_places", {name: int(places[name]) for name in _PLACES
                                             if places.get(name) is not None})

    def __getattr__(self, name: str) -> int | None:
        if name in _PLACES:
            return self._places.get(name)
        raise AttributeError(name)

    def __setattr__(self, name: str, value: object) -> None:
        raise AttributeError(f"Coords are read-only ({name})")

    def __delattr__(self, name: str) -> None:
        raise AttributeError(f"Coords are read-only ({name})")

    def __getitem__(self, key: str) -> int:
        return self._places[key]

    def __iter__(self) -> Iterator[str]:
        return iter(self._places)

    def __len__(self) -> int:
        return len(self._places)

    def __hash__(self) -> int:
        return hash(tuple(self._places.items()))

    def __reduce__(self):  # pickled by its coordinates (a rank's result sent back to the test's process)
        return Coords, (dict(self._places),)

    def __repr__(self) -> str:
        return "Coords(" + ", ".join(f"{k}={v}" for k, v in self._places.items()) + ")"

    def with_places(self, **places: int) -> Coords:
        return Coords({**self._places, **places})



def launched_world_size() -> int:
    """World size without any communication: the live group's, else the launcher's environment (torchrun's,
    srun's or mpirun's: ``nodes.launch_environment``)."""
    if dist.is_available() and dist.is_initialized():
        return dist.get_world_size()
    return launch_environment().world_size


def init_distributed(*, device: torch.device, timeout: datetime.timedelta) -> None:
    """Join the default process group unless the caller already has.

    Under torchrun/accelerate the rendezvous comes from the environment. A lone process with no
    launcher environment gets a private one-rank group on a free local port, so ``dp=tp=pp=1``
    works in a notebook too. On CUDA the device becomes this process's current one in either case.
    """
    # Every rank's current CUDA device must be its own before anything communicates: NCCL object
    # collectives and barriers run on the current device, which is cuda:0 on every rank otherwise.
    if device.type == "cuda":
        torch.cuda.set_device(device)
    if dist.is_initialized():
        return
    backend = backend_for(device)
    if backend == "nccl":
        # A rank blocked on a dead peer is ended by NCCL's watchdog when the group's timeout expires
        # (failure.py); torchrun sets the same, a plain launch would leave it to torch's default.
        os.environ.setdefault("TORCH_NCCL_ASYNC_ERROR_HANDLING", "1")
    # device_id binds the group to this rank's GPU at creation (eager NCCL init, no device guessing)
    bound = {"device_id": device} if device.type == "cuda" else {}
    launch = launch_environment()
    if launch.launcher in SELF_STARTED and launch.world_size > 1 and "MASTER_ADDR" not in os.environ:
        raise ValueError(f"{launch.launcher} started {launch.world_size} ranks and MASTER_ADDR is not set: the ranks "
                         f"have nowhere to meet; export MASTER_ADDR (the first node's address) and MASTER_PORT in "
                         f"the batch script, or start one torchrun a node")
    if "MASTER_ADDR" in os.environ and "RANK" not in os.environ and launch.launcher in SELF_STARTED:
        # srun or mpirun started every rank itself (no torchrun): their own variables give the rank and the world
        dist.init_process_group(backend=backend, timeout=timeout, rank=launch.rank, world_size=launch.world_size,
                                init_method=f"tcp://{os.environ['MASTER_ADDR']}:{os.environ.get('MASTER_PORT', '29500')}",
                                **bound)
        return
    if "MASTER_ADDR" in os.environ and "RANK" in os.environ:
        store = _restart_store(timeout)
        if store is not None:
            dist.init_process_group(backend=backend, timeout=timeout, store=store, rank=int(os.environ["RANK"]),
                                    world_size=int(os.environ["WORLD_SIZE"]), **bound)
            return
        dist.init_process_group(backend=backend, timeout=timeout, **bound)
        return
    dist.init_process_group(backend=backend, init_method=f"tcp://127.0.0.1:{free_local_port()}", rank=0, world_size=1,
                            timeout=timeout, **bound)


def _restart_store(timeout: datetime.timedelta) -> dist.Store | None:
    """The rendezvous store of this attempt of a torchrun job, where torchrun's agent keeps one store for
    every attempt (None: the launcher's own rendezvous serves).

    torchrun's agent hosts the TCP store at MASTER_ADDR:MASTER_PORT once and keeps it when
    ``--max-restarts`` restarts the workers; ``init_process_group`` only prefixes it with the group's
    name, so a restarted worker can read the dead workers' addresses and gloo fails ("Connection
    refused") or hangs (torch 2.11 and 2.13; pytorch/pytorch#135712). Keys under the attempt's number
    (TORCHELASTIC_RESTART_COUNT) are this attempt's alone. The count is per agent and a membership
    change does not raise it, so this serves one node; several nodes rendezvous with c10d and
    TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1, where rank 0 hosts a new store each attempt (docs/elastic.md).
    """
    attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT")
    shared = os.environ.get("TORCHELASTIC_USE_AGENT_STORE", "").lower() == "true"
    one_node = os.environ.get("LOCAL_WORLD_SIZE") == os.environ.get("WORLD_SIZE")
    if attempt is not None and shared and not one_node and int(os.environ.get("TORCHELASTIC_MAX_RESTARTS", "0")) > 0:
        warnings.warn("torchrun restarts these workers over several nodes on the agent's store, where a restarted "
                      "worker can read the previous attempt's addresses and hang; launch with "
                      "TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1 and --rdzv-backend c10d (docs/elastic.md)", stacklevel=3)
    if attempt is None or not shared or not one_node:
        return None
    client = dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), is_master=False, timeout=timeout)
    return dist.PrefixStore(f"qn_hf/attempt_{attempt}", client)


def build_mesh(dims: ParallelDims, *, device: torch.device, timeout: datetime.timedelta | None = None) -> DeviceMesh:
    """A 3-D (4-D with cp) mesh over all ranks laid out by ``rank_grid``; every rank must call this (it creates
    the sub-groups).

    With ``timeout``, every dp/pp/tp group gets it: ``DeviceMesh`` would give its groups torch's default
    (30 minutes for gloo) whatever the default group's timeout is, so a rank that stops answering would
    hold the others in a tp all-reduce or a pipeline receive for half an hour.
    """
    grid = rank_grid(dims)
    if timeout is None:
        return DeviceMesh(device.type, grid, mesh_dim_names=dims.names)
    groups = []
    for name in dims.names:  # every group along each dim, as the layout lists them
        groups.append(member_groups(rank_groups(dims)[name], timeout=timeout))
    return DeviceMesh.from_group(groups, device.type, mesh=grid, mesh_dim_names=dims.names)


def check_mesh(mesh: DeviceMesh, dims: ParallelDims) -> None:
    """A caller-supplied mesh must have our dim names and the requested degrees."""
    if mesh.mesh_dim_names != dims.names:
        raise ValueError(f"mesh dims {mesh.mesh_dim_names} must be {dims.names}")
    shape = tuple(mesh.mesh.shape)
    if shape != dims.shape:
        raise ValueError(f"mesh shape {shape} does not match {dims.names} = {dims.shape}")


@dataclass(frozen=True)
class Groups:
    """Every process group this rank belongs to, its mesh coordinates and its pipeline neighbours. ``roles`` holds
    this rank's group of each role built (``config/layout.GroupRole``); ``of(role)`` hands one out, and each role
    reads as an attribute named as its value (``groups.dp``, ``groups.replicas``...): None where none was built.

    ``replicas`` (the gradient sum) is ``dp`` when cp=1. ``ep`` joins the ranks that share out one model's experts
    and ``experts`` those holding the same experts (both None when ep=1; ``experts`` also when only one rank
    holds each expert block). ``kv`` joins the tp ranks that hold the same replicated KV-head shard (None when
    nothing is replicated that way); ``tie`` joins the first and last stage of this (dp, tp) when they hold the
    two copies of a tied weight; ``dp_shard`` the dp_shard (x cp) ranks that shard one copy of the weights;
    ``host`` is gloo over the world, for what the hosts agree on (build_groups says why). ``peers`` names the
    neighbouring stages with the same (dp, cp, tp), around a ring (the last stage's next is the first, which
    interleaved schedules use), with one two-rank group per direction of each link (``pipeline/p2p.py`` says
    why)."""

    mesh: DeviceMesh
    coords: Coords  # this rank's place on the mesh
    # this rank's group of each role it holds, read-only (a role absent: none built, or, for the expert sum where
    # only one rank holds each expert block, none this rank sums with)
    roles: Mapping[GroupRole, ProcessGroup] = field(hash=False)
    peers: Peers
    owned: tuple[ProcessGroup, ...] = ()  # the groups build_groups created (a caller's mesh and the world not)
    shard_mesh: DeviceMesh | None = None  # FSDP's mesh: ("dp_shard",), or ("dp_replicate", "dp_shard") to hybrid-shard
    expert_shard_mesh: DeviceMesh | None = None  # FSDP's mesh for the experts: their replicas (dp_shard > 1, ep > 1)
    nodes: Nodes | None = None  # the job's nodes, as every rank agreed in build_groups

    def of(self, role: GroupRole) -> ProcessGroup | None:
        """This rank's group of ``role`` (``config/layout.GroupRole``): None where no group of it was built."""
        if role is GroupRole.SHARD_REPLICAS:  # hybrid sharding's: the replicate dim of FSDP's 2-D mesh
            return self.shard_mesh.get_group(0) if self.shard_mesh is not None and self.shard_mesh.ndim == 2 else None
        return self.roles.get(role)

    @property
    def prev(self) -> int | None:
        return self.peers.prev

    @property
    def next(self) -> int | None:
        return self.peers.next

    def release(self) -> None:
        """Destroy the groups ``build_groups`` created (each gloo group keeps threads, one a TCP loop,
        and NCCL communicators hold device memory until destroyed). Every rank calls it together; the
        barrier first, so that no rank destroys a group another may still be receiving on."""
        dist.barrier()
        for group in self.owned:
            dist.destroy_process_group(group)


for _role in GroupRole:  # each role read as an attribute named as its value: groups.tp, groups.replicas, ...
    assert not hasattr(Groups, _role.value), _role  # a role never hides a field
    setattr(Groups, _role.value, property(lambda self, role=_role: self.of(role),
                                          doc=f"``of(GroupRole.{_role.name})``"))
del _role


def build_groups(dims: ParallelDims, *, device: torch.device, timeout: datetime.timedelta,
                 mesh: DeviceMesh | None = None, kv_replicas: int = 1, tied_stages: bool = False) -> Groups:
    """Every group this rank needs, built in one place; every rank must call it with the same
    arguments (``new_group`` is collective over the whole world, even for ranks outside a group).

    ``mesh`` reuses a caller's ("dp", "pp", "tp") mesh; ``kv_replicas`` > 1 asks for the groups of
    consecutive tp ranks that hold the same KV heads; ``tied_stages`` for the first-last stage
    groups that sum a tied weight's gradients."""
    owned: list[ProcessGroup] = []
    if mesh is None:
        mesh = build_mesh(dims, device=device, timeout=timeout)
        owned += [mesh.get_group(name) for name in dims.names]
    check_mesh(mesh, dims)
    # [dp, pp, cp, tp] global ranks (cp of size 1 when absent), whatever the mesh's own layout
    grid = mesh.mesh.reshape([getattr(dims, spec.axis.value) for spec in MESH_AXES])
    # the groups beside the mesh's axes, as config/layout.py lists them for qn_hf's own layout; a caller's mesh
    # may number its ranks otherwise, so its own grid is read through the same positions
    listed = _on_grid(rank_groups(dims), dims, grid)
    # each mesh axis's group is the role named as the axis (dp: BATCH, tp: TENSOR, ...), a coordinate 0 unnamed
    roles = {GroupRole(name): mesh.get_group(name) for name in dims.names}
    coords = Coords({spec.axis.value: mesh.get_local_rank(spec.axis.value) if spec.axis.value in dims.names else 0
                     for spec in MESH_AXES})
    if kv_replicas > 1:  # consecutive ranks of each tp group
        roles[GroupRole.KV_COPIES] = _member_of([row[i : i + kv_replicas] for row in listed[GroupRole.TENSOR]
                                                 for i in range(0, dims.tp, kv_replicas)], timeout, owned)
    if tied_stages:  # the first and last stage of each pipeline
        roles[GroupRole.TIED_STAGES] = _member_of([[ring[0], ring[-1]] for ring in listed[GroupRole.STAGES]],
                                                  timeout, owned)
    roles[GroupRole.GRADIENT_SUM] = (_member_of(listed[GroupRole.GRADIENT_SUM], timeout, owned) if dims.cp > 1
                                     else roles[GroupRole.BATCH])
    if dims.ep > 1:
        roles[GroupRole.TOKEN_EXCHANGE] = _member_of(listed[GroupRole.TOKEN_EXCHANGE], timeout, owned)
        experts = _member_of(listed[GroupRole.EXPERT_SUM], timeout, owned)  # every rank creates them, even unused
        if dims.expert_replicas > 1:
            roles[GroupRole.EXPERT_SUM] = experts
        flat = coords.dp * dims.tp + coords.tp  # this rank's place in its stage's dp x tp grid
        per_grid = dims.dp * dims.tp // dims.ep  # holders of a block in one cp rank's grid
        coords = coords.with_places(ep=flat % dims.ep, expert_replica=coords.cp * per_grid + flat // dims.ep)
    shard_mesh = expert_shard_mesh = None
    if dims.dp_shard > 1:
        roles[GroupRole.WEIGHT_SHARD], shard_mesh = _shard_groups(grid, listed, coords, dims, device, timeout, owned)
        if GroupRole.EXPERT_SUM in roles:
            expert_shard_mesh = _one_dim_mesh(roles[GroupRole.EXPERT_SUM], "expert_replicas", device)
    # gloo over the world, for what the hosts agree on before a step's collectives (step/agreement.py):
    # host memory, so agreeing never waits for the device's queue; its own group on a gloo world too,
    # so that its traffic is never taken for a mesh dim's that spans the world (comm_meter.py)
    roles[GroupRole.HOST] = host = dist.new_group(backend="gloo", timeout=timeout)
    owned.append(host)
    nodes = agreed_nodes(host)
    warn_groups_across_nodes(listed, dims, nodes)
    return Groups(mesh=mesh, coords=coords, roles=MappingProxyType(roles),
                  peers=_pipeline_peers(listed[GroupRole.STAGES], coords, device, timeout, owned),
                  owned=tuple(dict.fromkeys(g for g in owned if g is not dist.GroupMember.WORLD)),
                  shard_mesh=shard_mesh, expert_shard_mesh=expert_shard_mesh, nodes=nodes)


SHARD_MESH_DIMS = (Axis.DP_REPLICATE, Axis.DP_SHARD)


def _one_dim_mesh(group: ProcessGroup, name: str, device: torch.device) -> DeviceMesh:
    """A 1-D mesh over ``group`` (named after it: see ``_shard_groups``)."""
    ranks = torch.tensor(dist.get_process_group_ranks(group))
    return DeviceMesh.from_group(group, device.type, mesh=ranks, mesh_dim_names=(f"{name}.{group.group_name}",))


def _shard_groups(grid: torch.Tensor, listed: dict[str, list[list[int]]], coords: Coords, dims: ParallelDims,
                  device: torch.device, timeout: datetime.timedelta,
                  owned: list[ProcessGroup]) -> tuple[ProcessGroup, DeviceMesh]:
    """This rank's dp_shard group (``config/layout.shard_groups``) and FSDP's mesh: 1-D over it, or 2-D
    (replicate, shard) when dp_shard < dp. Made of groups built here, as ``build_mesh``'s, with the job's
    timeout."""
    shard = _member_of(listed[GroupRole.WEIGHT_SHARD], timeout, owned)
    mine = grid[:, coords.pp, :, coords.tp].reshape(dims.dp_replicate, dims.dp_shard * dims.cp)
    # DeviceMesh equality ignores its groups and DTensor's caches are keyed by it: a later mesh of the same
    # ranks (after pm.close() destroyed these groups) would get the dead groups. Group names keep them apart.
    names = tuple(f"{dim}.{shard.group_name}" for dim in SHARD_MESH_DIMS)
    if dims.dp_replicate == 1:
        return shard, DeviceMesh.from_group(shard, device.type, mesh=mine[0], mesh_dim_names=names[1:])
    replicate = _member_of(listed[GroupRole.SHARD_REPLICAS], timeout, owned)
    return shard, DeviceMesh.from_group([replicate, shard], device.type, mesh=mine, mesh_dim_names=names)


def _on_grid(groups: dict[str, tuple[tuple[int, ...], ...]], dims: ParallelDims,
             grid: torch.Tensor) -> dict[str, list[list[int]]]:
    """``groups`` (of qn_hf's own layout) with each rank replaced by the rank at the same place of ``grid``."""
    place = torch.empty(dims.world_size, dtype=torch.long)
    place[full_grid(dims).reshape(-1)] = grid.reshape(-1).long()
    return {kind: [place[list(g)].tolist() for g in lists] for kind, lists in groups.items()}


def _pipeline_peers(rings: list[list[int]], coords: Coords, device: torch.device, timeout: datetime.timedelta,
                    owned: list[ProcessGroup]) -> Peers:
    """This rank's neighbouring stages and its links (``rings``: the stages of each (dp, cp, tp), the layout's
    stage groups): one two-rank group per direction, warmed up before any step uses them
    (``pipeline/p2p.build_links``)."""
    stages = len(rings[0])
    if stages == 1:
        return Peers(prev=None, next=None)
    me = dist.get_rank()
    links = build_links(rings, device=device, timeout=timeout)
    owned.extend(links.values())
    ring = next(ring for ring in rings if me in ring)
    prev, next_ = ring[coords.pp - 1], ring[(coords.pp + 1) % stages]
    return Peers(prev=prev, next=next_, to_next=Link(next_, links[me, next_]), from_prev=Link(prev, links[prev, me]),
                 to_prev=Link(prev, links[me, prev]), from_next=Link(next_, links[next_, me]))


def _member_of(all_ranks: list[list[int]], timeout: datetime.timedelta,
               owned: list[ProcessGroup]) -> ProcessGroup | None:
    """Create every group in ``all_ranks`` (all ranks must) and return the one this rank is in (also
    added to ``owned``)."""
    mine = member_groups(all_ranks, timeout=timeout)
    if mine is not None:
        owned.append(mine)
    return mine
