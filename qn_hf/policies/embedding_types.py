"""Subclasses of ``nn.Embedding`` whose extra behaviour a vocabulary-parallel embedding can keep.

transformers defines embeddings that do more than look up rows: Gemma's multiplies by
``embed_scale``, Inkling's normalizes. Swapping such a module for a plain parallel embedding would
train silently differently, so a swap takes either the exact class the parallel layer reproduces
or a subclass whose ``forward`` is, statement for statement, one of the behaviours below, which the
adapter applies after the lookup has been summed over tp (every rank then holds the full row, so the
scale or norm sees the row the unsharded module gives it). Any other subclass is refused. Matching
the source rather than the class name means a transformers release that changes such a forward is
refused, not silently mis-trained.
"""

from __future__ import annotations

import inspect
import textwrap
from dataclasses import dataclass

from torch import nn

# forward body (statements, whitespace-normalized) -> behaviour name
_BEHAVIOURS = {
    "return super().forward(input_ids) * self.embed_scale.to(self.weight.dtype)": "scaled",
    "return super().forward(input_ids) * self.embed_scale": "scaled_by_float",  # BART's, XGLM's: a float scale
    "return self.embed_norm(super().forward(input_ids))": "normed",
}


@dataclass(frozen=True)
class EmbeddingAdapter:
    """What a vocabulary-parallel embedding must add to reproduce ``cls``."""

    behaviour: str  # "plain", "scaled", "scaled_by_float" or "normed"


def forward_body(fn) -> str:
    """The statements of a function, without its signature, docstring or blank lines."""
    lines = textwrap.dedent(inspect.getsource(fn)).splitlines()
    start = next(i for i, line in enumerate(lines) if line.rstrip().endswith(":")) + 1
    body = [line.strip() for line in lines[start:] if line.strip()]
    if body and body[0].startswith(('"""', "'''")):
        quote = body[0][:3]
        end = next(i for i, line in enumerate(body) if (line.endswith(quote) and (i > 0 or len(line) > 3)))
        body = body[end + 1 :]
    return "\n".join(body)


def adapter_for(module: nn.Module) -> EmbeddingAdapter | None:
    """The adapter that reproduces ``module`` (an ``nn.Embedding``), or None when none does."""
    if not isinstance(module, nn.Embedding):
        return None
    owner = next(c for c in type(module).__mro__ if "forward" in c.__dict__)  # whose forward runs
    if owner is nn.Embedding:
        return EmbeddingAdapter(behaviour="plain")
    behaviour = _BEHAVIOURS.get(forward_body(owner.forward))
    return None if behaviour is None else EmbeddingAdapter(behaviour=behaviour)
