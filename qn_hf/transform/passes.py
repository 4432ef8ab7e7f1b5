"""The passes that make a model parallel, in place and in order: each says when it applies, what it
reads and makes (fields of ``Build``) and why it runs where it does. ``parallelize`` runs them after
every check has passed and the process groups exist."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
from torch import nn

from ..config.options import Dispatch, Offload
from ..config.parallel_config import ParallelConfig
from ..context_parallel.apply import AttentionSwitch, apply_context_parallel
from ..context_parallel.host_masks import HostMasks, apply_host_masks, host_masks_serve
from ..context_parallel.ring_attention import PieceLayout
from ..data_parallel.batch_statistics import batch_statistics_layers, sync_batch_statistics
from ..data_parallel.precision import apply_mixed_precision
from ..data_parallel.sharded import ShardedParameters
from ..expert_parallel.apply import apply_expert_parallel, sharded_experts
from ..expert_parallel.dispatch import ExpertRoute, GatherSwitch
from ..failure import raise_together
from ..memory.offload import ActivationOffload
from ..memory.recompute import apply_recompute
from ..mesh import Coords, Groups
from ..pipeline.split import StagePlan, on_every_stage
from ..pipeline.stage import StageModules, apply_stage
from ..pipeline.standins import StandIn
from ..pipeline.weight_grad import WeightGradQueue, make_deferrable
from ..placement import ShardPlacement, materialize
from ..policies.body import repeated_blocks
from ..policies.tp_plan import TpPlan
from ..step.compile import apply_compile
from ..tensor_parallel.apply import VocabShard, apply_tp_plan
from ..tensor_parallel.rng import RngStreams, draws_in_training, stream_seeds
from ..tensor_parallel.sequence_hooks import SequenceParallelSwitch, apply_sequence_parallel, sequence_wire
from ..tensor_parallel.sequence_parallel import final_norm, regathers
from ..tensor_parallel.shard import ShardSpec


@dataclass
class Build:
    """What the passes share: the model they change in place, what they start from (the first block
    of fields) and what earlier passes made for later ones (the second)."""

    model: nn.Module
    config: ParallelConfig
    plan: TpPlan
    stage_plan: StagePlan
    groups: Groups
    device: torch.device
    checkpoint: str | None
    seed: int | None
    cp_layout: PieceLayout  # which pieces of each sequence the cp ranks hold
    precision: torch.dtype | None
    expert_specs: dict[str, ShardSpec] = field(default_factory=dict)
    final: nn.Module | None = None  # the last stage's final norm (sequence parallelism gathers after it)
    stage: StageModules | None = None
    specs: dict[str, ShardSpec | None] = field(default_factory=dict)
    vocab: VocabShard | None = None
    placement: ShardPlacement | None = None
    rng: RngStreams | None = None
    weights: WeightGradQueue | None = None
    deferred: list[str] = field(default_factory=list)
    sp_switch: SequenceParallelSwitch | None = None
    attention_switch: AttentionSwitch | None = None
    host_masks: HostMasks | None = None  # masks decided on the host at cp=1 (context_parallel/host_masks.py)
    gather_switch: GatherSwitch | None = None  # expert_dispatch="all_gather": on while a step runs (dispatch.py)
    sharded: ShardedParameters | None = None
    offload: ActivationOffload | None = None  # offload="activations": the blocks' saved inputs held on the host


@dataclass(frozen=True)
class Pass:
    """One in-place change of the model: when it applies, what it reads and makes (``Build`` fields),
    and why it runs where it does in ``PASSES``. ``run`` works on this rank alone; ``exchange``, where
    a pass has one, talks to other ranks and runs after ``run``, once every rank has said that every
    pass so far succeeded on it (``run_passes``)."""

    name: str
    applies: Callable[[Build], bool]
    run: Callable[[Build], None] | None
    needs: tuple[str, ...]
    makes: tuple[str, ...]
    why_here: str
    exchange: Callable[[Build], None] | None = None


def run_passes(b: Build) -> None:
    """Run each pass that applies, in order, and raise a failure of any rank on every rank alike.

    The passes are rank-dependent (a stage cuts its own blocks, reads its own layers' config, shards
    its own rows), so one rank can fail where another does not; the others would then wait in the next
    collective until the timeout, with no word of the cause, and a launcher ends them with SIGTERM.
    So a rank that fails keeps the error and runs no further pass; before each exchange and after the
    last pass, every rank gathers every rank's outcome (one small all-gather on the hosts' group) and
    all raise the same error if any failed: a failing rank never skips a collective the others enter.
    A failure inside an exchange is one of communication, which the groups' timeout bounds."""
    failed: tuple[str, Exception] | None = None
    for step in PASSES:
        try:
            if failed is None and step.applies(b) and step.run is not None:
                step.run(b)
        except Exception as error:  # noqa: BLE001 -- every kind must reach the other ranks
            failed = (step.name, error)
        if step.exchange is not None:  # every rank agrees here, whether the pass applies or not
            _together(b, failed)
            if step.applies(b):
                step.exchange(b)
    _together(b, failed)


