"""What the planner gives for one mesh: per stage (``StageEstimate``: what one rank of the stage holds,
keeps and sends) and for the whole mesh (``MeshEstimate``); ``estimate.py`` computes them. Before it,
a search may ask for a mesh's compute alone (``MeshWork``: each stage's FLOPs by kind, ``StageWork``),
what a least step time is priced from (``cost.step_floor``); an estimate's stages carry the same figures
under the same names."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field

from ..config.dims import NamedDegrees, ParallelDims
from ..config.parallel_config import ParallelConfig
from .memory import RankState
from .traffic import GroupTraffic


@dataclass(frozen=True)
class StageEstimate:
    stage: int
    chunks: tuple[tuple[int, int], ...]  # [first, last) block indices of each chunk this rank runs, in model order
    modules: tuple[str, ...]  # modules other than blocks on this stage (embeddings, head)
    params: int  # elements this rank holds
    embedding_params: int  # of which embedding tables (looked up, no matmul FLOPs)
    activation_bytes_per_microbatch: int  # one microbatch through every chunk of this rank
    in_flight: int  # most (chunk, microbatch)es whose activations the schedule holds at once
    activation_bytes: int  # the peak over the schedule: activations and zb_h1's W stash (pipeline/costs.py)
    state: RankState  # weights, gradients, optimizer state
    comm: dict[str, GroupTraffic] = field(default_factory=dict)  # per step, by group
    expert_params: int = 0  # of which routed experts' (fused experts modules; E/ep experts under ep)
    expert_grad_bytes: int = 0  # their gradients under ep (summed over "experts", not dp; dp_shard: its shards)
    weight_stash_bytes_per_microbatch: int = 0  # zb_h1: what one microbatch keeps from its B to its W
    chunk_activation_bytes: tuple[int, ...] = ()  # one microbatch's, per chunk of this rank (in ``chunks`` order)
    in_flight_w: int = 0  # most (chunk, microbatch)es from forward to their last gradient pass (W under zb_h1)
    flops_per_microbatch: float = 0.0  # forward and backward of one whole microbatch here (no recomputation)
    weight_grad_flops_per_microbatch: float = 0.0  # of which zb_h1's W (the deferred linears' weight gradients)
    gathered_bytes: int = 0  # dp_shard: whole weights FSDP holds gathered at once in a step (sharded.py)
    accumulated_grad_bytes: int = 0  # dp_shard under pp: whole gradients kept until the step's reduction
    attention_flops_per_microbatch: float = 0.0  # of flops_per_microbatch: attention's
    expert_flops_per_microbatch: float = 0.0  # of flops_per_microbatch: the routed experts' (active share)
    param_tensors: int = 0  # parameter tensors this rank holds (the optimizer's per-tensor ops)
    ops_per_microbatch: int = 0  # ops of the forward here that write memory (each also runs its backward)
    op_bytes_per_microbatch: int = 0  # bytes those other than matmuls and attention write (this rank's)
    stacks: tuple[str, ...] = ()  # an encoder-decoder's: the block list of each chunk (ranges restart per list)
    # offload="activations": what one microbatch's blocks hold on the host (not in the activations above), and
    # the most the schedule holds there at once (host memory, never the device's)
    offloaded_bytes_per_microbatch: int = 0
    host_bytes: int = 0
    transient_bytes: int = 0  # the last stage: what the loss's backward holds for a moment (activations.py)

    @property
    def blocks(self) -> tuple[int, int]:
        """[first, last) block indices of the rank's only chunk (``chunks`` for interleaved schedules)."""
        if len(self.chunks) != 1:
            raise ValueError(f"stage {self.stage} runs {len(self.chunks)} chunks {self.chunks}; read .chunks")
        return self.chunks[0]

    @property
    def weight_bytes(self) -> int:
        return self.state.weight_bytes

    @property
    def grad_bytes(self) -> int:
        return self.state.grad_bytes

    @property
    def optimizer_bytes(self) -> int:
        """AdamW's moments and step counters, plus the float32 masters under mixed precision."""
        return self.state.optimizer_bytes

    @property
    def state_bytes(self) -> int:
        return self.state.bytes

    @property
    def unsharded_bytes(self) -> int:
        """What a step holds besides the state and activations (dp_shard's gathered weights and whole
        gradients)."""
        return self.gathered_bytes + self.accumulated_grad_bytes

    @property
    def total_bytes(self) -> int:
        return self.state_bytes + self.activation_bytes + self.unsharded_bytes + self.transient_bytes


@dataclass(frozen=True)
class Configured(NamedDegrees):
    """A value about one configuration (``parallel``: the degrees, the schedule, the training options),
    read through the properties below as the tables and JSON name them."""

    parallel: ParallelConfig

    @property
    def dims(self) -> ParallelDims:
        return self.parallel.dims

    @property
    def microbatches(self) -> int:
        return self.parallel.microbatches

    @property
    def virtual_stages(self) -> int:
        """Chunks per rank (interleaved_1f1b)."""
        return self.parallel.virtual_stages

    @property
    def sequence_parallel(self) -> bool:
        return self.parallel.sequence_parallel

    # The options as the tables and JSON spell them: plain strings (None where unset)
    @property
    def schedule(self) -> str:
        return self.parallel.schedule.value

    @property
    def mixed_precision(self) -> str | None:
        return None if self.parallel.mixed_precision is None else self.parallel.mixed_precision.value

    @property
    def recompute(self) -> str | None:
        return None if self.parallel.recompute is None else self.parallel.recompute.value

    @property
    def dp_shard_gather(self) -> str:
        """Under pp: weights gathered once a step or per microbatch."""
        return self.parallel.dp_shard_gather.value

    @property
    def expert_dispatch(self) -> str:
        """How ep moves tokens: the all-to-all or the all-gather (config.options.Dispatch)."""
        return self.parallel.expert_dispatch.value

    @property
    def expert_replicas(self) -> int:
        """Ranks of a stage holding the same experts (summing their gradients): dp x tp / ep x cp."""
        return self.dims.expert_replicas

    @property
    def world_size(self) -> int:
        return self.dims.world_size

    @property
    def replicas(self) -> int:
        """Ranks holding the same shard, whose gradients are summed (and ZeRO's state split): dp x cp."""
        return self.dims.replicas


