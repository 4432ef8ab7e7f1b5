"""Parity checks of whole architectures: a shrunk random copy of a model trained one step under
qn_hf and plainly (``qn-hf-check``, the model-zoo test)."""

from .run import one_step_parity
from .shrink import shrink_config

__all__ = ["one_step_parity", "shrink_config"]
