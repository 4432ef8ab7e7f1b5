"""``ParallelConfig``: how a model is parallelized, as one frozen value built and checked once.

``parallelize``'s keywords (fixed by the API), ``qn_hf.Trainer``'s ``parallel=``, the planner's
meshes and the training scripts' YAML all become this value through ``ParallelConfig.from_keywords``,
so each option is checked in one place, with one message, before any collective; every check and
apply pass after that reads it instead of a list of loose keywords. What it holds says how the model
is cut and computed; where it runs (the process group's timeout, the device, a caller's mesh) and
what it starts from (the checkpoint, the dropout seed) stay ``parallelize``'s own arguments.

The checks that need the model (the composition table, whose messages name the model type; heads,
the policy, the pipeline cut) are ``validate.check_parallel_config``'s.
"""

from __future__ import annotations

import inspect
from collections.abc import Sequence
from dataclasses import dataclass, fields

from ..arguments import check_choice, check_positive, check_positive_int
from .dims import ParallelDims
from .features import Feature
from .options import DEFAULT_BUCKET_MB, Dispatch, Gather, Offload, Precision, Recompute
from .schedule import Schedule, as_schedule, check_schedule_args
from .sequence import sequence_split


@dataclass(frozen=True, init=False)
class ParallelConfig:
    """How a model is parallelized. Built from ``parallelize``'s keywords (``ParallelConfig(dp=2, tp=2,
    microbatches=4)``) or with the degrees as one ``ParallelDims`` (``dims=``); every option checked here,
    with the numbers in the message, the same on every rank (nothing here communicates). The keywords:

    * the degrees (``dims.AXES`` says what each splits): ``dp`` replicas, each ``dp_shard`` of them sharding
      one copy of the weights, gradients and optimizer state with torch's ``fully_shard``
      (data_parallel/sharded.py); ``tp`` shards of each layer; ``pp`` stages; ``cp`` ranks splitting each
      sequence, with ring attention (context_parallel/); ``ep`` ranks of a stage's dp x tp sharing out the
      experts of MoE layers, tokens travelling to them (expert_parallel/), ``expert_dispatch`` ("all_to_all"
      or "all_gather") saying how: the least traffic with one device wait per MoE call, or none at ep times
      the traffic (``options.Dispatch``);
    * the pipeline: ``microbatches``, ``schedule``, ``virtual_stages`` (``schedule="interleaved_1f1b"``: the
      model cut into pp x ``virtual_stages`` chunks, rank r running chunks r, r+pp, ...), ``layers_per_stage``
      (how many blocks each stage, or chunk, gets; default: as even as possible, earlier stages taking the
      remainder), ``dp_shard_gather`` (under a pipeline, a stage's sharded weights gathered once a step or per
      microbatch);
    * ``bucket_mb``: the size of the gradient buckets summed over dp during backward;
    * ``mixed_precision`` ("bf16" or "fp16"): that dtype's compute with float32 gradients and float32 master
      weights in ``qn_hf.optimizer`` (data_parallel/precision.py);
    * ``recompute`` ("full" or "selective"): each block's activations recomputed in backward
      (memory/recompute.py), ``offload="activations"`` holding what it keeps on the host (memory/offload.py);
      ``loss_chunk_tokens``: a causal LM's loss that many tokens at a time (step/loss_chunks.py);
    * ``sequence_parallel``: the activations between tensor-parallel regions split over the tp ranks along the
      sequence (tensor_parallel/sequence_parallel.py); ``compile``: each block of a stage compiled in place
      with ``torch.compile`` (inductor), the collectives inside traced as functional ones (step/compile.py)."""

    dims: ParallelDims
    microbatches: int
    schedule: Schedule
    virtual_stages: int
    layers_per_stage: tuple[int, ...] | None
    bucket_mb: float
    mixed_precision: Precision | None
    recompute: Recompute | None
    offload: Offload | None  # what recomputation keeps, held on the host (memory/offload.py)
    sequence_parallel: bool
    compile: bool
    dp_shard_gather: Gather  # dp_shard x pp: gather a stage's weights once a step, or per microbatch
    expert_dispatch: Dispatch  # ep: how tokens travel to their experts (options.Dispatch)
    loss_chunk_tokens: int | None  # a causal LM's loss this many tokens at a time (step/loss_chunks.py), or whole

    def __init__(self, *, dims: ParallelDims | None = None, dp: int = 1, tp: int = 1, pp: int = 1, cp: int = 1,
                 ep: int = 1, dp_shard: int = 1, microbatches: int = 1,
                 schedule: str | Schedule = Schedule.ONE_F_ONE_B, virtual_stages: int = 1,
                 layers_per_stage: Sequence[int] | None = None, bucket_mb: float = DEFAULT_BUCKET_MB,
                 mixed_precision: str | Precision | None = None, recompute: str | Recompute | None = None,
                 offload: str | Offload | None = None,
                 sequence_parallel: bool = False, compile: bool = False,
                 dp_shard_gather: str | Gather = Gather.STEP,
                 expert_dispatch: str | Dispatch = Dispatch.ALL_TO_ALL, loss_chunk_tokens: int | None = None) -> None:
        degrees = dict(dp=dp, tp=tp, pp=pp, cp=cp, ep=ep, dp_shard=dp_shard)  # (the keywords' home: written once)
        if dims is None:
            dims = ParallelDims(**degrees)
        elif any(value != 1 for value in degrees.values()):
            given = ", ".join(f"{k}={v}" for k, v in degrees.items() if v != 1)
            raise ValueError(f"ParallelConfig(dims={dims}, {given}): give the degrees once, as dims or as keywords")
        check_schedule_args(stages=dims.pp, microbatches=microbatches, schedule=schedule, virtual_stages=virtual_stages)
        check_positive("bucket_mb", bucket_mb)
        for name, value in (("sequence_parallel", sequence_parallel), ("compile", compile)):
            if not isinstance(value, bool):
                raise ValueError(f"{name}={value!r} must be True or False")
        if mixed_precision is not None:
            check_choice("mixed_precision", mixed_precision, Precision.values())
        if recompute is not None:
            check_choice("recompute", recompute, Recompute.values())
        if offload is not None:
            check_choice("offload", offload, Offload.values())
            if recompute is None:
                raise ValueError(f"offload={Offload(offload).value!r} holds on the host what recomputation keeps of each "
                                 f"block (its inputs), and recompute=None keeps everything on the device: set "
                                 f"recompute='full' (or 'selective') with it")
        check_choice("dp_shard_gather", dp_shard_gather, Gather.values())
        check_choice("expert_dispatch", expert_dispatch, Dispatch.values())
        if loss_chunk_tokens is not None:
            check_positive_int("loss_chunk_tokens", loss_chunk_tokens,
                               fix="it is how many tokens' logits exist at once; None computes the loss at once")
        kind, gather, dispatch = as_schedule(schedule), Gather(dp_shard_gather), Dispatch(expert_dispatch)
        if dispatch is Dispatch.ALL_GATHER and dims.ep == 1:
            raise ValueError("expert_dispatch='all_gather' with ep=1: no experts live on other ranks; set ep > 1 "
                             "or leave expert_dispatch at 'all_to_all'")
        if gather is Gather.MICROBATCH and kind.split_backward:
            raise ValueError(f"dp_shard_gather='microbatch' with schedule={kind.value!r}: its weight "
                             f"passes compute weight gradients after later microbatches' forwards, which would have "
                             f"freed the gathered weights; use dp_shard_gather='step' (the default)")
        values = {"dims": dims, "microbatches": microbatches, "schedule": kind, "virtual_stages": virtual_stages,
                  "layers_per_stage": None if layers_per_stage is None else tuple(layers_per_stage),
                  "bucket_mb": bucket_mb,
                  "mixed_precision": None if mixed_precision is None else Precision(mixed_precision),
                  "recompute": None if recompute is None else Recompute(recompute),
                  "offload": None if offload is None else Offload(offload),
                  "sequence_parallel": sequence_parallel, "compile": compile, "dp_shard_gather": gather,
                  "expert_dispatch": dispatch, "loss_chunk_tokens": loss_chunk_tokens}
        for name, value in values.items():
            object.__setattr__(self, name, value)  # frozen: set once, here

    @classmethod
    def keyword_names(cls) -> tuple[str, ...]:
        """The keywords that build a configuration (``parallelize``'s options; the degrees one by one)."""
        return tuple(cls.keyword_defaults())

    @classmethod
    def keyword_defaults(cls) -> dict[str, object]:
        """Each keyword's default (what a keyword left out, or given at its default, leaves as it is)."""
        parameters = inspect.signature(cls.__init__).parameters.items()
        return {name: p.default for name, p in parameters if name not in ("self", "dims")}

    @classmethod
    def from_keywords(cls, **keywords: object) -> ParallelConfig:
        """The value ``parallelize``'s keywords describe, or the ``ValueError`` naming the first one
        that is wrong and its fix."""
        return cls(**keywords)

    def keywords(self) -> dict[str, object]:
        """The ``parallelize`` keywords that build this value again."""
        dims = self.dims.degrees()
        rest = {f.name: getattr(self, f.name) for f in fields(self) if f.name != "dims"}
        return {**dims, **rest}

    def values(self, *, model_type: str | None = None) -> dict[str, object]:
        """What the composition table's messages name: the degrees, the schedule, the model type."""
        return {**self.dims.degrees(), "schedule": self.schedule, "virtual_stages": self.virtual_stages,
                "model_type": model_type}

    @property
    def features(self) -> frozenset[Feature]:
        """The features of the composition table this configuration uses (``features.py``)."""
        d = self.dims
        # a degree above 1 is the feature of its name, but pp's, which is its schedule's (below)
        used = {Feature(name): degree > 1 for name, degree in d.degrees().items() if name in Feature.values()}
        used |= {Feature.EP_ALL_GATHER: d.ep > 1 and self.expert_dispatch is Dispatch.ALL_GATHER,
                Feature.SP: self.sequence_parallel, Feature.COMPILE: self.compile,
                Feature.RECOMPUTE: self.recompute is not None,
                Feature.LOSS_CHUNKS: self.loss_chunk_tokens is not None, Feature.OFFLOAD: self.offload is not None,
                Feature.BF16: self.mixed_precision is Precision.BF16,
                Feature.FP16: self.mixed_precision is Precision.FP16}
        found = {feature for feature, on in used.items() if on}
        if d.pp > 1 or self.schedule.chunks or self.schedule.split_backward:
            found.add(Feature.for_schedule(self.schedule))
        return frozenset(found)

    @property
    def sequence_split(self) -> tuple[int, str]:
        """The multiple every sequence length must be, and why (``sequence.py``)."""
        return sequence_split(cp=self.dims.cp, tp=self.dims.tp, sequence_parallel=self.sequence_parallel)
