"""The features a run combines (each pair a cell of the composition table) and what the table says of a pair.

``composition.py`` holds the pairs that are refused or cannot both be set; the tests' ``composes`` marks say which
pairs a test compares with the plain model (``composition_coverage.py``, written from them by ``make
composition-table``).
"""

from __future__ import annotations

import enum

from ..arguments import Choice


class Feature(Choice):
    TP = "tp"
    SP = "sp"
    CP = "cp"
    PP_1F1B = "pp 1f1b"
    PP_GPIPE = "pp gpipe"
    PP_INTERLEAVED = "pp interleaved_1f1b"
    PP_ZB_H1 = "pp zb_h1"
    EP = "ep"
    EP_ALL_GATHER = "ep all_gather"  # expert_dispatch="all_gather" (config.options.Dispatch)
    DP = "dp"
    DP_SHARD = "dp_shard"
    ZERO = "zero"
    BF16 = "bf16"
    FP16 = "fp16"
    RECOMPUTE = "recompute"
    LOSS_CHUNKS = "loss chunks"  # loss_chunk_tokens: a causal LM's loss a chunk of tokens at a time
    OFFLOAD = "offload"  # offload="activations": what recomputation keeps, held on the host
    LORA = "lora"
    GENERATE = "generate"
    TRAINER = "trainer"
    COMPILE = "compile"

    @classmethod
    def for_schedule(cls, schedule: str) -> Feature:
        return cls(f"pp {schedule}")


class Status(enum.Enum):
    PLAIN = "composes: compared with the plain model"
    EQUIVALENT = "composes: compared with a configuration that is compared with the plain model"
    RUNS = "runs in a test, not compared numerically yet"
    UNTESTED = "not refused, not tested yet"
    REFUSED = "refused"
    EXCLUSIVE = "cannot both be set"


def ordered(pair: frozenset[Feature]) -> tuple[Feature, ...]:
    """A pair's features in ``Feature``'s order (as the table and its messages name them)."""
    return tuple(feature for feature in Feature if feature in pair)


def pair_name(pair: frozenset[Feature]) -> str:
    """``tp x sp``: a pair as the warnings and the table name it."""
    return " x ".join(str(feature) for feature in ordered(pair))
