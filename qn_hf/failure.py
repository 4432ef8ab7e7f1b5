"""Fail together: when one rank raises inside a step or checkpoint I/O, the others stop waiting
within the timeout and every rank names the rank and error that started it.

Every collective and point-to-point transfer of qn_hf runs on groups created with a bounded
timeout (``parallelize(timeout=...)``), so a rank blocked on a peer that raised gets a
communication error instead of hanging. To make that error useful, the rank that raised first
records "rank r failed in <what>: <error>" in the process group's key-value store (first writer
wins) before re-raising; a rank whose communication then fails reads the record and raises
``PeerFailure`` with it, chained to its own timeout. So the original error is reported once, by
the rank that had it, and the others say whom they were waiting for.

NCCL is different: a collective that never completes does not raise in Python. The host has
usually run ahead (kernels are queued, not run) and blocks wherever it next reads device data,
often in the user's own code; NCCL's watchdog then ends the process when the group's timeout
expires (``TORCH_NCCL_ASYNC_ERROR_HANDLING``, which ``init_distributed`` turns on when it creates the
group, as torchrun does), with its own "Watchdog caught collective operation timeout" message. So
that the cause appears there too, a watcher thread per rank polls the store once a second and prints
the first failure another rank recorded (one line on stderr, once) while this rank waits; it
changes nothing else. Under torchrun the agent stops every rank as soon as the failing one exits.

A rank that fails outside qn_hf (an exception the user's code caught, then a barrier of its own) records
nothing, and its peers' timeout named no cause. The watcher also writes, once a second, which operation
this rank is in (``PROGRESS_KEY``, off the step's path); a rank whose communication fails with no failure
recorded names the ranks last seen in an earlier operation: those it was waiting for.
"""

from __future__ import annotations

import contextlib
import json
import os
import sys
import threading
import time
import weakref
from collections.abc import Iterator

import torch.distributed as dist

from .comm import failures

FAILURE_KEY = "qn_hf/first_failure"
PROGRESS_KEY = "qn_hf/operation"  # /<rank>: "<number> <what>", the operation it was last seen in
_COMM_ERRORS = ("timed out", "timeout", "connection closed", "connection reset", "pair closure", "broken pipe")
WATCH_INTERVAL_S = 1.0


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
        self.operation, self.what = 0, ""
        self.failed: set[int] = set()  # operations this rank raised in itself
        self.last_active = time.monotonic()  # when an operation last started or ended
        self._watcher: threading.Thread | None = None

    @contextlib.contextmanager
    def guard(self, what: str) -> Iterator[None]:
        """Run a communicating operation (``what`` names it in messages) under the rules above."""
        self.operation += 1
        number, self.what = self.operation, what
        self.last_active = time.monotonic()
        self._watch()
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
                behind = _behind(number)
                if behind:
                    raise PeerFailure(f"rank {rank} stopped in {what} ({type(e).__name__}: {str(e)[:300]}): no rank "
                                      f"recorded a failure in qn_hf, and {behind}: such a rank failed or waits outside "
                                      f"qn_hf (an exception your code caught, a barrier of its own, a data loader); "
                                      f"its own output says which") from e
                raise
            self.failed.add(number)
            _record(number, f"rank {rank} failed in {what}: {type(e).__name__}: {e}")
            raise
        finally:
            self.last_active = time.monotonic()

    def _watch(self) -> None:
        """Start the watcher thread unless it runs (a daemon: it never keeps a finished process alive)."""
        running = self._watcher is not None and self._watcher.is_alive()
        if not running and dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
            self._watcher = threading.Thread(target=_watch_loop, args=(weakref.ref(self), dist.get_rank()), daemon=True,
                                             name="qn_hf-fail-together")
            self._watcher.start()


# The watcher stops once its model has started or finished no operation for this long (the next
# operation starts it again): a model left idle (a script that made several, a test world) keeps no
# thread polling the store. The wait covers the time an NCCL host runs ahead of its device.
WATCH_IDLE_S = 30.0


def _watch_loop(owner: weakref.ref, rank: int) -> None:
    """Print the first failure another rank recorded for the owner's current (or previous) operation,
    once it has stood for a whole interval without this rank failing in it too (the same error raised
    on every rank, e.g. a refused batch, is each rank's own and not printed). Ends with its owner
    (held weakly), the process group, or ``WATCH_IDLE_S`` without an operation."""
    seen: dict[int, str] = {}
    while True:
        time.sleep(WATCH_INTERVAL_S)
        watched = owner()
        if watched is None or not dist.is_initialized() or time.monotonic() - watched.last_active > WATCH_IDLE_S:
            return
        current, failed, what = watched.operation, set(watched.failed), watched.what
        del watched
        _set(f"{PROGRESS_KEY}/{rank}", f"{current} {what}")
        for n in (current, current - 1):
            origin = _read(n)
            if origin is None or origin.startswith(f"rank {rank} ") or n in failed:
                continue
            if seen.get(n) == origin:
                print(f"qn_hf: rank {rank} is waiting on a rank that failed: {origin}. It stops when the "
                      f"communication timeout expires (under NCCL, the watchdog then ends the process).",
                      file=sys.stderr, flush=True)
                return
            seen[n] = origin