def _together(b: Build, failed: tuple[str, Exception] | None) -> None:
    try:
        raise_together(failed, group=b.groups.host)
    except Exception:
        b.groups.release()  # every rank raises here together: the groups go, as ``close`` would take them
        raise


def _context_parallel(b: Build) -> None:
    b.attention_switch = apply_context_parallel(b.model, group=b.groups.cp, layout=b.cp_layout)


def _host_masks(b: Build) -> None:
    if host_masks_serve(b.model, b.plan):  # else transformers' own mask code, as the plain model runs it
        b.host_masks = b.attention_switch = apply_host_masks(b.model)


def _cast(b: Build) -> None:
    apply_mixed_precision(b.model, b.precision)


def _expert_parallel(b: Build) -> None:
    experts = next(iter(sharded_experts(b.model).values())).num_experts
    # under sp the MoE blocks take this rank's slice, except while generate turns off the (later-made) switch
    split = (lambda: b.sp_switch.on) if b.plan.sequence_parallel else None
    if b.config.expert_dispatch is Dispatch.ALL_GATHER:
        b.gather_switch = GatherSwitch()
    route = ExpertRoute(experts=experts, ep=b.config.dims.ep, group=b.groups.ep, tp=b.groups.tp, tokens_split=split,
                        gathering=b.gather_switch.gathering if b.gather_switch else None)
    b.expert_specs = apply_expert_parallel(b.model, route=route, ep_rank=b.groups.coords.ep)


def _stage_cut(b: Build) -> None:
    last = b.groups.coords.pp == b.config.dims.pp - 1
    b.final = final_norm(b.model, b.stage_plan) if last else None
    b.stage = apply_stage(b.model, b.stage_plan, stage=b.groups.coords.pp)
    b.plan = b.plan.only(lambda name: _on_this_stage(b.model, name))


def _tensor_parallel(b: Build) -> None:
    b.specs, b.vocab = apply_tp_plan(b.model, b.plan, tp_rank=b.groups.coords.tp, group=b.groups.tp)
    b.specs.update({n: s for n, s in b.expert_specs.items() if n in b.specs})  # this stage's experts
    b.placement = ShardPlacement(dims=b.config.dims, groups=b.groups, specs=b.specs, ties=b.stage_plan.ties,
                                 device=b.device,
                                 every_stage=frozenset(n for n, _ in b.model.named_parameters()
                                                       if on_every_stage(b.stage_plan, n.rpartition(".")[0])))


def _sequence_parallel(b: Build) -> None:
    b.sp_switch = apply_sequence_parallel(b.model, plan=b.plan, stage_plan=b.stage_plan, stage=b.groups.coords.pp,
                                          final=b.final, group=b.groups.tp,
                                          regather=regathers(b.config.recompute) and not b.config.compile)
    b.stage.wire = sequence_wire(b.groups.tp)


