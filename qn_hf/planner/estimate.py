"""Per-rank memory and per-step communication of one (dp, tp, pp), from a ``meta``-device model.

The checks, the tp plan, the stage cut and the sharding are the ones ``parallelize`` runs
(``check_parallel_config``, ``apply_tp_plan``, ``stage_of_module``), applied to a model without
weights, so the parameter counts are exactly what each rank holds. Communication follows what the
runtime sends, per group and step (a tp rank of stage s; every tp and dp rank of a stage is alike):

* tp: per microbatch, a forward all-reduce of each row-parallel output and vocab-parallel embedding
  output, a backward all-reduce of the input of each tp entry (attention, MLP) and of each column
  layer outside one (the vocab-parallel head), and the vocab-parallel loss's 3 floats per row.
* pp: per microbatch, the hidden state forward and its gradient backward to each neighbour (both
  directions counted on each rank), a 64-byte shape header per step, the 4-byte loss.
* dp: every local gradient once (in at most ceil(bytes / bucket) all-reduces), the 8-byte target
  count and the 4-byte loss. kv: replicated KV-head gradients when tp exceeds the KV heads.
  tie: a weight tied across the first and last stage.

Activation memory is what autograd saves per microbatch (see ``trace.py``) times the microbatches
the schedule keeps in flight, plus the float32 softmax the loss keeps for the logits.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch
from transformers import PretrainedConfig

from ..data_parallel import DEFAULT_BUCKET_MB, bucket_size_bytes
from ..layout import meta_model
from ..pipeline.runtime import HEADER_INTS
from ..pipeline.schedule import peak_in_flight, stage_actions
from ..pipeline.split import stage_of_module
from ..plan import ModelPolicy
from ..tensor_parallel import apply_tp_plan
from ..validate import check_parallel_config
from .trace import Trace, example_inputs, trace_microbatch

HEADER_BYTES = HEADER_INTS * 8  # int64 values


@dataclass(frozen=True)
class GroupTraffic:
    calls: int
    nbytes: int


@dataclass(frozen=True)
class StageEstimate:
    stage: int
    blocks: tuple[int, int]  # [first, last) block indices
    modules: tuple[str, ...]  # modules other than blocks on this stage (embeddings, head)
    params: int  # elements this rank holds
    embedding_params: int  # of which embedding tables (looked up, no matmul FLOPs)
    activation_bytes_per_microbatch: int
    in_flight: int  # microbatches whose activations the schedule holds at once
    comm: dict[str, GroupTraffic] = field(default_factory=dict)  # per step, by group

    @property
    def activation_bytes(self) -> int:
        return self.activation_bytes_per_microbatch * self.in_flight

    def state_bytes(self, precision: str) -> int:
        """Weights + gradients + AdamW state: fp32 (4+4+8 B per parameter), or bf16 weights and
        gradients with fp32 master weights and moments (2+2+4+8 B)."""
        return self.weight_bytes(precision) + self.grad_bytes(precision) + self.optimizer_bytes(precision)

    def weight_bytes(self, precision: str) -> int:
        return self.params * {"fp32": 4, "bf16": 2}[precision]

    def grad_bytes(self, precision: str) -> int:
        return self.params * {"fp32": 4, "bf16": 2}[precision]

    def optimizer_bytes(self, precision: str) -> int:
        return self.params * {"fp32": 8, "bf16": 12}[precision]

    def total_bytes(self, precision: str) -> int:
        return self.state_bytes(precision) + self.activation_bytes


@dataclass(frozen=True)
class MeshEstimate:
    dp: int
    tp: int
    pp: int
    microbatches: int
    schedule: str
    micro_batch_size: int
    seq_len: int  # positions per example (patches + class token for ViT)
    tokens_per_microbatch: int
    total_params: int
    stages: tuple[StageEstimate, ...]
    bubble: float  # (pp - 1) / (microbatches + pp - 1)
    flops_per_step: float  # training FLOPs of the whole global batch (6 * params * tokens + attention)
    attention_flops_per_token: int  # 12 * layers * hidden * positions (forward + backward)
    layers: int
    boundary_bytes: int  # one microbatch's hidden state between two stages

    @property
    def world_size(self) -> int:
        return self.dp * self.tp * self.pp

    def peak_bytes(self, precision: str) -> int:
        return max(s.total_bytes(precision) for s in self.stages)


class Planner:
    """Estimates for one model config at one microbatch shape, over any number of meshes.

    One pristine meta model serves every check (checks only read it), one traced forward serves
    every mesh (shapes do not depend on the mesh), and one sharded meta model per tp gives the
    local parameter sizes, so enumerating the meshes of a 70B model takes seconds.
    """

    def __init__(self, config: PretrainedConfig, *, seq_len: int, micro_batch_size: int,
                 dtype: torch.dtype = torch.float32, policy: ModelPolicy | None = None) -> None:
        self.config = config
        self.seq_len = seq_len
        self.micro_batch_size = micro_batch_size
        self.dtype = dtype
        self.policy = policy
        self.model = meta_model(config).to(dtype)
        self.total_params = sum(p.numel() for p in self.model.parameters())
        self._trace: Trace | None = None
        self._sharded: dict[int, tuple[dict[str, int], dict]] = {}

    def estimate(self, *, dp: int, tp: int, pp: int, microbatches: int, schedule: str = "1f1b",
                 bucket_mb: float = DEFAULT_BUCKET_MB, layers_per_stage: list[int] | None = None) -> MeshEstimate:
        """Estimate one mesh; raises the ``ValueError`` ``parallelize`` would raise for it."""
        checked = check_parallel_config(self.model, dp=dp, tp=tp, pp=pp, microbatches=microbatches, schedule=schedule,
                                        policy=self.policy, layers_per_stage=layers_per_stage, bucket_mb=bucket_mb)
        plan, stage_plan = checked.tp_plan, checked.stage_plan
        if self._trace is None:
            inputs = example_inputs(self.model, micro_batch_size=self.micro_batch_size, seq_len=self.seq_len)
            self._trace = trace_microbatch(self.model, plan, layers=stage_plan.layers, inputs=inputs)
        trace = self._trace
        numels, specs = self._local_sizes(plan)
        elem = torch.empty(0, dtype=self.dtype).element_size()

        def stage_of(name: str) -> int:
            found = stage_of_module(stage_plan, name)
            return pp - 1 if name == "" else (0 if found is None else found)

        local = {name: (stage_of(name.rpartition(".")[0]), numel) for name, numel in numels.items()}
        params, embedding = [0] * pp, [0] * pp
        embeddings = {n for n, m in self.model.named_modules() if isinstance(m, torch.nn.Embedding)}
        for name, (stage, numel) in local.items():
            params[stage] += numel
            if name.rpartition(".")[0] in embeddings:
                embedding[stage] += numel
        tied_bytes = [0] * pp
        for tie in stage_plan.ties:  # the follower stage holds its own copy of the owner's weight
            owner_stage, numel = local[tie.owner]
            follower_stage = stage_of(tie.follower.rpartition(".")[0])
            if follower_stage != owner_stage:
                params[follower_stage] += numel
                tied_bytes[owner_stage] += numel * elem
                tied_bytes[follower_stage] += numel * elem

        saved = [0.0] * pp
        for owner, (whole, split) in trace.saved.items():
            saved[stage_of(owner)] += whole + split / tp
        vocab = _padded_vocab(plan, self.model)
        if plan.loss == "causal_lm" and vocab:
            saved[pp - 1] += trace.logits_rows * vocab / tp * 4  # the loss's float32 softmax

        stages = []
        for s in range(pp):
            comm = _traffic(s, dp=dp, tp=tp, pp=pp, microbatches=microbatches, plan=plan, trace=trace, elem=elem,
                            stage_of=stage_of, grad_bytes=params[s] * elem, bucket_bytes=bucket_size_bytes(bucket_mb),
                            kv_bytes=sum(local[n][1] * elem for n, spec in specs.items()
                                         if spec is not None and spec.replicas > 1 and local[n][0] == s),
                            tied_bytes=tied_bytes[s])
            actions = stage_actions(stage=s, stages=pp, microbatches=microbatches, schedule=schedule, backward=True)
            others = set(stage_plan.heads) if s == pp - 1 else set()
            if s == 0:
                others |= {n for n, _ in stage_plan.first_only} | ({stage_plan.entry} if stage_plan.entry else set())
            stages.append(StageEstimate(stage=s, blocks=stage_plan.layer_ranges[s], modules=tuple(sorted(others)),
                                        params=params[s], embedding_params=embedding[s],
                                        activation_bytes_per_microbatch=int(saved[s]),
                                        in_flight=peak_in_flight(actions), comm=comm))
        layers = len(self.model.get_submodule(stage_plan.layers))
        positions = trace.tokens // self.micro_batch_size  # per example: seq_len, or patches + class token
        per_token = 6 * self.total_params + 12 * layers * self.config.hidden_size * positions
        return MeshEstimate(dp=dp, tp=tp, pp=pp, microbatches=microbatches, schedule=schedule,
                            micro_batch_size=self.micro_batch_size, seq_len=positions,
                            tokens_per_microbatch=trace.tokens, total_params=self.total_params, stages=tuple(stages),
                            bubble=(pp - 1) / (microbatches + pp - 1),
                            flops_per_step=float(per_token * trace.tokens * microbatches * dp),
                            attention_flops_per_token=12 * layers * self.config.hidden_size * positions,
                            layers=layers, boundary_bytes=trace.boundary_numel * elem)

    def _local_sizes(self, plan) -> tuple[dict[str, int], dict]:
        """Elements each parameter has on one tp rank (every tp rank holds the same sizes)."""
        if plan.tp not in self._sharded:
            sharded = meta_model(self.config).to(self.dtype)
            specs, _ = apply_tp_plan(sharded, plan, tp_rank=0, group=None)  # meta: shapes only, no communication
            self._sharded[plan.tp] = ({n: p.numel() for n, p in sharded.named_parameters()}, specs)
        return self._sharded[plan.tp]


def estimate_mesh(config: PretrainedConfig, *, dp: int, tp: int, pp: int, microbatches: int, seq_len: int,
                  micro_batch_size: int, schedule: str = "1f1b", dtype: torch.dtype = torch.float32,
                  bucket_mb: float = DEFAULT_BUCKET_MB, policy: ModelPolicy | None = None,
                  layers_per_stage: list[int] | None = None) -> MeshEstimate:
    """Estimate one mesh (see ``Planner``); raises the ``ValueError`` ``parallelize`` would raise."""
    planner = Planner(config, seq_len=seq_len, micro_batch_size=micro_batch_size, dtype=dtype, policy=policy)
    return planner.estimate(dp=dp, tp=tp, pp=pp, microbatches=microbatches, schedule=schedule, bucket_mb=bucket_mb,
                            layers_per_stage=layers_per_stage)


def _padded_vocab(plan, model) -> int:
    for name, style in plan.rules:
        if style == "vocab_colwise":
            rows = model.get_submodule(name).weight.shape[0]  # the unsharded model's vocabulary
            return -(-rows // plan.tp) * plan.tp  # padded to a multiple of tp, as the shards are
    return 0


def _traffic(s: int, *, dp: int, tp: int, pp: int, microbatches: int, plan, trace: Trace, elem: int, stage_of,
             grad_bytes: int, bucket_bytes: int, kv_bytes: int, tied_bytes: int) -> dict[str, GroupTraffic]:
    out: dict[str, GroupTraffic] = {}
    if tp > 1:
        calls = nbytes = 0
        entered = lambda name: any(name.startswith(e + ".") for e in plan.tp_entries)  # noqa: E731
        for name, style in plan.rules:
            if stage_of(name) != s or name not in trace.io:
                continue
            io = trace.io[name]
            if style in ("rowwise", "vocab_embedding"):
                calls, nbytes = calls + io.calls, nbytes + io.out_numel * elem
            elif style.startswith("colwise") or style == "vocab_colwise":
                if not entered(name):
                    calls, nbytes = calls + io.calls, nbytes + io.in_numel * elem
                if style == "vocab_colwise" and plan.loss == "causal_lm":
                    calls, nbytes = calls + 2, nbytes + 3 * trace.logits_rows * 4
        for name in plan.tp_entries:
            if stage_of(name) == s and name in trace.io:
                calls, nbytes = calls + trace.io[name].calls, nbytes + trace.io[name].in_numel * elem
        out["tp"] = GroupTraffic(calls * microbatches, nbytes * microbatches)
    if pp > 1:
        neighbours = (s > 0) + (s < pp - 1)
        act = trace.boundary_numel * elem
        out["pp"] = GroupTraffic(2 * neighbours * microbatches + neighbours + 1,
                                 2 * neighbours * microbatches * act + neighbours * HEADER_BYTES + 4)
    if dp > 1:
        scalars = (8 if plan.loss else 0) + 4
        out["dp"] = GroupTraffic(math.ceil(grad_bytes / bucket_bytes) + (2 if plan.loss else 1), grad_bytes + scalars)
    if kv_bytes:
        out["kv"] = GroupTraffic(1, kv_bytes)
    if tied_bytes:
        out["tie"] = GroupTraffic(1, tied_bytes)
    return out
