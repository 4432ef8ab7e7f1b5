"""qn_hf: data (plain, ZeRO-1, sharded over FSDP2), tensor, sequence, context, pipeline and expert parallelism,
composed, for unmodified Hugging Face models, numerically equal to the unparallelized model."""

from .comm_meter import CommMeter
from .data_parallel.grad_norm import clip_grad_norm_
from .mesh import ParallelDims
from .data_parallel.optimizer import ParallelOptimizer, optimizer
from .parallel_model import ParallelModel
from .parallelize import parallelize
from .pipeline.schedule import Schedule
from .tensor_parallel.plan import ModelPolicy
from .version import __version__

__all__ = ["CommMeter", "ModelPolicy", "ParallelDims", "ParallelModel", "ParallelOptimizer", "ParallelTrainerMixin",
           "Schedule", "Trainer", "clip_grad_norm_", "optimizer", "parallelize", "__version__"]

_TRAINER = ("Trainer", "ParallelTrainerMixin")


def __getattr__(name: str):
    # transformers.Trainer pulls in accelerate (an extra): import it only when qn_hf.Trainer is asked for
    if name in _TRAINER:
        from .integrations.hf_trainer import trainer

        return getattr(trainer, name)
    raise AttributeError(f"module 'qn_hf' has no attribute {name!r}")