def _place_on_device(b: Build) -> None:
    if b.checkpoint is not None and any(p.is_meta for p in b.model.parameters()):
        materialize(b.model, b.device)
    else:
        b.model.to(b.device)


def _synchronize(b: Build) -> None:
    b.placement.synchronize(b.model)


def _dropout_seed(b: Build) -> None:
    """Rank 0's seed, where none was given, on every rank."""
    if b.seed is None:
        shared = torch.tensor([torch.initial_seed() % (2**62)], dtype=torch.int64, device=b.device)
        dist.broadcast(shared, src=0)
        b.seed = int(shared.item())


def _dropout_streams(b: Build) -> None:
    b.rng = _install_rng_streams(b.model, b.plan, b.groups.coords, b.device, b.seed, replica=b.placement.replica_rank)


def _recompute(b: Build) -> None:
    b.offload = ActivationOffload() if b.config.offload is Offload.ACTIVATIONS else None
    for layers in _held_lists(b):
        apply_recompute(b.model, recompute=b.config.recompute, layers=layers, rng=b.rng, offload=b.offload)


def _held_lists(b: Build) -> list[str]:
    """The lists of blocks this stage holds blocks of (an encoder-decoder stage holds one of its two)."""
    return [name for name in b.stage_plan.block_lists if isinstance(_module_or_none(b.model, name), nn.ModuleList)]


def _module_or_none(model: nn.Module, name: str) -> nn.Module | None:
    try:
        return model.get_submodule(name)
    except AttributeError:
        return None


def _split_backward(b: Build) -> None:
    b.weights = WeightGradQueue()
    b.deferred = make_deferrable(b.model, queue=b.weights, skip=b.stage_plan.heads)


def _batch_statistics(b: Build) -> None:
    sync_batch_statistics(b.model, b.groups.dp)


def _shard_data_parallel(b: Build) -> None:
    # a stage's own blocks under a pipeline; else every stack's repeated blocks (an encoder's and a
    # decoder's, a vision and a text tower's), the whole model being the root group without any
    held = ([block for layers in _held_lists(b) for block in b.model.get_submodule(layers)] if b.config.dims.pp > 1
            else None)
    blocks = repeated_blocks(b.model, among=held)
    experts = list(sharded_experts(b.model).values()) if b.config.dims.ep > 1 else []
    b.sharded = ShardedParameters(b.model, mesh=b.groups.shard_mesh, blocks=blocks, compute_dtype=b.precision,
                                  experts=experts, expert_mesh=b.groups.expert_shard_mesh,
                                  pipelined=b.config.dims.pp > 1, gather=b.config.dp_shard_gather)
    b.stage.enter_at_top = b.config.dims.pp > 1  # FSDP's root hooks sit on the task model (sharded.py)


def _cast_here(b: Build) -> bool:
    """Mixed precision casts the model itself, unless FSDP casts as it gathers (dp_shard)."""
    return b.precision is not None and b.config.dims.dp_shard == 1


def _compile(b: Build) -> None:
    apply_compile(b.model, layers=b.stage_plan.layers)


def _always(b: Build) -> bool:
    return True


