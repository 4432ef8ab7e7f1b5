"""Files as any file the user writes: whole or nothing, with the mode a plain ``open`` gives, and
never written through a link someone left in the directory.

A new file is created with ``O_CREAT | O_EXCL | O_NOFOLLOW`` after removing whatever had its name
(a stale temporary file, or a symbolic link pointing outside the directory: removing the link leaves
its target alone), and renamed over its final name, which replaces a link there rather than writing
through it. ``os.open`` with mode 0666 gives the mode any file the user writes gets (0666 less the
umask); ``tempfile.mkstemp`` and safetensors' writer make files owner-only, and a server running as
another user could not read what was exported.
"""

from __future__ import annotations

import os
import shutil
from typing import BinaryIO

TMP = ".tmp"  # a file being written, beside the name it will have
_NEW_FILE = os.O_WRONLY | os.O_CREAT | os.O_EXCL | getattr(os, "O_NOFOLLOW", 0) | getattr(os, "O_CLOEXEC", 0)


def remove_entry(path: str) -> None:
    """Remove ``path`` if anything has that name: a link itself (never its target), a file, or a
    directory tree (``shutil.rmtree`` does not follow links inside it)."""
    if os.path.islink(path) or os.path.isfile(path):
        os.unlink(path)
    elif os.path.isdir(path):
        shutil.rmtree(path)
    elif os.path.lexists(path):  # a fifo or socket: nothing qn_hf writes, but it holds the name
        os.unlink(path)


def create_new(path: str) -> BinaryIO:
    """A new, empty file opened for binary writing at ``path``, replacing whatever had that name."""
    remove_entry(path)
    return os.fdopen(os.open(path, _NEW_FILE, 0o666), "wb")


def fresh_dir(path: str) -> None:
    """An empty directory at ``path``, made here: what had the name (an earlier attempt's leftovers,
    or a link to a directory elsewhere) is removed first, so nothing written into it lands outside."""
    remove_entry(path)
    os.mkdir(path)


def write_bytes_atomic(path: str, data: bytes) -> None:
    tmp = path + TMP
    with create_new(tmp) as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def write_text_atomic(path: str, text: str) -> None:
    write_bytes_atomic(path, text.encode())


def _umask() -> int:
    try:  # Linux: read it without changing it (setting it, even briefly, races with other threads)
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("Umask:"):
                    return int(line.split()[1], 8)
    except OSError:
        pass
    mask = os.umask(0o022)
    os.umask(mask)
    return mask


def give_plain_mode(path: str) -> None:
    """Set ``path``'s mode to what ``open(path, "w")`` would have created (for files written by
    libraries that create them owner-only)."""
    os.chmod(path, 0o666 & ~_umask())
