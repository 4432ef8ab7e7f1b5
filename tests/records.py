"""A test's JSON record of expected results that a run rewrites when asked (the zoo, the heads zoo, the golden
losses): every result is merged in and the file written at once, atomically, so that a sweep of hours that is
interrupted keeps what it saw and can be resumed with ``-k`` or ``--deselect``; a rendering of the record (a
docs table) is rewritten with it.
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable
from pathlib import Path


class Record:
    def __init__(self, path: Path, update: bool, empty: Callable[[], dict] = dict,
                 render: Callable[[dict], None] | None = None):
        self.path, self.update, self.render = path, update, render
        self.data: dict = json.loads(path.read_text()) if path.exists() else empty()

    def put(self, key: str, column: str, value, row: dict | None = None) -> None:
        """Records ``value`` at ``key``/``column``, with the row's own fields ``row`` (the heads zoo's family);
        written now when updating."""
        self.data.setdefault(key, {}).update({**(row or {}), column: value})
        if self.update:
            self.write()

    def write(self) -> None:
        # sorted and one entry a line, so that a rewrite shows in review as the rows that changed
        text = json.dumps(self.data, indent=1, sort_keys=True) + "\n"
        partial = self.path.with_name(f".{self.path.name}.{os.getpid()}.tmp")
        partial.write_text(text)
        os.replace(partial, self.path)
        if self.render is not None:
            self.render(self.data)
