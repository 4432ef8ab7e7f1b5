"""The small JSON files of a checkpoint (its index, ``latest``, DCP's ``qn_hf.json``), read with a bound on
their size: a forged file must not exhaust memory before it is refused."""

from __future__ import annotations

import json
import os

from .errors import CheckpointError

MAX_INDEX_BYTES = 256 << 20  # a million tensors' entries fit in far less


def read_json(path: str) -> object:
    """A JSON file's value; any file too large to be one of ours, or unreadable, is a ``CheckpointError``."""
    return parse_json(path, read_bytes(path))


def read_bytes(path: str) -> bytes:
    try:
        size = os.path.getsize(path)
        if size > MAX_INDEX_BYTES:  # refuse before reading: a forged file must not exhaust memory
            raise CheckpointError(f"{path} is {size:,} bytes, more than an index can be ({MAX_INDEX_BYTES:,})")
        with open(path, "rb") as f:
            return f.read()
    except FileNotFoundError:
        raise CheckpointError(f"{path} is missing") from None
    except OSError as e:
        raise CheckpointError(f"{path} cannot be read: {type(e).__name__}: {str(e)[:200]}") from None


def parse_json(path: str, data: bytes) -> object:
    try:
        return json.loads(data)
    except (ValueError, RecursionError) as e:  # RecursionError: absurdly nested JSON
        raise CheckpointError(f"{path} is not valid JSON: {type(e).__name__}: {str(e)[:200]}") from None
