"""Learning rate as a pure function of the step: linear warm-up, then cosine decay.

A function of the step (not a stateful scheduler) resumes exactly: step k after a resume gets the
same rate as step k of an uninterrupted run, whatever mesh the run resumed on.
"""

from __future__ import annotations

import math


def warmup_cosine(step: int, *, lr: float, warmup_steps: int, total_steps: int, min_lr_ratio: float) -> float:
    """Rate for 1-based ``step``: ``lr * step / warmup_steps`` during warm-up, then a half cosine
    from ``lr`` down to ``lr * min_lr_ratio`` at ``total_steps``."""
    if warmup_steps and step <= warmup_steps:
        return lr * step / warmup_steps
    span = max(1, total_steps - warmup_steps)
    progress = min(1.0, (step - warmup_steps) / span)
    return lr * (min_lr_ratio + (1.0 - min_lr_ratio) * 0.5 * (1.0 + math.cos(math.pi * progress)))
