"""The longest sequences a model takes: the rows of its learned (or fixed) tables of absolute positions.

A position past the table is an index error inside the forward on CPU and a device-side assert on
CUDA, on some ranks; ``step/batch.py`` refuses it first. RoPE, ALiBi and relative-position models
have no such table and no limit here. The table is found from the modules, not a config key (BERT
says ``max_position_embeddings``, GPT-2 ``n_positions``, and a Llama's ``max_position_embeddings``
is no limit at all): an ``nn.Embedding`` named for positions beside the token embedding (in the
module that looks the tokens up: a vision tower's table of patches is no limit on the text). An
encoder-decoder has one per stack, and they differ (LED: 16384 encoder positions, 1024 decoder
ones). Two conventions shift the rows a sequence may use: BART's tables keep ``offset`` rows before
the first position, and RoBERTa's count positions from ``padding_idx + 1`` (its
``create_position_ids_from_input_ids``).
"""

from __future__ import annotations

from dataclasses import dataclass

from torch import nn

from .body import input_embeddings

# last names of absolute position tables (GPT-2's wpe, BART's embed_positions, BERT's position_embeddings)
_NAMES = ("position", "wpe")


@dataclass(frozen=True)
class PositionTable:
    name: str  # the table's module, from the top model
    positions: int  # the longest sequence it serves


@dataclass(frozen=True)
class PositionLimits:
    inputs: PositionTable | None = None  # input_ids' (an encoder-decoder's: its encoder's)
    decoder: PositionTable | None = None  # an encoder-decoder's decoder's: the labels' (decoder inputs') length


def learned_positions(model: nn.Module) -> PositionLimits:
    """The tightest absolute position tables beside the model's token embeddings (module docstring)."""
    tokens = input_embeddings(model)
    weight = getattr(tokens, "weight", None)
    if weight is None:
        return PositionLimits()
    # every module that looks the tokens up (an encoder-decoder's stacks each have one, tied or shared)
    parents = {name.rpartition(".")[0] for name, module in model.named_modules(remove_duplicate=False)
               if getattr(module, "weight", None) is weight}
    encoder = _encoder(model)
    inputs, decoder = [], []
    for name, module in model.named_modules():
        parent, _, leaf = name.rpartition(".")
        if parent not in parents or not isinstance(module, nn.Embedding) or not any(w in leaf.lower() for w in _NAMES):
            continue
        offset = getattr(module, "offset", 0)
        if not isinstance(offset, int):
            continue
        start = module.padding_idx + 1 if module.padding_idx is not None else 0
        table = PositionTable(name=name, positions=module.num_embeddings - offset - start)
        (inputs if encoder is None or id(module) in encoder else decoder).append(table)

    def tightest(tables: list[PositionTable]) -> PositionTable | None:
        return min(tables, key=lambda t: t.positions, default=None)

    return PositionLimits(inputs=tightest(inputs), decoder=tightest(decoder))


def _encoder(model: nn.Module) -> set[int] | None:
    """An encoder-decoder's encoder modules (by id), or None for a model of one stack."""
    if not getattr(model.config, "is_encoder_decoder", False) or not hasattr(model, "get_encoder"):
        return None
    try:
        encoder = model.get_encoder()
    except (NotImplementedError, AttributeError):
        return None
    return {id(m) for m in encoder.modules()} if isinstance(encoder, nn.Module) else None
