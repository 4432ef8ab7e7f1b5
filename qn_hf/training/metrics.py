"""Run outputs on rank 0: ``metrics.jsonl`` (one JSON object per step), a progress bar and lines.

On resume the file keeps the records up to the checkpoint's step and continues from there, so the
file always describes one run with no duplicated or abandoned steps. Every line is strict JSON: a
value that is not a finite number (a diverged loss) is written as null, never as a bare NaN.
"""

from __future__ import annotations

import json
import math
import os
import sys

from tqdm import tqdm

from ..checkpoint.atomic import write_text_atomic
from .errors import UsageError

_APPEND = os.O_WRONLY | os.O_APPEND | os.O_CREAT | getattr(os, "O_NOFOLLOW", 0) | getattr(os, "O_CLOEXEC", 0)


def to_json_line(record: dict) -> str:
    """``record`` as one line of strict JSON: NaN and infinities become null."""
    finite = {k: None if isinstance(v, float) and not math.isfinite(v) else v for k, v in record.items()}
    return json.dumps(finite, allow_nan=False) + "\n"


def read_metrics(path: str) -> list[dict]:
    if not os.path.isfile(path):
        return []
    with open(path) as f:
        return [json.loads(line) for line in f if line.strip()]


class MetricsLog:
    def __init__(self, path: str, *, active: bool, resume_step: int) -> None:
        self.path = path
        self.active = active
        self.records: list[dict] = []
        if not active:
            return
        kept = [r for r in read_metrics(path) if r.get("step", 0) <= resume_step] if resume_step else []
        write_text_atomic(path, "".join(to_json_line(r) for r in kept))
        self.records = kept

    @property
    def elapsed_before(self) -> float:
        return max((r.get("elapsed_s", 0.0) for r in self.records), default=0.0)

    def append(self, record: dict) -> None:
        if not self.active:
            return
        self.records.append(record)
        # O_NOFOLLOW: a link planted under the name after the run started is refused, not written through
        try:
            fd = os.open(self.path, _APPEND, 0o666)
        except OSError as e:
            if os.path.islink(self.path):
                raise UsageError(f"{self.path} is a symbolic link (made while the run was writing it): refusing to "
                                 f"append the metrics through it; remove the link") from None
            raise UsageError(f"cannot append to {self.path}: {e.strerror}") from None
        with os.fdopen(fd, "a") as f:
            f.write(to_json_line(record))


class Progress:
    """A tqdm bar on rank 0 (or plain lines with ``enabled=False``); silent on other ranks."""

    def __init__(self, *, total: int, initial: int, active: bool, enabled: bool, unit_name: str) -> None:
        self.active = active
        self.unit_name = unit_name
        self.bar = tqdm(total=total, initial=initial, unit="step", dynamic_ncols=True, file=sys.stderr,
                        disable=not (active and enabled), mininterval=0.5)

    def update(self, record: dict) -> None:
        self.bar.set_postfix({"loss": f"{record['loss']:.4f}", "lr": f"{record['lr']:.2e}",
                              self.unit_name: f"{record[self.unit_name]:,.0f}"}, refresh=False)
        self.bar.update(1)

    def say(self, message: str) -> None:
        if self.active:
            self.bar.write(message, file=sys.stderr)

    def close(self) -> None:
        self.bar.close()
