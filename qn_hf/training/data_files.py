"""Turn ``--data`` arguments into a checked list of local files and the ``datasets`` builder for them.

Checked before any process group exists, identically on every rank, so a typo in a path ends the
job with one line instead of a hang.
"""

from __future__ import annotations

import glob
import os

from .errors import UsageError

BUILDERS = {
    ".txt": "text", ".text": "text", ".md": "text",
    ".parquet": "parquet",
    ".json": "json", ".jsonl": "json",
}


def resolve_files(patterns: tuple[str, ...], *, extensions: tuple[str, ...]) -> list[str]:
    """Every file named, globbed or found (recursively) in a directory, with one of ``extensions``."""
    files: list[str] = []
    for pattern in patterns:
        if os.path.isdir(pattern):
            found = sorted(
                os.path.join(root, name) for root, _, names in os.walk(pattern) for name in names
                if os.path.splitext(name)[1].lower() in extensions
            )
            if not found:
                raise UsageError(f"data directory {pattern} holds no {'/'.join(extensions)} files")
            files += found
        elif os.path.isfile(pattern):
            files.append(pattern)
        else:
            matched = sorted(glob.glob(pattern, recursive=True))
            if not matched:
                raise UsageError(f"data path {pattern} does not exist")
            files += [m for m in matched if os.path.isfile(m)]
    unsupported = sorted({f for f in files if os.path.splitext(f)[1].lower() not in extensions})
    if unsupported:
        raise UsageError(f"unsupported data file(s) {unsupported[:3]}; expected {'/'.join(extensions)}")
    return files


def builder_for(files: list[str]) -> str:
    """The single ``datasets`` builder (text, parquet or json) that reads all of ``files``."""
    kinds = {BUILDERS[os.path.splitext(f)[1].lower()] for f in files}
    if len(kinds) != 1:
        raise UsageError(f"data files mix formats {sorted(kinds)}; pass one kind (text, parquet or json) at a time")
    return kinds.pop()
