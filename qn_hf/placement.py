"""How this rank's shard sits in the whole model: the one small value that everything downstream of
sharding (checkpoints, the Hugging Face export, the global gradient norm, the communication meter)
takes instead of the whole ``ParallelModel``.

A parameter is named by its HF name. Its global tensor is cut over tp as its ``ShardSpec`` says (no
spec: replicated over tp), lives on one pipeline stage (or, ``every_stage``, on each: Gemma 4's
per-layer embeddings; the first stage's copy is saved and counted), and is repeated on every dp (and cp) rank;
MoE experts under expert parallelism are cut over the ep group instead and repeated on the
``expert_replicas`` ranks holding the same block. A weight
tied across stages (GPT-2's ``wte``/``lm_head``) has two copies: the first stage's ``owner`` name is
the one saved and counted, the last stage's ``follower`` copy is skipped. Under dp_shard each rank of a
dp_shard group holds its rows of the shard, and under ZeRO-1 its piece of the optimizer data
(``Held``); which rank writes each distinct value to a checkpoint is ``ShardPlacement.writes``.
"""

from __future__ import annotations

import enum
from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass
from typing import Protocol

import torch
from torch import nn

from .comm import all_gather_tensors, flat_broadcast_
from .config.dims import ParallelDims
from .mesh import Coords, Groups
from .pipeline.split import PipelineTie
from .pipeline.standins import StandIn
from .tensor_parallel.shard import ShardSpec, over_experts


class Copies(enum.Enum):
    """Which ranks besides dp x cp hold the same copy of a parameter: the one classification the
    broadcast at start, the gradient buckets and sums, the gradient norm and the checkpoint writers ask for."""

    TP_REPLICATED = "the whole tensor on every tp rank (no spec)"
    KV_REPLICA = "the same KV-head shard on consecutive tp ranks (spec.replicas > 1)"
    SHARDED = "this tp rank's own shard"
    EXPERTS = "a block of experts over the ep group, repeated on the expert replicas instead of dp x cp"


class Held(enum.Enum):
    """How this rank holds its copy of a parameter (or of its optimizer state) among the ranks holding
    the same tp (or ep) shard: its dp x cp ranks, or for experts its expert replicas. What decides
    which of them writes it to a checkpoint (``ShardPlacement.writes``)."""

    WHOLE = "the whole shard, the same on each of those ranks"
    PIECES = "ZeRO-1: a flat piece of the shard's masters and optimizer state, each rank its own"
    ROWS = ("dp_shard: FSDP's rows of the shard, each rank of a dp_shard group its own, the other groups "
            "(dp_replicate) the same again; experts' rows are spread over their replicas, each its own")


