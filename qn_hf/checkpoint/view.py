"""What a ``ParallelModel``'s checkpoints read of it, handed over once: the one interface between the model's
handle and its checkpoints (``methods.py``), so neither reaches into the other's attributes."""

from __future__ import annotations

import weakref
from dataclasses import dataclass, field

from torch import nn

from ..data_parallel.precision import LossScaler
from ..failure import FailTogether
from ..peft.lora import Adapter
from ..placement import ShardPlacement
from .background import BackgroundSaves
from .lock import HeldDirectories


@dataclass
class CheckpointView:
    """The sharded model and where its shards sit, the whole model's Hugging Face config (a stage's modules may
    hold a cut copy), the PEFT adapter it came from, fp16's loss scale, whether mixed precision casts what is
    loaded, the pipeline's chunks per rank; ``ready`` raises on a closed model and waits for weights ZeRO-1 still
    gathers (the model's own method, held weakly: the view must not keep its model alive); the save in flight
    (``saves``) and the roots this model saves to, held while it lives."""

    module: nn.Module
    placement: ShardPlacement
    config: object  # the whole model's transformers config
    failures: FailTogether
    adapter: Adapter | None
    scaler: LossScaler | None
    cast: bool
    virtual_stages: int
    ready_method: weakref.WeakMethod
    saves: BackgroundSaves
    held_roots: HeldDirectories = field(default_factory=HeldDirectories)

    def ready(self) -> None:
        self.ready_method()()
