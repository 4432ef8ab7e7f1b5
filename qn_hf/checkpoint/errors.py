"""What the checkpoint package's callers name: its error, and the formats a checkpoint is written in."""

from __future__ import annotations

import enum


class CheckpointError(ValueError):
    """A checkpoint that is missing, damaged, or does not fit the model."""


class CheckpointFormat(enum.Enum):
    QN = "qn"  # qn_hf's sharded safetensors with a sealed index
    DCP = "dcp"  # torch.distributed.checkpoint, as torch's FSDP2 recipe saves and loads (dcp/write.py)


def checkpoint_format(value: CheckpointFormat | str) -> CheckpointFormat:
    try:
        return CheckpointFormat(value)
    except ValueError:
        raise ValueError(f"format={value!r} is not a checkpoint format: use one of "
                         f"{[f.value for f in CheckpointFormat]}") from None
