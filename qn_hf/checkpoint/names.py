"""Names of checkpoint directories: ``ckpt-<step>`` (six or more digits), ``ckpt-<step>.<k>`` for
the k-th re-save of a step already on disk, and the ``latest`` pointer that names the current one.
"""

from __future__ import annotations

import json
import os
import re

LATEST = "latest"
_NAME = re.compile(r"ckpt-(\d{6,})(?:\.(\d+))?")


def checkpoint_name(step: int, again: int = 0) -> str:
    return f"ckpt-{step:06d}" + (f".{again}" if again else "")


def is_checkpoint_name(name: str) -> bool:
    return _NAME.fullmatch(name) is not None


def parse_name(name: str) -> tuple[int, int]:
    """(step, re-save count) of a checkpoint directory name."""
    match = _NAME.fullmatch(name)
    if match is None:
        raise ValueError(f"{name!r} is not a checkpoint directory name")
    return int(match[1]), int(match[2] or 0)


def _latest_step(path: str) -> int:
    try:
        with open(os.path.join(path, LATEST)) as f:
            return parse_name(json.load(f))[0]
    except (OSError, ValueError, TypeError):
        return 0


def next_checkpoint_dir(path: str, *, step: int | None) -> str:
    """``path/ckpt-<step>`` (its ``.partial`` twin is written first); a step already saved gets
    ``.1``, ``.2``, ...; without a step, the number after the current checkpoint's."""
    if step is None:
        step = _latest_step(path) + 1
    again = 0
    while os.path.exists(os.path.join(path, checkpoint_name(step, again))):
        again += 1
    return os.path.join(path, checkpoint_name(step, again))
