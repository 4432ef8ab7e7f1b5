"""User mistakes end a launched job with one line from rank 0, not a traceback from every rank.

Every rank checks the same things (paths, mesh, options) before any collective, so every rank
reaches the same verdict and exits non-zero on its own; only global rank 0 prints (another rank
prints only a mistake that rank 0 did not share). Anything that is
not a user mistake (a bug) keeps its traceback.
"""

from __future__ import annotations

import os
import sys
import time
from collections.abc import Callable

import torch.distributed as dist

from ..checkpoint import CheckpointError

EXIT_USAGE = 2
REPORT_GRACE_S = 30.0


class UsageError(Exception):
    """A mistake in what the user asked for (a path, a mesh, an option): reported as one line."""


def launched_rank() -> int:
    """Global rank from the live group, else the launcher's environment (before init)."""
    if dist.is_available() and dist.is_initialized():
        return dist.get_rank()
    return int(os.environ.get("RANK", "0"))


def run_cli(main: Callable[[], None]) -> None:
    """Run ``main``; turn a ``UsageError`` or ``CheckpointError`` into ``error: ...`` on rank 0 and
    exit status 2 on every rank."""
    try:
        main()
    except (UsageError, CheckpointError) as e:
        rank = launched_rank()
        if rank != 0:
            # Rank 0 found the same mistake and prints it; when it exits the launcher stops this
            # rank during the wait. Only a mistake this rank alone saw gets printed, after it.
            time.sleep(REPORT_GRACE_S)
        print(f"error: {e}" if rank == 0 else f"error (rank {rank}): {e}", file=sys.stderr, flush=True)
        if dist.is_available() and dist.is_initialized():
            dist.destroy_process_group()
        sys.exit(EXIT_USAGE)
