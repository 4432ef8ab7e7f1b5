"""Files as any file the user writes: whole or nothing, and with the mode a plain ``open`` gives.

``open`` creates the temporary file, so it gets the mode any file the user writes gets (0666 less
the umask); ``tempfile.mkstemp`` and safetensors' writer make files owner-only, and a server running
as another user could not read what was exported.
"""

from __future__ import annotations

import os


def write_text_atomic(path: str, text: str) -> None:
    tmp = path + ".tmp"
    with open(tmp, "w") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


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
