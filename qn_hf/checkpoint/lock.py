"""One job per directory: an advisory lock that says who holds a directory, released when its holder's
process ends however it ends.

Two jobs writing one directory damage each other without a word: one's ``keep_last`` deletes the
other's checkpoints, ``latest`` names the other run's weights, each save removes the other's
``.partial``. So a job holds the directories it writes for as long as it runs, and a second job is
refused with a message that names the holder::

    from qn_hf.checkpoint.lock import DirectoryInUse, hold_directory

    held = hold_directory(out_dir, purpose="the output directory of scripts/train_lm.py")
    try:
        ...                                    # write into out_dir
    finally:
        held.release()

    with hold_directory(out_dir, purpose="...") as held:   # the same, as a context manager
        ...

``hold_directory`` raises ``DirectoryInUse`` (a ``ValueError``) naming the holder's host, pid, start time,
command line and purpose, and the fix. Hold it in one process per job (rank 0) and tell the others
before any collective that depends on it, so that every rank raises the same error instead of waiting
on rank 0 (``pm.save_checkpoint`` sends the outcome with the directory name it chose)::

    refusal = [None]
    if dist.get_rank() == 0:
        try:
            held = hold_directory(out_dir, purpose="...")
        except DirectoryInUse as e:
            refusal[0] = str(e)
    dist.broadcast_object_list(refusal, src=0)
    if refusal[0] is not None:
        raise DirectoryInUse(refusal[0], path=out_dir)

How: ``fcntl.flock`` on ``<dir>/.qn_hf.lock``. The kernel drops the lock when the last descriptor of
its open file closes, so a killed job (SIGKILL, OOM; on NFS, once the server's lease on a lost client
expires) never leaves a stale lock, and no one ever has to delete the file. The file is never removed or replaced: a process that
opened the old file would lock a different one than a process that opened its replacement. flock
conflicts between two opens of the file even in one process, so a second holder in the same process
(another ``ParallelModel`` saving under the same root) is refused too. The holder writes its record
into the file after taking the lock and empties it on release; a record left by a killed holder is
overwritten by the next. The record holds the command line, so the file is as private as the
directory. On a file system without locks (some FUSE mounts) the directory is used unlocked, with a
warning. Descriptors are not inherited across exec; a child forked after the lock was taken (a data
loader worker) keeps it until it exits too.
"""

from __future__ import annotations

import datetime
import errno
import fcntl
import json
import os
import shlex
import socket
import stat
import sys
import time
import warnings
from dataclasses import asdict, dataclass

LOCK_FILE = ".qn_hf.lock"
MAX_RECORD_BYTES = 64 << 10  # a record is a few hundred bytes; a planted huge file is not read whole
MAX_COMMAND_CHARS = 1000
RECORD_WAIT_S = 0.5  # a refused process waits this long for a holder that has just taken the lock to write its record
DEFAULT_FIX = ("Use another directory for this job, or stop the job that holds it first (its lock goes when its "
               "process exits)")


class DirectoryInUse(ValueError):
    """A directory another process holds; the message names the holder and the fix."""

    def __init__(self, message: str, *, path: str, holder: Holder | None = None) -> None:
        super().__init__(message)
        self.path = path
        self.holder = holder


@dataclass(frozen=True)
class Holder:
    """Who holds a directory: what ``hold_directory`` writes into the lock file."""

    host: str
    pid: int
    since: str  # when it took the lock, local time (ISO 8601)
    command: str
    purpose: str

    @classmethod
    def of_this_process(cls, purpose: str) -> Holder:
        return cls(host=socket.gethostname(), pid=os.getpid(),
                   since=datetime.datetime.now().astimezone().isoformat(timespec="seconds"),
                   command=shlex.join(getattr(sys, "orig_argv", sys.argv))[:MAX_COMMAND_CHARS], purpose=purpose)

    def describe(self) -> str:
        me = self.host == socket.gethostname() and self.pid == os.getpid()
        who = ("this process itself, through another model or handle (release it, or let that model go),"
               if me else f"process {self.pid} on host {self.host}")
        return f"{who} holds it for {self.purpose} since {self.since} (command: {self.command})"


