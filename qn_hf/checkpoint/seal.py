"""An index's own digest, so that any edited byte of ``index.json`` is refused at load.

The shard files carry size and CRC-32 in the index; the index itself carries the SHA-256 of its own
bytes as its first field, ``{"index_sha256": "<64 hex digits>", ...``, computed over the file with those
64 digits read as zeros. It covers every byte but itself, whitespace and number spelling included (a
digest of the parsed value would let ``1e-05`` -> ``1E-05`` through), and an edit of the digest, or of
the text around it, is refused as well. One-bit edits that once loaded silently (``"step": 6`` -> ``7``,
a learning rate, Adam's betas) now fail in the time it takes to hash the file.

Indexes of format version 1, written before indexes were sealed, hold no digest: they still load,
with a warning, and the next save (or ``qn-hf-convert reshard``) writes a sealed one. An index of
version 2 or later without its digest is refused; a digest is checked whatever the version says, so
editing ``"version": 2`` to ``1`` does not skip it.
"""

from __future__ import annotations

import hashlib
import json

from .atomic import write_bytes_atomic

DIGEST_FIELD = "index_sha256"
SEALED_SINCE = 2  # the first format version whose indexes must carry their digest
_HEAD = b'{\n "' + DIGEST_FIELD.encode() + b'": "'  # json.dumps(..., indent=1) of a dict with it first
_DIGITS = 64
_BLANK = b"0" * _DIGITS


def seal(index: dict) -> bytes:
    """The bytes of ``index`` as written to disk, its digest first."""
    body = json.dumps({DIGEST_FIELD: _BLANK.decode(), **{k: v for k, v in index.items() if k != DIGEST_FIELD}},
                      indent=1).encode()
    assert body.startswith(_HEAD + _BLANK)  # json's layout is what the reader slices
    return _HEAD + hashlib.sha256(body).hexdigest().encode() + body[len(_HEAD) + _DIGITS:]


def write_index(index: dict, path: str) -> None:
    """Write ``index`` sealed to ``path``, whole or not at all (``atomic``)."""
    write_bytes_atomic(path, seal(index))


def seal_problem(data: bytes, index: dict) -> str | None:
    """What is wrong with the digest of an index read as ``data`` (parsed: ``index``), as the rest of a
    sentence that starts with its path, or None. An index without the digest field passes only if its
    version predates sealing."""
    recorded = index.get(DIGEST_FIELD)
    if recorded is None:
        if legacy_note(index) is not None:
            return None
        problem = f"it holds no {DIGEST_FIELD!r} (every index since format version {SEALED_SINCE} is sealed)"
    elif not data.startswith(_HEAD) or data[len(_HEAD):len(_HEAD) + _DIGITS] != str(recorded).encode():
        problem = f"its {DIGEST_FIELD!r} is not its first field, where qn_hf writes it"
    else:
        actual = hashlib.sha256(_HEAD + _BLANK + data[len(_HEAD) + _DIGITS:]).hexdigest()
        if actual == recorded:
            return None
        problem = f"its bytes hash to {actual[:16]}..., it records {str(recorded)[:16]}..."
    return (f"was edited or damaged after it was written: {problem}. Use an intact copy, or resume from another "
            f"checkpoint (to change hyperparameters, set them on the optimizer after loading)")


def legacy_note(index: dict) -> str | None:
    """For an index written before indexes were sealed (no digest, version 1): what a load warns."""
    version = index.get("version")
    if DIGEST_FIELD in index or not isinstance(version, int) or isinstance(version, bool) or version >= SEALED_SINCE:
        return None
    return (f"was written before qn_hf sealed its indexes (format version {version}): it loads without a check of "
            f"its own bytes; the next save writes a sealed one (or run qn-hf-convert reshard on it)")