@dataclass(frozen=True)
class MeshEstimate(Configured):
    """One mesh's figures; ``parallel`` is the configuration estimated (the degrees, the schedule, the
    training options), read through ``Configured``'s properties as the tables and JSON name them."""

    micro_batch_size: int
    seq_len: int  # positions per example (patches + class token for ViT)
    tokens_per_microbatch: int  # of the whole microbatch (each cp rank runs 1/cp of them)
    total_params: int
    stages: tuple[StageEstimate, ...]
    bubble: float  # the schedule's idle fraction, timed from FLOPs (pipeline/costs.py)
    flops_per_step: float  # training FLOPs of the whole global batch (6 * params * tokens + attention)
    attention_flops_per_token: int  # 12 * layers * hidden * positions (forward + backward)
    layers: int
    boundary_bytes: int  # one microbatch's hidden state between two stages (one cp rank's share)
    zero: bool = False  # ZeRO-1 as it applies: asked for, and some state has more than one holder
    # Per token, the share of this rank's routed-expert weights whose matmuls it runs: K/E, and
    # K*ep/(E*tp) under ep (a tp rank sends 1/tp of the tokens, to E/ep experts held whole); 1: dense.
    # It is also the rows one expert's products get per token of the rank, at uniform routing.
    expert_flop_share: float = 1.0
    hidden_size: int = 0  # the model's (the width of its matrix products, before tp)
    # under ep, the busiest ep rank's routed pairs over the mean (expert_parallel/routing_costs.py): from the router's
    # measured loads (``routing_measured``) or at uniform routing; 1.0 without ep
    expert_imbalance: float = 1.0
    routing_measured: bool = False
    dtype: str = "float32"  # the loaded model's (mixed precision computes in its own)

    @property
    def global_batch(self) -> int:
        """Sequences one step trains: dp replicas x microbatches x micro-batch size (cp splits each
        sequence, it adds none)."""
        return self.dp * self.microbatches * self.micro_batch_size

    @property
    def peak_bytes(self) -> int:
        return max(s.total_bytes for s in self.stages)

    @property
    def host_peak_bytes(self) -> int:
        """The most host memory a rank holds for ``offload`` (0 without it); not in ``peak_bytes``, the device's."""
        return max(s.host_bytes for s in self.stages)

    def as_dict(self) -> dict:
        """The figures by name: the degrees first (``ParallelDims.degrees()``, each by its keyword), then the options
        and the figures (``qn-hf-plan --json``'s readers key on these names)."""
        return {**self.dims.degrees(), "microbatches": self.microbatches, "schedule": self.schedule,
                "micro_batch_size": self.micro_batch_size, "seq_len": self.seq_len,
                "tokens_per_microbatch": self.tokens_per_microbatch, "total_params": self.total_params,
                "stages": tuple(asdict(s) for s in self.stages), "bubble": self.bubble,
                "flops_per_step": self.flops_per_step, "attention_flops_per_token": self.attention_flops_per_token,
                "layers": self.layers, "boundary_bytes": self.boundary_bytes,
                "mixed_precision": self.mixed_precision, "zero": self.zero, "recompute": self.recompute,
                "sequence_parallel": self.sequence_parallel,
                "expert_flop_share": self.expert_flop_share, "virtual_stages": self.virtual_stages,
                "dp_shard_gather": self.dp_shard_gather, "expert_dispatch": self.expert_dispatch,
                "loss_chunk_tokens": self.parallel.loss_chunk_tokens,
                "offload": self.parallel.offload.value if self.parallel.offload else None,
                "host_peak_bytes": self.host_peak_bytes}


@dataclass(frozen=True)
class StageWork:
    """One stage's compute for one microbatch, as a rank of it runs it (its chunks' blocks, its share
    of the matmuls under tp and ep), without recomputation: ``StageEstimate``'s fields of these names."""

    chunks: tuple[tuple[int, int], ...]
    stacks: tuple[str, ...]
    params: int
    embedding_params: int
    expert_params: int
    flops_per_microbatch: float
    weight_grad_flops_per_microbatch: float
    attention_flops_per_microbatch: float
    expert_flops_per_microbatch: float


@dataclass(frozen=True)
class MeshWork(Configured):
    """A mesh's compute (``Planner.work``): ``MeshEstimate``'s fields of these names, and per stage
    ``StageWork``; the same at every dp_shard and recomputation of the mesh's shape."""

    stages: tuple[StageWork, ...]
    tokens_per_microbatch: int
    seq_len: int
    layers: int
    attention_flops_per_token: int
    flops_per_token: float  # forward and backward of one token through the whole model
    expert_flop_share: float
    expert_imbalance: float
    hidden_size: int
    dtype: str