class HeldDirectory:
    """A directory this process holds until ``release()`` (or the end of a ``with`` block, or the process)."""

    def __init__(self, path: str, *, fd: int | None, holder: Holder) -> None:
        self.path = path
        self.holder = holder
        self.locked = fd is not None  # False: used without a lock (the file system has none)
        self.released = False
        self._fd = fd
        self._pid = os.getpid()  # a forked child's copy must never drop its parent's lock

    @property
    def held(self) -> bool:
        """Whether the directory is still ours: not released, and not deleted under us (then a new
        directory at the same path has a new lock file that someone else may take)."""
        if self.released or self._fd is None:
            return not self.released
        try:
            now, ours = os.stat(os.path.join(self.path, LOCK_FILE), follow_symlinks=False), os.fstat(self._fd)
        except OSError:
            return False
        return (now.st_dev, now.st_ino) == (ours.st_dev, ours.st_ino)

    def release(self) -> None:
        """Empty the record and drop the lock (also for children forked since, which share it); safe to
        call twice. In a forked child, only its descriptor is closed: the lock is its parent's."""
        fd, self._fd, self.released = self._fd, None, True
        if fd is None:
            return
        try:
            if os.getpid() == self._pid:
                os.ftruncate(fd, 0)  # while still held: no one else's record is cleared
                fcntl.flock(fd, fcntl.LOCK_UN)
        except OSError:
            pass  # the record stays (the next holder overwrites it); closing releases the lock
        finally:
            os.close(fd)

    def __enter__(self) -> HeldDirectory:
        return self

    def __exit__(self, *exc: object) -> None:
        self.release()

    def __del__(self) -> None:  # a handle dropped without release(): its descriptor closes (the lock goes) anyway
        if getattr(self, "_fd", None) is not None:
            try:
                os.close(self._fd)  # not LOCK_UN: this may be a forked child's copy of its parent's handle
            except OSError:
                pass


def hold_directory(path: str, *, purpose: str, fix: str = DEFAULT_FIX) -> HeldDirectory:
    """Hold ``path`` (created if missing) for this process, or raise ``DirectoryInUse`` naming its holder.
    ``purpose`` says what the holder uses it for (it appears in a refusal); ``fix`` what a refused job
    should do instead."""
    os.makedirs(path, exist_ok=True)
    file = os.path.join(path, LOCK_FILE)
    flags = os.O_RDWR | os.O_CREAT | getattr(os, "O_NOFOLLOW", 0) | getattr(os, "O_CLOEXEC", 0)
    try:
        fd = os.open(file, flags, 0o666)
    except OSError as e:
        if e.errno == errno.ELOOP:  # a planted link: following it would lock (and write) a file elsewhere
            raise DirectoryInUse(f"{file} is a symbolic link; qn_hf never follows one there: remove it", path=path) \
                from None
        raise
    holder = Holder.of_this_process(purpose)
    try:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            raise DirectoryInUse(f"{file} is not a regular file; remove it", path=path)
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        os.close(fd)
        other = read_holder(path, wait_s=RECORD_WAIT_S)
        who = other.describe() if other is not None else "another process holds it (its record is unreadable)"
        raise DirectoryInUse(f"{path} is in use: {who}. {fix}", path=path, holder=other) from None
    except OSError as e:
        if e.errno not in (errno.ENOLCK, errno.EOPNOTSUPP, errno.ENOSYS, errno.EINVAL):
            os.close(fd)
            raise
        os.close(fd)
        warnings.warn(f"{path}: this file system does not support locks ({e.strerror}); it is used without one, so "
                      f"nothing stops a second job from writing into it too", stacklevel=2)
        return HeldDirectory(path, fd=None, holder=holder)
    except BaseException:
        os.close(fd)
        raise
    try:
        os.ftruncate(fd, 0)
        os.pwrite(fd, json.dumps(asdict(holder)).encode(), 0)
    except OSError:
        pass  # held all the same; a refusal then says the record is unreadable
    return HeldDirectory(path, fd=fd, holder=holder)


def read_holder(path: str, *, wait_s: float = 0.0) -> Holder | None:
    """The record of whoever holds (or last held, if it was killed) ``path``; None if there is none or it
    cannot be read. ``wait_s``: how long to wait for a holder that has just taken the lock to write it."""
    deadline = time.monotonic() + wait_s
    while True:
        try:
            fd = os.open(os.path.join(path, LOCK_FILE), os.O_RDONLY | getattr(os, "O_NOFOLLOW", 0))
            try:
                data = os.read(fd, MAX_RECORD_BYTES)
            finally:
                os.close(fd)
            fields = json.loads(data)
            return Holder(**{k: (int(fields[k]) if k == "pid" else str(fields[k]))
                             for k in Holder.__dataclass_fields__})
        except (OSError, ValueError, TypeError, KeyError):
            if time.monotonic() >= deadline:
                return None
            time.sleep(0.05)


class HeldDirectories:
    """The directories one job holds, each taken once and kept (a job saves under the same root again
    and again) until ``release()`` or the end of the process."""

    def __init__(self) -> None:
        self.held: dict[str, HeldDirectory] = {}

    def hold(self, path: str, *, purpose: str, fix: str = DEFAULT_FIX) -> HeldDirectory:
        # A directory deleted under us (the HF Trainer rotates its checkpoint-N directories) is let go:
        # its descriptor would be kept for nothing, and a new directory at its path needs its own lock.
        for key in [key for key, h in self.held.items() if not h.held]:
            self.held.pop(key).release()
        key = os.path.realpath(path)
        if key not in self.held:
            self.held[key] = hold_directory(path, purpose=purpose, fix=fix)
        return self.held[key]

    def release(self) -> None:
        for handle in self.held.values():
            handle.release()
        self.held.clear()
