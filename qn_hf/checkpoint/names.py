"""Names of checkpoint directories: ``ckpt-<step>`` (six or more digits), ``ckpt-<step>.<k>`` for
the k-th re-save of a step already on disk, and the ``latest`` pointer that names the current one.
"""

from __future__ import annotations

import json
import os
import re

from ..arguments import check_non_negative_int

LATEST = "latest"
_NAME = re.compile(r"ckpt-([0-9]{6,})(?:\.([0-9]+))?")


def checkpoint_name(step: int, again: int = 0) -> str:
    check_non_negative_int("step", step, what="the training step a checkpoint directory is named after")
    return f"ckpt-{step:06d}" + (f".{again}" if again else "")


def is_checkpoint_name(name: str) -> bool:
    return _NAME.fullmatch(name) is not None


def parse_name(name: str) -> tuple[int, int]:
    """(step, re-save count) of a checkpoint directory name."""
    match = _NAME.fullmatch(name)
    if match is None:
        raise ValueError(f"{name!r} is not a checkpoint directory name")
    return int(match[1]), int(match[2] or 0)


def read_latest(path: str) -> str | None:
    """The checkpoint directory name ``latest`` under ``path`` holds, or None (none, or unreadable)."""
    try:
        with open(os.path.join(path, LATEST)) as f:
            name = json.load(f)
    except (OSError, ValueError):
        return None
    return name if isinstance(name, str) and is_checkpoint_name(name) else None


def _latest_step(path: str) -> int:
    name = read_latest(path)
    return 0 if name is None else parse_name(name)[0]


def next_checkpoint_dir(path: str, *, step: int | None) -> str:
    """``path/ckpt-<step>`` (its ``.partial`` twin is written first); a step already saved gets
    ``.1``, ``.2``, ...; without a step, the number after the current checkpoint's."""
    if step is None:
        step = _latest_step(path) + 1
    again = 0
    while os.path.lexists(os.path.join(path, checkpoint_name(step, again))):  # a dangling link holds the name too
        again += 1
    return os.path.join(path, checkpoint_name(step, again))
