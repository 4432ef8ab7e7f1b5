"""Per-rank memory and per-step communication of one (dp, tp, pp, cp, ep), from a ``meta``-device model.

The checks, the tp plan, the stage cut and the sharding are the ones ``parallelize`` runs (``check_parallel_config``,
``apply_tp_plan``, ``stage_of_module``), applied to a model without weights, so the parameter counts are exactly what
each rank holds (a tp rank of stage s; every tp rank of a stage is alike, and so is every dp and cp rank up to ZeRO's
padding, given for dp = cp rank 0; with the balanced piece layout every cp rank keeps and sends alike; under ep the
figures are tp rank 0's, the largest token share, at uniform routing: see ``expert_parallel/costs.py``).

What is modelled, per rank, for the settings ``parallelize`` and ``qn_hf.optimizer`` take (the degrees, ``zero``,
``mixed_precision``, ``recompute``, ``sequence_parallel``, ``loss_chunk_tokens``, ``offload``):

* weights, gradients and AdamW state (masters, moments, step counters), with ZeRO-1's sharding of the state over the
  dp x cp replicas by the buckets' own padding rule: see ``memory.py``; the fused MoE experts' parameters 1/ep each
  under ep, in gradient buckets of their own; under dp_shard FSDP's shards, gathered weights and whole gradients, the
  experts' in groups of their own over the ranks holding the same experts: see ``sharded.py``;
* activations: the bytes one microbatch keeps from its forward to its backward, measured on a meta-device forward in
  the compute dtype with the blocks checkpointed as ``recompute`` sets them (``trace.py``; sp's, ring attention's and
  ep's stand-ins, each dimension's own: ``tensor_parallel/sequence_costs.py``, ``context_parallel/costs.py``,
  ``expert_parallel/costs.py``), with what the stages and the loss add (``activations.py``), per chunk; a rank's
  peak over its schedule's action list (``pipeline/costs.py``: with zb_h1's W stash); under ``offload`` what the
  blocks' checkpoints hold on the host instead (``offloaded.py``);
* the schedule's bubble, timed on its action lists at per-op costs from the slowest rank's FLOPs (pipeline/costs.py);
* communication by group: ``traffic.py`` (ZeRO's, recomputation's repeated tp collectives, sp's, ring attention's,
  ep's all-to-alls and token gathers, float16's overflow flag).

Of what dies inside a step, a causal LM's loss's backward is (``loss_transient``: the largest at a long sequence);
not modelled: the rest (a block's backward, collective staging, an offloaded input in its copy), the head's second
forward under ``loss_chunk_tokens``, fragmentation, the CPU-side random states torch's checkpoint keeps; KV heads
replicated over tp count as split; routing imbalance under ep (uniform routing's figures)."""

from __future__ import annotations

import copy
from collections.abc import Callable, Sequence
from dataclasses import replace
from typing import TypeVar

import torch
from torch import nn
from transformers import PretrainedConfig

from ..checkpoint.layout import meta_model
from ..config.composition import check_composition
from ..config.features import Feature
from ..config.options import Dispatch, Recompute
from ..config.parallel_config import ParallelConfig
from ..config.sequence import sequence_split
from ..context_parallel.costs import cp_inputs
from ..data_parallel.buckets import bucket_size_bytes
from ..data_parallel.precision import GRAD_DTYPE
from ..expert_parallel.apply import expert_parameter_names
from ..expert_parallel.costs import moe_regions
from ..expert_parallel.routing_costs import check_loads
from ..pipeline.costs import bubble, op_costs, pipeline_timing, rank_peaks
from ..pipeline.split import StagePlan
from ..policies import resolve_policy
from ..policies.model_policy import ModelPolicy
from ..step.batch import check_model_inputs
from ..step.loss_chunks import chunk_count
from ..tensor_parallel.sequence_costs import StageEdges, stage_edges
from ..validation.checks import CheckedConfig, CheckMemo, check_parallel_config
from .activations import chunk_activations, kept_collectives, loss_transient, on_host, weight_stash
from .depth import Recorder
from .memory import RankState, bucket_layout, rank_state
from .params import LocalSizes, StageParams, stage_lookup, stage_params
from .results import MeshEstimate, MeshWork, StageEstimate
from .sharded import sharded_stage
from .sharded import units as fsdp_units
from .trace import Recording, Trace, example_inputs, record_microbatch, recording_model
from .traffic import StageGradients, stage_traffic
from .unmodelled import check_modelled, modelled_experts
from .work import deferred_linears, mesh_work

