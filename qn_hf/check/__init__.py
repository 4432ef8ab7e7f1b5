"""Parity checks of whole architectures: a shrunk random copy of a model trained one step under
qn_hf and plainly (``qn-hf-check``, the model-zoo test).

``shrink.py`` (a config made tiny, with ``gaps.py``'s values a default config leaves unset), ``inputs.py`` (a batch any head takes, and whether its loss can
run at all), ``run.py`` (one parity check), ``zoo.py`` (the causal-LM zoo and the heads table),
``cli.py`` (qn-hf-check)."""

from .run import one_step_parity
from .shrink import shrink_config

__all__ = ["one_step_parity", "shrink_config"]
