"""One data-only policy per architecture, keyed by ``config.model_type``."""

from . import gpt2, llama, vit
from .amendments import AMENDMENTS, REFUSALS

POLICIES = {p.model_type: p for p in (gpt2.POLICY, llama.POLICY, vit.POLICY)}
