"""qn_hf: data (plain, ZeRO-1, sharded over FSDP2), tensor, sequence, context, pipeline and expert parallelism,
composed, for unmodified Hugging Face models, numerically equal to the unparallelized model."""

from .comm_meter import CommMeter
from .config.dims import ParallelDims
from .config.parallel_config import ParallelConfig
from .config.schedule import Schedule
from .data_parallel.grad_norm import clip_grad_norm_
from .data_parallel.optimizer import ParallelOptimizer
from .entry.parallelize import parallelize
from .parallel_model import ParallelModel, optimizer
from .planner.auto import auto_choice, auto_config
from .policies.model_policy import ModelPolicy
from .version import __version__

__all__ = [
    "CommMeter",
    "ModelPolicy",
    "ParallelConfig",
    "ParallelDims",
    "ParallelModel",
    "ParallelOptimizer",
    "ParallelTrainerMixin",
    "Schedule",
    "Trainer",
    "__version__",
    "auto_choice",
    "auto_config",
    "clip_grad_norm_",
    "optimizer",
    "parallelize",
]

_TRAINER = ("Trainer", "ParallelTrainerMixin")


def __getattr__(name: str):
    # transformers.Trainer pulls in accelerate (an extra): import it only when qn_hf.Trainer is asked for
    if name in _TRAINER:
        from .integrations.hf_trainer import trainer

        return getattr(trainer, name)
    raise AttributeError(f"module 'qn_hf' has no attribute {name!r}")
