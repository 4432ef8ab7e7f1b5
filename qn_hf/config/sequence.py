"""How a sequence is cut over the ranks (context parallelism's pieces, sequence parallelism's
slices) and so which lengths a run takes: arithmetic, checked with the numbers in the message."""

from __future__ import annotations

import math


def sequence_split(*, cp: int, tp: int, sequence_parallel: bool) -> tuple[int, str]:
    """The multiple every sequence length must be, and why: cp cuts a sequence into 2*cp pieces,
    sequence parallelism splits it (under cp: each cp rank's two pieces, L/cp tokens) over tp."""
    if cp > 1 and sequence_parallel:
        return cp * math.lcm(2, tp), (f"cp={cp} cuts it into 2*cp pieces and sequence_parallel=True splits each cp "
                                      f"rank's part over tp={tp}")
    if cp > 1:
        return 2 * cp, f"cp={cp} cuts it into 2*cp pieces"
    if sequence_parallel:
        return tp, f"sequence_parallel=True splits it over tp={tp}"
    return 1, ""


def check_sequence_length(length: int, split: tuple[int, str]) -> None:
    """``length`` must be a multiple of ``split``'s multiple (``sequence_split``)."""
    multiple, why = split
    if length % multiple:
        raise ValueError(f"sequence length {length} is not a multiple of {multiple} ({why}); pad the sequences "
                         f"to a multiple of {multiple} (attention_mask 0 and labels -100 on the padding)")
