"""The sizes of the check's shrunk models (``shrink.py``, ``repair.py``)."""

from __future__ import annotations

# Widths small enough for CPU, divisible by tp in {1, 2, 4} and, for heads, still grouped (GQA).
HIDDEN = 64
HEADS = 4
HEAD_DIM = 16
LAYERS = 4
VOCAB = 126  # not a multiple of 4: tp=4 pads the vocabulary
EXPERTS = 4
# a staged tower's blocks per stage at most (shrink.py: _STAGE_DEPTHS)
STAGE_DEPTH = 2
# Keys that count blocks the way num_hidden_layers does (an audio encoder's conformer blocks).
LAYER_COUNTS = ("num_hidden_layers", "num_blocks", "encoder_layers", "decoder_layers", "num_decoder_layers")


def is_size(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value > 0
