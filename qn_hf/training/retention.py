"""Which checkpoints a training run keeps, so that the divergence guard always has a good one to fall back to.

A checkpoint of step k holds the weights after k updates; nothing says they are good until step k+1
computes a finite loss and gradient norm from them. A step's update can wreck the weights (a far
too large learning rate) while its own loss was still finite: the checkpoint written right after
it looks whole, and the next step's loss is NaN. Pruning to the newest ``keep_last`` at save time
would then delete the last checkpoint a finite step vouched for and leave only the wrecked one.

So checkpoints are saved without pruning, and ``Retention`` prunes only when a finite step has
vouched for every checkpoint on disk: at most one checkpoint (the newest save) is ever unvouched,
so at most ``keep_last + 1`` exist. When the guard stops a run, ``fall_back`` sets the unvouched
checkpoint aside (renamed out of the checkpoint names, kept for inspection) and points ``latest``
at the newest vouched one, so ``--resume`` continues from the last good state.

Rank 0 alone touches the files (as ``save_checkpoint`` publishes and prunes on rank 0); every rank
tracks the same names, so every rank's error message names the same checkpoint.
"""

from __future__ import annotations

import os

from ..checkpoint.atomic import remove_entry
from ..checkpoint.files import fsync_dir, prune, write_json
from ..checkpoint.names import LATEST

SET_ASIDE = ".diverged"  # suffix of a checkpoint the next step proved bad: no longer a checkpoint name


class Retention:
    def __init__(self, root: str, *, keep_last: int, resumed_from: str | None, active: bool) -> None:
        self.root = root
        self.keep_last = keep_last
        self.active = active  # rank 0: the one that prunes and renames
        # The checkpoint a run resumes from is where it starts: the last good state until it saves.
        self.good: str | None = resumed_from
        self.pending: str | None = None  # saved by this run, not yet vouched for by a finite step
        self.prune_due = resumed_from is not None  # an earlier run may have left keep_last + 1

    def saved(self, path: str) -> None:
        """``path`` was just written (with ``keep_last=None``): kept, beside the newest vouched one."""
        self.pending = path
        self.prune_due = True

    def vouched(self) -> None:
        """A step computed a finite loss and gradient norm from the current weights: every checkpoint
        saved before it is good, and retention may drop all but the newest ``keep_last``."""
        if self.pending is not None:
            self.good, self.pending = self.pending, None
        if self.prune_due and self.active and os.path.isdir(self.root):
            prune(self.root, keep_last=self.keep_last)
        self.prune_due = False

    def fall_back(self) -> str | None:
        """The run diverged: set aside the checkpoint no finite step vouched for, make the newest
        vouched one ``latest`` again, and return it (None: no checkpoint holds a good state)."""
        if self.pending is not None and self.active:
            aside = self.pending + SET_ASIDE
            remove_entry(aside)
            os.rename(self.pending, aside)
            if self.good is not None and os.path.dirname(os.path.abspath(self.good)) == os.path.abspath(self.root):
                write_json(os.path.basename(self.good), os.path.join(self.root, LATEST))
            else:  # nothing good in this directory: --resume starts over rather than from the wreck
                remove_entry(os.path.join(self.root, LATEST))
            fsync_dir(self.root)
        self.pending = None
        return self.good
