"""Durable files: what is written reaches the disk before it is named, whole files are published by
rename, and every file's size and CRC-32 are recorded so a reader catches flipped or missing bytes
(safetensors checks its header, not the data)."""

from __future__ import annotations

import json
import os
import shutil
import zlib

from ..arguments import check_positive_int
from .atomic import remove_entry, write_text_atomic
from .format import CheckpointError
from .names import LATEST, is_checkpoint_name, parse_name, read_latest

PARTIAL = ".partial"  # a checkpoint being written: ``ckpt-<step>.partial`` until it is whole
REMOVING = ".removing"  # a checkpoint being deleted by ``prune``: out of the checkpoint names first


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
    """Make a fully written ``partial`` directory the checkpoint ``final``: fsync it, rename it, then
    atomically point ``latest`` at it. A crash at any point leaves ``latest`` naming a whole
    checkpoint. Nothing else under the directory is touched, older or newer: removing checkpoints
    is ``prune``'s, and only when asked."""
    root = os.path.dirname(final)
    fsync_dir(partial)
    os.rename(partial, final)
    fsync_dir(root)
    write_json(os.path.basename(final), os.path.join(root, LATEST))
    fsync_dir(root)


def prune(root: str, *, keep_last: int) -> list[str]:
    """Remove the checkpoints under ``root`` older than its ``keep_last`` newest (by step, then
    re-save), never the one ``latest`` names, with the leftovers of interrupted saves older than
    those kept (a newer ``.partial`` may be a save still being written); return the names removed.
    Each is renamed out of the checkpoint names before it is deleted, so a crash midway never leaves
    a half-deleted directory that looks like a checkpoint."""
    check_positive_int("keep_last", keep_last, fix="how many of the newest checkpoints to keep")
    names = sorted(os.listdir(root))
    done = sorted((parse_name(n), n) for n in names if is_checkpoint_name(n))
    kept = {n for _, n in done[-keep_last:]} | {read_latest(root)}
    oldest = done[-keep_last:][0][0] if done else None
    removed = []
    for name in names:
        stem = name.removesuffix(PARTIAL).removesuffix(REMOVING)
        if name in kept or not is_checkpoint_name(stem):
            continue
        if name.endswith(PARTIAL) and (oldest is None or parse_name(stem) >= oldest):
            continue
        doomed = os.path.join(root, stem + REMOVING)
        if name != stem + REMOVING:
            remove_entry(doomed)
            os.rename(os.path.join(root, name), doomed)
        if os.path.isdir(doomed) and not os.path.islink(doomed):
            shutil.rmtree(doomed)
        else:
            os.unlink(doomed)  # a link by a checkpoint's name: the link goes, never what it points to
        removed.append(name)
    if removed:
        fsync_dir(root)
    return removed


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
        """The file's size is compared with the index's before a byte is read (a file grown to a
        terabyte, sparse or not, is refused at once, not CRC-read to its end), then its CRC-32."""
        if file in self.done or file not in self.digests:
            return
        path = os.path.join(self.directory, file)
        expected = self.digests[file]
        try:
            size = os.stat(path).st_size
            actual = file_digest(path) if size == expected["bytes"] else None
        except FileNotFoundError:
            raise CheckpointError(f"{path} is missing") from None
        if actual is None:
            raise CheckpointError(f"{path} is corrupt: it has {size:,} bytes, the index recorded {expected['bytes']:,} "
                                  f"(refused before reading it): restore the file, or resume from another checkpoint")
        if actual != expected:
            raise CheckpointError(f"{path} is corrupt: {actual['bytes']:,} bytes with CRC-32 {actual['crc32']:#010x}, "
                                  f"the index recorded {expected['bytes']:,} bytes with CRC-32 {expected['crc32']:#010x}")
        self.done.add(file)