@dataclass(frozen=True, eq=False)
class ShardPlacement:
    dims: ParallelDims
    groups: Groups
    specs: Mapping[str, ShardSpec | None]  # by HF parameter name; absent or None: replicated over tp
    ties: tuple[PipelineTie, ...]
    device: torch.device
    every_stage: frozenset[str] = frozenset()  # parameters held on every stage, gradients summed over pp

    @property
    def coords(self) -> Coords:
        return self.groups.coords

    @property
    def replica_rank(self) -> int:
        """This rank's place among the dp x cp ranks that hold the same shard (0 writes checkpoints)."""
        return self.coords.dp * self.dims.cp + self.coords.cp

    def spec(self, name: str) -> ShardSpec | None:
        return self.specs.get(name)

    def copies(self, name: str) -> Copies:
        spec = self.spec(name)
        if spec is None:
            return Copies.TP_REPLICATED
        if over_experts(spec):
            return Copies.EXPERTS
        return Copies.KV_REPLICA if spec.replicas > 1 else Copies.SHARDED

    def synchronize(self, model: nn.Module) -> None:
        """Make copies that must be equal exactly equal: what is replicated across tp (from tp rank 0),
        KV-head replicas (from the first replica), the last stage's copy of a tied weight (from the
        first stage), what every stage holds (from the first stage), everything else across dp x cp (from its first rank), and ep-sharded experts
        across the ranks holding the same block."""
        named = {n: p.data for n, p in model.named_parameters()}
        kinds = {n: self.copies(n) for n in named}
        groups = self.groups
        with torch.no_grad():
            flat_broadcast_([p for n, p in named.items() if kinds[n] is Copies.TP_REPLICATED], src_group_rank=0,
                            group=groups.tp)
            if groups.kv is not None:
                flat_broadcast_([p for n, p in named.items() if kinds[n] is Copies.KV_REPLICA], src_group_rank=0,
                                group=groups.kv)
            if groups.tie is not None:
                flat_broadcast_([named[n] for n in self.tied_names(named)], src_group_rank=0, group=groups.tie)
            if self.every_stage_names(named):
                flat_broadcast_([named[n] for n in self.every_stage_names(named)], src_group_rank=0, group=groups.pp)
            flat_broadcast_([p for n, p in named.items() if kinds[n] is not Copies.EXPERTS], src_group_rank=0,
                            group=groups.replicas)
            if groups.experts is not None:  # the ranks holding the same experts (dp x tp / ep of them)
                flat_broadcast_([p for n, p in named.items() if kinds[n] is Copies.EXPERTS], src_group_rank=0,
                                group=groups.experts)

    def shard_rank(self, spec: ShardSpec | None) -> int:
        """This rank's index among the ranks ``spec`` splits a tensor over (its tp rank, or for
        experts its place in the ep group)."""
        return self.coords.ep if over_experts(spec) else self.coords.tp

    def writes(self, name: str, held: Held = Held.WHOLE) -> bool:
        """Whether this rank writes its copy of parameter ``name`` (or of its optimizer state shaped like
        it), held as ``held``, to a checkpoint: every distinct value once. Over tp, the first of KV-head
        replicas (tp rank 0 for a tensor replicated over tp). Over the ranks holding the same shard:
        ``WHOLE`` dp (x cp) rank 0, for experts the first of the ranks holding the same block;
        ``PIECES`` each rank its own piece (besides that first one); ``ROWS`` the ranks of the first
        dp_shard group (``mesh.py`` cuts the dp ranks into groups of ``dp_shard`` consecutive ones),
        for experts every holder (their FSDP groups span the expert replicas, each holding its own rows)."""
        spec = self.spec(name)
        # the one of the ranks holding copies of this shard over tp (KV-head replicas) or ep that writes it
        shard_writer = spec.writes(self.shard_rank(spec)) if spec is not None else self.coords.tp == 0
        if held is Held.ROWS:
            return shard_writer and (over_experts(spec) or self.coords.dp // self.dims.dp_shard == 0)
        whole = self.coords.expert_replica == 0 if over_experts(spec) else self.replica_rank == 0 and shard_writer
        return whole or (held is Held.PIECES and shard_writer)

    def writes_scalar(self, name: str, held: Held, *, holds_first: bool) -> bool:
        """Whether this rank writes a scalar of ``name``'s optimizer state (Adam's ``step``), the same in
        every copy, piece and row range: once, by the writer of the first shard (tp rank 0, or for
        experts the first block's) whose piece or rows hold the first element (``holds_first``)."""
        return self.shard_rank(self.spec(name)) == 0 and holds_first and self.writes(name, held)

    def may_write(self, *, pieces: bool) -> bool:
        """Whether this rank may write some tensor of a checkpoint (``writes``), so takes part in saving:
        dp (x cp) rank 0, the first holder of each expert block, every rank where some parameter is held
        in ZeRO-1 ``pieces``, and every rank under dp_shard (the first group's ranks their rows; the
        others record which parameters they hold, as every writer does, and write no tensor)."""
        return self.replica_rank == 0 or pieces or self.coords.expert_replica == 0 or self.dims.dp_shard > 1

    def whole(self, name: str, tensor: torch.Tensor) -> torch.Tensor:
        """This rank's shard of ``name`` made whole: gathered over the ranks its spec splits it
        over (tp, or the ep group for experts). A collective for those ranks; a replicated tensor
        comes back as it is."""
        spec = self.spec(name)
        if spec is None:
            return tensor
        return spec.unshard(all_gather_tensors(tensor, group=self.groups.ep if over_experts(spec) else self.groups.tp))

    def is_follower(self, name: str) -> bool:
        """The last stage's copy of a weight tied across stages, or a later stage's copy of one held on
        every stage: saved and counted by its owner on the first stage."""
        return name in self.every_stage and self.coords.pp > 0 or any(tie.follower == name for tie in self.ties)

    def tied_names(self, names: Iterable[str]) -> list[str]:
        """Of ``names``, the two copies of each weight tied across the first and last stage (summed over
        ``groups.tie``), in the ties' order: the same on both stages."""
        names = set(names)
        return [n for tie in self.ties for n in (tie.owner, tie.follower) if n in names]

    def every_stage_names(self, names: Iterable[str]) -> list[str]:
        """Of ``names`` (in the model's order, the same on every stage), those held on every stage
        (summed over ``groups.pp``); none at pp=1."""
        return [n for n in names if n in self.every_stage] if self.dims.pp > 1 else []

    def surface_refusal(self, name: str) -> str:
        """Why the parallel model has no ``name`` of the Hugging Face model's own (``pm.get_input_embeddings()``,
        ``pm.num_parameters()``): the module's answers are this rank's shard's, and reached as such."""
        mesh = " ".join(self.dims.in_use())
        return (f"ParallelModel has no {name!r}: pm.module.{name} is the Hugging Face model's, which on this rank "
                f"holds its part of the model ({mesh or 'one rank'}): its parameters, their shapes and counts are this "
                f"rank's; the whole model is what pm.save_pretrained(dir) writes")

    def owner(self, name: str) -> str:
        """The name a parameter is saved under: its own, or a tied copy's owner."""
        return next((tie.owner for tie in self.ties if tie.follower == name), name)


class Placed(Protocol):
    """What the functions that take a ``ParallelModel`` read of it: its parameters, gradients and
    placement."""

    @property
    def placement(self) -> ShardPlacement: ...

    @property
    def grads_split_over_dp(self) -> bool: ...

    @property
    def expert_grads_split(self) -> bool: ...

    def named_parameters(self) -> Iterator[tuple[str, nn.Parameter]]: ...

    def named_grads(self) -> Iterator[tuple[str, torch.Tensor]]: ...


def materialize(model: nn.Module, device: torch.device) -> None:
    """Allocate this rank's (already sharded) meta tensors; the checkpoint fills the parameters.
    Non-persistent buffers (rotary frequencies) are in no checkpoint: HF's own init recomputes them."""
    model.to_empty(device=device)
    init = getattr(model, "_init_weights", None)
    with torch.no_grad():
        for module in model.modules():
            if hasattr(module, "reset_buffers"):  # a parallel layer that keeps a replaced module's buffers
                module.reset_buffers()
            elif module._non_persistent_buffers_set and not isinstance(module, StandIn):
                if init is None:
                    raise ValueError(f"{type(module).__name__} has non-persistent buffers and the model no _init_weights")
                init(module)