# The order is the code: ``tests/test_structure.py`` checks that every field a pass needs is one
# parallelize starts from or one an earlier pass makes.
PASSES: tuple[Pass, ...] = (
    Pass("context parallel", lambda b: b.config.dims.cp > 1, _context_parallel, ("model", "groups", "cp_layout"), ("attention_switch",),
         "before the stage cut and the tp patches: their config copies take the attention choice"),
    Pass("host masks", lambda b: b.config.dims.cp == 1, _host_masks, ("model", "plan"), ("attention_switch", "host_masks"),
         "as context parallel, which it stands in for at cp=1: before the cut, on the whole model's plan"),
    Pass("cast", _cast_here, _cast, ("model", "precision"), (),
         "before the stage cut: stand-ins take their dtype from the modules they replace"),
    Pass("expert parallel", lambda b: b.config.dims.ep > 1, _expert_parallel, ("model", "groups"),
         ("expert_specs", "gather_switch"),
         "before the stage cut, as cp: the stages' config copies take the experts choice"),
    Pass("stage cut", _always, _stage_cut, ("model", "stage_plan", "plan", "groups"), ("final", "stage", "plan"),
         "before tp: only this stage's modules are sharded; the final norm is found on the whole model"),
    Pass("tensor parallel", _always, _tensor_parallel, ("model", "plan", "groups", "expert_specs", "stage_plan"),
         ("specs", "vocab", "placement"), "after the cut, before anything that asks where a shard sits"),
    Pass("sequence parallel", lambda b: b.plan.sequence_parallel, _sequence_parallel,
         ("model", "plan", "stage_plan", "final", "stage", "groups"), ("sp_switch",),
         "after tp: its hooks sit on the parallel layers and the blocks between them"),
    Pass("place on device", _always, _place_on_device, ("model", "checkpoint", "device"), (),
         "after every shard: each rank allocates only its own (a meta model is materialized here)"),
    Pass("cast new parameters", _cast_here, _cast, ("model", "precision"), (),
         "again: sharding and materializing made new parameters (float32 gradients)"),
    Pass("synchronize replicas", lambda b: b.checkpoint is None, None, ("model", "placement"), (),
         "on the device, after the last new parameter; loading a checkpoint gives every replica the same bytes",
         exchange=_synchronize),
    Pass("dropout seed", _always, None, ("seed", "device"), ("seed",), "rank 0's seed for every stream, where none "
         "was given: with the exchanges, so that the last pass before it is agreed once", exchange=_dropout_seed),
    Pass("dropout streams", _always, _dropout_streams, ("model", "plan", "groups", "seed", "device", "placement"),
         ("rng",), "after the shards exist; the streams are seeded per replica, which the placement says"),
    Pass("recompute", lambda b: b.config.recompute is not None, _recompute, ("model", "stage_plan", "rng"), ("offload",),
         "after the dropout streams: a recomputed block replays their state"),
    Pass("batch statistics", lambda b: b.config.dims.dp > 1 and bool(batch_statistics_layers(b.model)),
         _batch_statistics, ("model", "groups"), (),
         "after the cut (a stage's own layers) and recomputation, before FSDP shards the layers and compile traces "
         "their forwards"),
    Pass("shard data parallel", lambda b: b.config.dims.dp_shard > 1, _shard_data_parallel,
         ("model", "groups", "stage_plan", "stage", "precision"), ("sharded",),
         "after every hook on the blocks (recomputation's included) and the replicas' synchronized weights: "
         "FSDP shards what is final"),
    Pass("split backward", lambda b: b.config.schedule.split_backward, _split_backward, ("model", "stage_plan"),
         ("weights", "deferred"), "zb_h1: after the layers are final, they queue their weight gradients for the W passes"),
    Pass("compile", lambda b: b.config.compile, _compile, ("model", "stage_plan"), (),
         "last: after every hook and recomputation is in place; each block compiles at its first call"),
)


def _on_this_stage(model: nn.Module, name: str) -> bool:
    """Whether the module ``name`` is real on this rank (not dropped, not a stage stand-in)."""
    module = model
    for part in name.split("."):
        module = getattr(module, part, None)
        if not isinstance(module, nn.Module) or isinstance(module, StandIn):
            return False
    return True


def _install_rng_streams(
    model: nn.Module, plan: TpPlan, coords: Coords, device: torch.device, seed: int, *, replica: int
) -> RngStreams:
    """Seeded per replica (dp x cp: different examples or tokens draw different masks), tp and pp."""
    streams = RngStreams(
        device=device, seeds=stream_seeds(base_seed=seed, dp_rank=replica, tp_rank=coords.tp, pp_rank=coords.pp)
    )
    if plan.tp > 1 and draws_in_training(model):  # else every draw comes from the shared stream (rng.py)
        streams.hook_regions(model, tp_local=plan.tp_rng_regions, shared=plan.shared_rng_regions)
    return streams
