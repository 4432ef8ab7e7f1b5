"""Durable files: what is written reaches the disk before it is named, whole files are published by
rename, and every file's size and CRC-32 are recorded so a reader catches flipped or missing bytes
(safetensors checks its header, not the data)."""

from __future__ import annotations

import json
import os
import shutil
import zlib

from ..atomic import write_text_atomic
from .format import CheckpointError
from .names import LATEST, is_checkpoint_name


def fsync_file(path: str) -> None:
    with open(path, "rb") as f:
        os.fsync(f.fileno())


def fsync_dir(path: str) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def write_json(obj: object, target: str) -> None:
    write_text_atomic(target, json.dumps(obj, indent=1))


def publish(partial: str, final: str) -> None:
    """Make a fully written ``partial`` directory the current checkpoint: fsync it, rename it to
    ``final``, then atomically point ``latest`` at it, and only then remove older ones. A crash at
    any point leaves ``latest`` naming a whole checkpoint."""
    root = os.path.dirname(final)
    fsync_dir(partial)
    os.rename(partial, final)
    fsync_dir(root)
    write_json(os.path.basename(final), os.path.join(root, LATEST))
    fsync_dir(root)
    for old in os.listdir(root):
        if is_checkpoint_name(old.removesuffix(".partial")) and old != os.path.basename(final):
            shutil.rmtree(os.path.join(root, old), ignore_errors=True)


def file_digest(path: str) -> dict[str, int]:
    """Size and CRC-32 of a written file: what a load checks."""
    crc, size = 0, 0
    with open(path, "rb") as f:
        while chunk := f.read(1 << 24):
            crc, size = zlib.crc32(chunk, crc), size + len(chunk)
    return {"bytes": size, "crc32": crc}


class FileChecks:
    """Verifies each checkpoint file against the index's digest the first time this rank reads
    from it (only the files it reads, so a rank never scans the whole checkpoint)."""

    def __init__(self, directory: str, digests: dict | None) -> None:
        self.directory = directory
        self.digests = digests or {}
        self.done: set[str] = set()

    def verify(self, file: str) -> None:
        if file in self.done or file not in self.digests:
            return
        path = os.path.join(self.directory, file)
        try:
            actual = file_digest(path)
        except FileNotFoundError:
            raise CheckpointError(f"{path} is missing") from None
        expected = self.digests[file]
        if actual != expected:
            raise CheckpointError(f"{path} is corrupt: {actual['bytes']:,} bytes with CRC-32 {actual['crc32']:#010x}, "
                                  f"the index recorded {expected['bytes']:,} bytes with CRC-32 {expected['crc32']:#010x}")
        self.done.add(file)