def _read(number: int) -> str | None:
    store = _store()
    if store is None:
        return None
    key = f"{FAILURE_KEY}/{number}"
    try:
        return store.get(key).decode() if store.check([key]) else None
    except (RuntimeError, ValueError):
        return None


def _behind(number: int) -> str:
    """The other ranks last seen (by their watchers) in an operation before ``number``, or never: "" if none."""
    store = _store()
    if store is None:
        return ""
    seen = []
    for peer in (r for r in range(dist.get_world_size()) if r != dist.get_rank()):
        key = f"{PROGRESS_KEY}/{peer}"
        try:
            at = store.get(key).decode().split(" ", 1) if store.check([key]) else None
        except (RuntimeError, ValueError):
            return ""
        if at is None:
            seen.append(f"rank {peer} was never seen in one")
        elif int(at[0]) < number:
            seen.append(f"rank {peer} was last seen in {at[1] or 'an operation'} (qn_hf's operation {at[0]}; this is "
                        f"{number})")
    return "; ".join(seen)


def _set(key: str, value: str) -> None:
    store = _store()
    if store is not None:
        try:
            store.set(key, value)
        except (RuntimeError, ValueError):
            pass


def _record(number: int, message: str) -> None:
    store = _store()
    if store is None:
        return
    try:
        store.compare_set(f"{FAILURE_KEY}/{number}", "", message)  # only the first failure of this operation
    except (RuntimeError, ValueError):
        pass


def raise_together(failed: tuple[str, Exception] | None, *, group=None) -> None:
    """Raise the same error on every rank of ``group`` if any rank failed: ``failed`` is this rank's
    (what it was doing, the error) or None. The ranks gather every outcome (``comm.failures``, a
    collective every rank must enter) and raise the first failing rank's error: its type where that is
    a ValueError (a refusal), else RuntimeError naming it; the message says which ranks failed where,
    unless every rank failed alike (a refusal any rank would make). On a failing rank it is chained to
    the original, whose traceback shows where."""
    mine = None if failed is None else json.dumps([failed[0], type(failed[1]).__name__, str(failed[1])])
    gathered = failures(mine, group=group)
    if not gathered:
        return
    world = dist.get_world_size(group)
    where, kind, message = json.loads(gathered[0][1])
    ranks = [r for r, _ in gathered]
    if len(ranks) < world or len({m for _, m in gathered}) > 1:
        others = "" if len(ranks) == 1 else f" (ranks {ranks} failed, the first shown)"
        message = f"{message} [rank {ranks[0]} of {world} failed in '{where}'{others}; every rank raises this]"
    error = ValueError(message) if kind == "ValueError" else \
        RuntimeError(message if kind == "RuntimeError" else f"{kind}: {message}")
    refused_on_every_rank(error)
    raise error from (failed[1] if failed is not None else None)


def refused_on_every_rank(error: BaseException) -> BaseException:
    """Mark ``error`` as a refusal every rank raises alike before any communication (a configuration
    parallelize refuses): it is still raised everywhere, so nothing waits, but a rank other than 0
    that lets it end the process prints one line instead of its traceback, since rank 0 prints the
    same error in full. Returns ``error``."""
    rank = int(os.environ.get("RANK", "0")) if not (dist.is_available() and dist.is_initialized()) else dist.get_rank()
    if rank != 0:
        error.qn_hf_same_as_rank_0 = rank  # read by the hook below, and only for this exception
        if not isinstance(sys.excepthook, _OneLine):
            sys.excepthook = _OneLine(sys.excepthook)
    return error


class _OneLine:
    """``sys.excepthook`` for errors ``refused_on_every_rank`` marked; anything else goes to the hook
    that was there before."""

    def __init__(self, previous) -> None:
        self.previous = previous

    def __call__(self, kind, value, tb) -> None:
        rank = getattr(value, "qn_hf_same_as_rank_0", None)
        if rank is None:
            self.previous(kind, value, tb)
            return
        first = str(value).splitlines()[0] if str(value) else ""
        print(f"[rank {rank}] {kind.__name__}: {first} (raised on every rank alike; rank 0 shows the traceback)",
              file=sys.stderr, flush=True)
        # Let rank 0 exit first: a launcher that stops the job when one rank fails (torchrun,
        # accelerate) then names rank 0, with its traceback, as the first failure.
        time.sleep(REPORT_GRACE_S)


REPORT_GRACE_S = 10.0
