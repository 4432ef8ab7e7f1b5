"""Planning a mesh before launch (``qn-hf-plan``): per-rank memory (weights, gradients and AdamW
state under mixed precision and ZeRO-1, activations under recomputation, sequence and context
parallelism), per-step communication (expert parallelism's all-to-alls included), stage cuts and
a ranking of the valid (dp, tp, pp, cp) at a given ep, all from a ``meta``-device model and the same
checks, plan and split ``parallelize`` uses. Each dimension's own terms live in its folder (``pipeline/costs.py``,
``context_parallel/costs.py``, ``expert_parallel/costs.py`` and ``routing_costs.py``,
``tensor_parallel/sequence_costs.py``); the planner composes them."""

from ..expert_parallel.routing_costs import measure_expert_loads
from .cost import Hardware, StepTime, step_time
from .estimate import Planner, estimate_mesh
from .memory import RankState
from .results import MeshEstimate, StageEstimate
from .search import Candidate, Rejected, search

__all__ = ["Candidate", "Hardware", "MeshEstimate", "Planner", "RankState", "Rejected", "StageEstimate", "StepTime",
           "estimate_mesh", "measure_expert_loads", "search", "step_time"]
