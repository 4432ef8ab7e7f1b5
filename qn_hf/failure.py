"""Fail together: when one rank raises inside a step or checkpoint I/O, the others stop waiting
within the timeout and every rank names the rank and error that started it.

Every collective and point-to-point transfer of qn_hf runs on groups created with a bounded
timeout (``parallelize(timeout=...)``), so a rank blocked on a peer that raised gets a
communication error instead of hanging. To make that error useful, the rank that raised first
records "rank r failed in <what>: <error>" in the process group's key-value store (first writer
wins) before re-raising; a rank whose communication then fails reads the record and raises
``PeerFailure`` with it, chained to its own timeout. So the original error is reported once, by
the rank that had it, and the others say whom they were waiting for.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch.distributed as dist

FAILURE_KEY = "qn_hf/first_failure"
_COMM_ERRORS = ("timed out", "timeout", "connection closed", "connection reset", "pair closure", "broken pipe")


class PeerFailure(RuntimeError):
    """This rank stopped because another rank failed first (the message names it)."""


def _store():
    # The default group's store: the one rendezvous every rank shares (torch exposes no public getter).
    try:
        return dist.distributed_c10d._get_default_store()
    except (RuntimeError, AttributeError, ValueError):
        return None


def is_comm_error(error: BaseException) -> bool:
    if isinstance(error, getattr(dist, "DistError", ())):
        return True
    return isinstance(error, RuntimeError) and any(s in str(error).lower() for s in _COMM_ERRORS)


class FailTogether:
    """One per ``ParallelModel``. Operations are numbered in call order, which is the same on
    every rank of an SPMD program, and a failure is recorded under its operation's number, so a
    rank that times out cites a failure of the same (or the previous) operation, never a stale one
    from an error that was caught and recovered from long ago."""

    def __init__(self) -> None:
        self.operation = 0

    @contextlib.contextmanager
    def guard(self, what: str) -> Iterator[None]:
        """Run a communicating operation (``what`` names it in messages) under the rules above."""
        self.operation += 1
        number = self.operation
        try:
            yield
        except PeerFailure:
            raise
        except Exception as e:
            if not (dist.is_available() and dist.is_initialized()):
                raise
            rank = dist.get_rank()
            if is_comm_error(e):
                for n in (number, number - 1, number + 1):
                    origin = _read(n)
                    if origin is not None and not origin.startswith(f"rank {rank} "):
                        raise PeerFailure(f"rank {rank} stopped in {what}: {origin}") from e
                raise
            _record(number, f"rank {rank} failed in {what}: {type(e).__name__}: {e}")
            raise


def _read(number: int) -> str | None:
    store = _store()
    if store is None:
        return None
    key = f"{FAILURE_KEY}/{number}"
    try:
        return store.get(key).decode() if store.check([key]) else None
    except (RuntimeError, ValueError):
        return None


def _record(number: int, message: str) -> None:
    store = _store()
    if store is None:
        return
    try:
        store.compare_set(f"{FAILURE_KEY}/{number}", "", message)  # only the first failure of this operation
    except (RuntimeError, ValueError):
        pass