_T = TypeVar("_T")


class Planner:
    """Estimates for one model config at one microbatch shape, over any number of meshes.

    One pristine meta model serves every check (checks only read it), one traced forward per compute dtype,
    recompute mode and cp serves every mesh (shapes do not depend on the rest of the mesh, and each tp reads the
    same forward through its plan; with sequence parallelism they depend on the tp and the stage cut too, so one per
    tp and cut; under ep one per tp and ep), one sharded meta model per (tp, ep) gives the local parameter sizes
    (``params.py``) and one placement per stage cut, and a configuration's checks are run once for all its dp_shard
    (``_check``). ``dtype`` is the dtype the model is loaded in; ``mixed_precision`` (per estimate) casts its
    parameters as ``parallelize`` does."""

    def __init__(self, config: PretrainedConfig, *, seq_len: int, micro_batch_size: int,
                 dtype: torch.dtype = torch.float32, policy: ModelPolicy | None = None,
                 model_class: type | None = None, expert_loads: Sequence[Sequence[float]] | None = None) -> None:
        self.config = config
        self.model_class = model_class  # the class training runs (default: the one the config names)
        self.seq_len = seq_len
        self.micro_batch_size = micro_batch_size
        self.dtype = dtype
        self.policy = policy
        self.model = meta_model(config, cls=model_class).to(dtype)
        # resolved once (deriving a policy from transformers' plan reads the modeling source, most of
        # a check's time); a model it refuses is refused by every check, with the same message
        try:
            self._policy = resolve_policy(self.model, policy)
        except ValueError:
            self._policy = policy
        self.total_params = sum(p.numel() for p in self.model.parameters())
        self._traces: dict[tuple, Trace] = {}  # (tp, precision, recompute, edges, cp, ep, loaded experts)
        self._recordings: dict[tuple, Recording] = {}  # the same, with tp None where one forward serves every tp
        # (the configuration at dp_shard=1, the features it adds) -> what the checks gave
        self._checked: dict[tuple[ParallelConfig, frozenset[Feature]], CheckedConfig] = {}
        self._answers: dict[tuple, tuple[object, tuple]] = {}  # _kept's
        self._recorder = Recorder()  # records from three blocks where that gives the whole forward (depth.py)
        self._recording_models: dict[tuple, nn.Module] = {}  # (precision, experts in the loaded dtype) -> meta model
        self._memo = CheckMemo()  # each check's answer by the values it reads (the tp plan per tp, the cut per pp)
        self._placed: dict[tuple[int, int, StagePlan], StageParams] = {}  # (tp, ep, cut) -> stage_params
        self._experts = expert_parameter_names(self.model)
        # per (tp, ep): each parameter's elements and rows on a rank, the tp specs
        self._local_sizes = LocalSizes(config, dtype=dtype, cls=model_class, experts=self._experts)
        self.experts = modelled_experts(self.model)  # routed experts per layer ep may split (0: none)
        self._routed = sum(p.numel() for n, p in self.model.named_parameters() if n in self._experts)
        # per MoE layer and batch, the pairs each expert received (expert_parallel/routing_costs.py); None: uniform
        self.expert_loads = check_loads(expert_loads, self.experts) if expert_loads is not None else None
        self._deferrable: frozenset[str] | None = None

    def at_micro_batch_size(self, micro_batch_size: int) -> Planner:
        """This planner at another microbatch shape: the model, its checks, sharded sizes and stage placements shared
        (none depends on the microbatch), the traced forwards its own."""
        if micro_batch_size == self.micro_batch_size:
            return self
        other = copy.copy(self)
        other.micro_batch_size = micro_batch_size
        other._traces, other._recordings = {}, {}
        return other

    def _trace(self, plan, layers: str, *, precision: torch.dtype | None, recompute: str | None,
               edges: StageEdges | None, cp: int, ep: int, loaded_experts: bool = False, gather: bool = False) -> Trace:
        # Per tp: which modules a trace watches and which bytes it counts as split come from the plan (at tp=1 the
        # plan shards nothing). The forward itself depends on the plan only through its stand-ins, sequence
        # parallelism's and ep's: without them one recording serves every tp. ``loaded_experts``: the experts keep
        # the loaded dtype under mixed precision (what FSDP leaves alone is not cast: sharded.py), so they compute
        # in it. ``gather``: ep's all-gather dispatch (expert_dispatch="all_gather") stood in for
        key = (plan.tp, precision, recompute, edges, cp, ep, loaded_experts, gather)
        if key not in self._traces:
            recording = self._recording(plan, layers, precision=precision, recompute=recompute, edges=edges, cp=cp,
                                        ep=ep, loaded_experts=loaded_experts, gather=gather)
            self._traces[key] = recording.trace(plan, whole=moe_regions(self.model, plan) if ep > 1 else frozenset())
        return self._traces[key]

    def _recording(self, plan, layers: str, *, precision: torch.dtype | None, recompute: str | None,
                   edges: StageEdges | None, cp: int, ep: int, loaded_experts: bool, gather: bool) -> Recording:
        recorded = (None if edges is None and ep == 1 else plan.tp, precision, recompute, edges, cp, ep, loaded_experts,
                    gather)
        if recorded not in self._recordings:
            model = self.model
            if (precision, recompute, cp) != (None, None, 1):
                # a model of its own, one per dtype (the pristine one serves the checks): a recording leaves the model
                # as it found it (blocks' checkpointing off, stand-ins removed)
                model = self._recording_models.get((precision, loaded_experts))
                if model is None:
                    model = self._recording_models[(precision, loaded_experts)] = recording_model(
                        self.config, cls=self.model_class, dtype=self.dtype, precision=precision,
                        loaded_experts=loaded_experts)
            size = dict(micro_batch_size=self.micro_batch_size, seq_len=self.seq_len)  # one cp rank's under cp
            inputs = cp_inputs(**size, cp=cp) if cp > 1 else example_inputs(model, **size)
            self._recordings[recorded] = self._recorder.record(
                model, layers, lambda m: record_microbatch(m, plan, layers=layers, inputs=inputs, recompute=recompute,
                                                           edges=edges, cp=cp, ep=ep, gather=gather),
                shortened=edges is None)
        return self._recordings[recorded]

    def estimate(self, parallel: ParallelConfig, *, zero: bool = False, backend: str = "nccl",
                 held_over: int | None = None) -> MeshEstimate | None:
        """Estimate one mesh: ``parallel`` as ``parallelize`` takes it (dp_shard: ``sharded.py``); raises the
        ``ValueError`` ``parallelize`` (or, for a sequence length that sequence or context parallelism cannot split,
        its step; for ZeRO under ep, ``qn_hf.optimizer``) would raise for it. ``zero`` as ``qn_hf.optimizer`` takes
        it (with dp x cp = 1 it shards nothing); ``backend`` is the process group's (ZeRO's collectives differ on
        gloo, see traffic.py). ``held_over``: None where a rank holds more bytes than this before any activation
        (its state, FSDP's gathered weights and whole gradients), found before the traces and the schedule."""
        checked = self._check(parallel, zero=zero)
        plan, stage_plan = checked.tp_plan, checked.stage_plan
        dims = parallel.dims
        tp, pp, ep = dims.tp, dims.pp, dims.ep
        microbatches, schedule, recompute = parallel.microbatches, parallel.schedule, parallel.recompute
        virtual_stages, mbs = parallel.virtual_stages, self.micro_batch_size
        # (kept by what it reads: the experts, the plan (tp, ep; under sp the cut too), pp, the looped blocks)
        self._memo(("modelled", plan.tp, ep, pp, stage_plan.loop_count, plan.sequence_parallel and stage_plan),
                   lambda: check_modelled(self.model, model_type=self.config.model_type, plan=plan, ep=ep, stages=pp,
                                          loop_count=stage_plan.loop_count))
        # train_step's check of the batch, on a meta batch of this length (the trace's inputs)
        check_model_inputs(example_inputs(self.model, micro_batch_size=mbs, seq_len=self.seq_len), model=self.model,
                           loss=None, positions=plan.positions, sequence_split=sequence_split(
                               cp=dims.cp, tp=tp, sequence_parallel=plan.sequence_parallel))
        replicas, expert_replicas = dims.replicas, dims.expert_replicas
        zero_experts = zero and ep > 1 and expert_replicas > 1  # the experts' buckets split over their holders
        zero, precision = zero and replicas > 1, None if parallel.mixed_precision is None else parallel.mixed_precision.dtype
        _, specs, local_rows = self._local_sizes(plan, ep)
        rows = {**local_rows, **{tie.follower: local_rows[tie.owner] for tie in stage_plan.ties}}  # a later stage's own copy
        param_elem = (precision or self.dtype).itemsize  # FSDP keeps shards and gradients in the model's (sharded.py)
        grad_elem = (self.dtype if dims.dp_shard > 1 or precision is None else GRAD_DTYPE).itemsize

        stage_of = stage_lookup(stage_plan)
        placed = self._placement(plan, ep, stage_plan)
        on_stage, tied, every = [list(h) for h in placed.held], placed.tied, placed.every
        sharded = self._experts if ep > 1 else frozenset()  # in buckets of their own, over "experts"
        held_by = []  # per stage: its buckets, the experts' buckets, FSDP's figures, its state, the experts' parameters
        for s in range(pp):
            # the buckets and FSDP's figures of a stage, the same at every schedule and recomputation: kept
            dense = [p for p in on_stage[s] if p[0] not in sharded]
            buckets = self._kept(("buckets", s, ep > 1, grad_elem, parallel.bucket_mb, replicas if zero else 1, zero),
                                 (placed,), lambda: bucket_layout(
                                     dense, elem=grad_elem, bucket_bytes=bucket_size_bytes(parallel.bucket_mb),
                                     pad=replicas if zero else 1,
                                     separate=(frozenset(tied[s]), frozenset(every[s])) if zero else ()))
            experts = [p for p in on_stage[s] if p[0] in sharded]
            expert_buckets = self._kept(
                ("expert buckets", s, ep > 1, grad_elem, parallel.bucket_mb, expert_replicas if zero_experts else 1),
                (placed,), lambda: bucket_layout(experts, elem=grad_elem, bucket_bytes=bucket_size_bytes(parallel.bucket_mb),
                                                 pad=expert_replicas if zero_experts else 1))
            reduce_elem = grad_elem if precision is None else GRAD_DTYPE.itemsize
            groups = None if dims.dp_shard == 1 else self._kept(
                ("fsdp groups", s, dims.shard_width, expert_replicas, ep > 1), (placed, local_rows, stage_plan),
                lambda: fsdp_units(on_stage[s], rows, layers=stage_plan.layers, width=dims.shard_width,
                                   experts=sharded, expert_width=expert_replicas))
            fsdp = None if dims.dp_shard == 1 else self._kept(
                ("fsdp", s, dims, microbatches, parallel.dp_shard_gather, grad_elem, param_elem, reduce_elem, ep > 1),
                (placed, local_rows, stage_plan), lambda: sharded_stage(
                    groups, parallel=parallel, elem=grad_elem, compute_elem=param_elem, reduce_elem=reduce_elem))
            zero_sets = ([(buckets, replicas)] if zero else []) + (
                [(expert_buckets, expert_replicas)] if zero_experts else [])
            state = rank_state(on_stage[s], sharded=zero_sets, param_elem=param_elem, grad_elem=grad_elem,
                               mixed=precision is not None) if fsdp is None else RankState(
                weight_bytes=fsdp.weight_bytes, grad_bytes=fsdp.grad_bytes, master_bytes=0,
                moment_bytes=fsdp.moment_bytes, step_bytes=fsdp.step_bytes)
            held_by.append((buckets, expert_buckets, fsdp, state, experts))
        if held_over is not None and max(state.bytes + (fsdp.gathered_bytes + fsdp.accumulated_grad_bytes if fsdp else 0)
                                         for _, _, fsdp, state, _ in held_by) > held_over:
            return None
        traced = self._traced(parallel, plan, stage_plan)
        # the shapes and what a recomputation reruns come from the run without it, in the compute dtype (a
        # microbatch's shapes do not depend on the dtype), what is kept from the one with it
        base = self._trace(plan, stage_plan.layers, recompute=None, **traced)
        compute = self._trace(plan, stage_plan.layers, recompute=recompute, **traced)
        # the dispatch's sizes in the compute dtype, its reruns from the trace without recomputation
        experts_calls = tuple(replace(c, rerun=b.rerun, gather_rerun=b.gather_rerun)
                              for c, b in zip(compute.experts, base.experts))
        # per chunk, the same at every dp, dp_shard, microbatch count and schedule of this shape: kept
        loss_chunks = chunk_count(parallel.loss_chunk_tokens, rows=mbs, tokens=base.logits_rows)
        activations = self._kept(
            ("activations", param_elem, dims.cp, bool(loss_chunks)), (compute, base, plan, stage_plan),
            lambda: chunk_activations(self.model, kept=compute.kept, base=base, plan=plan, cp=dims.cp,
                                      stage_plan=stage_plan, act_elem=param_elem, loss_chunks=loss_chunks))
        activations, offloaded = on_host(activations, offloaded=parallel.offload and compute.offloaded,
                                         stage_plan=stage_plan, sequence_parallel=plan.sequence_parallel)
        transient = loss_transient(self.model, kept=compute.kept, base=base, plan=plan, stage_plan=stage_plan,
                                   chunk_tokens=parallel.loss_chunk_tokens, rows=mbs, act_elem=param_elem)
        if recompute is Recompute.SELECTIVE:
            collectives = self._kept(("collectives", param_elem), (base, plan, stage_plan),
                                     lambda: kept_collectives(base=base, plan=plan, stage_plan=stage_plan,
                                                              act_elem=param_elem))
            activations = [a + k for a, k in zip(activations, collectives)]
        deferred = self._deferred(stage_plan.heads) if schedule.split_backward else frozenset()
        work = self._work(parallel, base=base, placed=placed, stage_plan=stage_plan, deferred=deferred)
        stash = self._kept(("stash", deferred, param_elem), (base, plan, stage_plan),
                           lambda: weight_stash(deferred, base=base, plan=plan, stage_plan=stage_plan,
                                                act_elem=param_elem))
        grad_sum = set(plan.grad_sum)
        op_counts = [[0, 0] for _ in range(pp)]  # per stage: ops of one microbatch's forward, bytes they write
        for name, (count, whole_bytes, split_bytes) in base.ops.items():
            at = op_counts[stage_of(name)]
            at[0] += count
            at[1] += whole_bytes + split_bytes // tp
        stages = []
        for s, (buckets, expert_buckets, fsdp, state, experts) in enumerate(held_by):
            kv = {n: numel for n, numel in on_stage[s] if (spec := specs.get(n)) is not None and spec.replicas > 1}
            summed = {n: numel for n, numel in on_stage[s] if n in grad_sum}
            grads = StageGradients(buckets=buckets if replicas > 1 and dims.dp_shard == 1 else [],
                                   expert_buckets=expert_buckets if expert_replicas > 1 and dims.dp_shard == 1 else [],
                                   zero=zero, zero_experts=zero_experts, kv=kv, tied=tied[s], every=every[s],
                                   grad_sum=summed, pieces=fsdp.pieces if fsdp else None)
            comm = stage_traffic(s, parallel=parallel, plan=plan, trace=base, stage_of=stage_of, act_elem=param_elem,
                                 param_elem=param_elem, grad_elem=grad_elem, grads=grads, backend=backend,
                                 experts=experts_calls, kept=self._kept, loss_chunks=loss_chunks)
            comm.update(fsdp.comm if fsdp else {})
            others = set(stage_plan.heads) if s == pp - 1 else set()
            if s == 0:
                others |= {n for n, _ in stage_plan.first_only} | ({stage_plan.entry} if stage_plan.entry else set())
            chunks = stage_plan.chunks_of(s)
            w = work.stages[s]
            at = dict(stages=pp, microbatches=microbatches, schedule=schedule, virtual_stages=virtual_stages, stage=s)
            held, peak = rank_peaks(**at, kept=tuple(activations), stash=tuple(stash))
            stages.append(StageEstimate(
                stage=s, chunks=w.chunks, stacks=w.stacks, modules=tuple(sorted(others)), params=w.params,
                embedding_params=w.embedding_params,
                activation_bytes_per_microbatch=sum(activations[c] for c in chunks), in_flight=held.f_to_b,
                activation_bytes=peak,
                state=state, comm=comm, expert_params=w.expert_params,
                expert_grad_bytes=fsdp.expert_bytes if fsdp else sum(n for _, n in experts) * grad_elem,
                weight_stash_bytes_per_microbatch=sum(stash[c] for c in chunks), in_flight_w=held.f_to_w,
                chunk_activation_bytes=tuple(activations[c] for c in chunks),
                flops_per_microbatch=w.flops_per_microbatch, weight_grad_flops_per_microbatch=w.weight_grad_flops_per_microbatch,
                gathered_bytes=fsdp.gathered_bytes if fsdp else 0,
                accumulated_grad_bytes=fsdp.accumulated_grad_bytes if fsdp else 0,
                attention_flops_per_microbatch=w.attention_flops_per_microbatch,
                expert_flops_per_microbatch=w.expert_flops_per_microbatch,
                offloaded_bytes_per_microbatch=sum(offloaded[c] for c in chunks),
                host_bytes=rank_peaks(**at, kept=tuple(offloaded), stash=(0,) * len(offloaded))[1],
                transient_bytes=transient if s == pp - 1 else 0,
                param_tensors=len(on_stage[s]), ops_per_microbatch=op_counts[s][0], op_bytes_per_microbatch=op_counts[s][1]))
        slowest = max(stages, key=lambda e: e.flops_per_microbatch)
        costs = op_costs(compute=slowest.flops_per_microbatch, weight=slowest.weight_grad_flops_per_microbatch,
                         comm=0.0, recompute=recompute, schedule=schedule, virtual_stages=virtual_stages)
        timing = pipeline_timing(stages=pp, microbatches=microbatches, schedule=schedule,
                                 virtual_stages=virtual_stages, costs=costs)
        tokens = work.tokens_per_microbatch
        return MeshEstimate(parallel=parallel, micro_batch_size=self.micro_batch_size, seq_len=work.seq_len,
                            tokens_per_microbatch=tokens, total_params=self.total_params, stages=tuple(stages),
                            bubble=bubble(timing),
                            flops_per_step=float(work.flops_per_token * tokens * microbatches * dims.dp),
                            attention_flops_per_token=work.attention_flops_per_token,
                            layers=work.layers, boundary_bytes=base.boundary_numel * param_elem,
                            zero=zero or zero_experts, expert_flop_share=work.expert_flop_share,
                            expert_imbalance=work.expert_imbalance,
                            routing_measured=self.expert_loads is not None and ep > 1,
                            hidden_size=self.config.hidden_size, dtype=work.dtype)

    def work(self, parallel: ParallelConfig) -> MeshWork | None:
        """``parallel``'s compute for one microbatch (work.py: what ``cost.step_floor`` prices) without what ``estimate``
        adds: the checks' cut (raising what they refuse, ``estimate``'s first step), the stages' parameters, the
        tokens and routing of the forward recorded without recomputation (without sequence parallelism, without ep's
        stand-in: one for every tp and ep); None where it fails (``estimate`` says why)."""
        checked = self._check(parallel, zero=False)
        plan, stage_plan = checked.tp_plan, checked.stage_plan
        traced = self._traced(parallel, plan, stage_plan)
        traced = {**traced, "ep": 1, "loaded_experts": False, "gather": False} if traced["edges"] is None else traced
        try:
            base = self._recording(plan, stage_plan.layers, recompute=None, **traced)
        except ValueError:
            return None
        deferred = self._deferred(stage_plan.heads) if parallel.schedule.split_backward else frozenset()
        return self._work(parallel, base=base, placed=self._placement(plan, parallel.dims.ep, stage_plan),
                          stage_plan=stage_plan, deferred=deferred)

    def _traced(self, parallel: ParallelConfig, plan, stage_plan: StagePlan) -> dict:
        """``_trace``'s keywords for ``parallel`` but the recomputation. The trace splits the sequence as the stages do
        (raising, as they would, when tp does not divide it); the experts keep the loaded dtype under mixed precision
        where FSDP shards them whole (sharded.py)."""
        d = parallel.dims
        precision = None if parallel.mixed_precision is None else parallel.mixed_precision.dtype
        return dict(edges=stage_edges(self.model, stage_plan) if plan.sequence_parallel else None, cp=d.cp, ep=d.ep,
                    precision=precision,
                    loaded_experts=d.dp_shard > 1 and d.ep > 1 and d.expert_replicas == 1 and precision is not None,
                    gather=d.ep > 1 and parallel.expert_dispatch is Dispatch.ALL_GATHER)

    def _work(self, parallel: ParallelConfig, *, base: Trace | Recording, placed: StageParams, stage_plan: StagePlan,
              deferred: frozenset[str]) -> MeshWork:
        return mesh_work(parallel, model=self.model, config=self.config, base=base, placed=placed,
                         stage_plan=stage_plan, deferred=deferred, experts=self._experts,
                         micro_batch_size=self.micro_batch_size, total_params=self.total_params, routed=self._routed,
                         expert_loads=self.expert_loads, dtype=str(self.dtype).removeprefix("torch."))

    def _placement(self, plan, ep: int, stage_plan: StagePlan) -> StageParams:
        """The stages' parameters at this tp and ep (the same at every dp and dp_shard of a shape: kept)."""
        if (plan.tp, ep, stage_plan) not in self._placed:
            self._placed[(plan.tp, ep, stage_plan)] = stage_params(
                self.model, self._local_sizes(plan, ep)[0], stage_plan=stage_plan, stage_of=stage_lookup(stage_plan))
        return self._placed[(plan.tp, ep, stage_plan)]

    def _check(self, config: ParallelConfig, *, zero: bool) -> CheckedConfig:
        """``check_parallel_config``, the checks ``parallelize`` runs, their pass reused across dp_shard: after the
        composition table (the first of them, the only one dp_shard reaches), they read the model's structure under
        the other options (validation/checks.py; the degrees were checked as ``config`` was built), so a pass at one
        dp_shard holds at any other and only the table is asked again. A refusal is never reused."""
        extra = frozenset({Feature.ZERO}) if zero else frozenset()
        key = (replace(config, dims=replace(config.dims, dp_shard=1)), extra)
        if key in self._checked:
            check_composition(config.features | extra, config.values(model_type=self.config.model_type))
            return self._checked[key]
        self._checked[key] = check_parallel_config(self.model, config, policy=self._policy, extra=extra, memo=self._memo)
        return self._checked[key]

    def _kept(self, values: tuple, objects: tuple, compute: Callable[[], _T]) -> _T:
        """``compute()``'s answer, kept for the same ``values`` and the very same ``objects`` (traces,
        plans, cuts: by identity, each kept alive with the answer so that its identity stays its own)."""
        key = (*values, *map(id, objects))
        if key not in self._answers:
            self._answers[key] = (compute(), objects)
        return self._answers[key][0]

    def _deferred(self, heads: tuple[str, ...]) -> frozenset[str]:
        """The linears zb_h1 defers (work.deferred_linears), found once."""
        if self._deferrable is None:
            self._deferrable = deferred_linears(self.config, cls=self.model_class, dtype=self.dtype, heads=heads)
        return self._deferrable


def estimate_mesh(config: PretrainedConfig, parallel: ParallelConfig, *, seq_len: int, micro_batch_size: int,
                  dtype: torch.dtype = torch.float32, policy: ModelPolicy | None = None, zero: bool = False,
                  backend: str = "nccl") -> MeshEstimate:
    """Estimate one mesh (see ``Planner``); raises the ``ValueError`` ``parallelize`` would raise."""
    planner = Planner(config, seq_len=seq_len, micro_batch_size=micro_batch_size, dtype=dtype, policy=policy)
    return planner.estimate(parallel, zero=zero, backend=backend)

