"""One live job per run folder: an advisory ``flock`` on ``RUN/.lock`` that names its holder's PID.

Owns: taking the lock (non-blocking), writing the holder's PID into it, the refusal message
("in use by PID n"), and telling whether a live job holds a folder (``run_lock_holder``, for readers
such as ``asyncrl replay``). The lock belongs to an open file description, so it is released when every
process holding it exits, however it exits (SIGKILL included); a launcher passes its descriptor to
the controller it starts (``ASYNCRL_RUN_LOCK_FD``), so the lock stays held while either lives.
Never: waits for a lock, breaks one, or kills the holder.
"""

from __future__ import annotations

import fcntl
import os
from pathlib import Path

from asyncrl.rundir.files import raise_if_not_writable
from asyncrl.rundir.paths import RunDir

INHERITED_ENV = "ASYNCRL_RUN_LOCK_FD"


class RunFolderInUse(ValueError):
    """Another live process holds the run folder."""


def acquire_run_lock(run_dir: str | Path) -> int:
    """Hold ``run_dir``'s lock; returns the descriptor (keep it open). ``RunFolderInUse`` names the holder."""
    path = RunDir(Path(run_dir)).lock
    try:
        fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
    except OSError as e:  # a read-only folder: said before anything starts
        raise_if_not_writable(e, run_dir, "run folder", "a run writes its log, checkpoints and metrics there: make "
                              "it writable (remount it read-write, or chmod -R u+w), or copy it to a writable place "
                              "and resume the copy (asyncrl log show, log inspect and replay read it as it is)")
        raise
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        holder = os.pread(fd, 64, 0).decode(errors="replace").strip() or "unknown"
        os.close(fd)
        raise RunFolderInUse(f"run folder {run_dir} is in use by PID {holder} (another train/resume of this run); "
                             "stop that job first, or resume into another copy of the folder") from None
    os.ftruncate(fd, 0)
    os.pwrite(fd, f"{os.getpid()}\n".encode(), 0)
    return fd


def run_lock_holder(run_dir: str | Path) -> str | None:
    """The PID the live job holding ``run_dir``'s lock recorded (``"unknown"`` if it recorded none yet), or
    ``None`` when no live process holds it. Keeps no lock: the test is a non-blocking shared ``flock`` on a
    descriptor of its own, dropped at once (a train or resume of the folder starting in that same instant
    is refused as in use, and can be started again). Creates no lock file."""
    try:
        fd = os.open(RunDir(Path(run_dir)).lock, os.O_RDONLY)
    except FileNotFoundError:
        return None
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
        except BlockingIOError:
            return os.pread(fd, 64, 0).decode(errors="replace").strip() or "unknown"
        fcntl.flock(fd, fcntl.LOCK_UN)
        return None
    finally:
        os.close(fd)


def hold_run_lock(run_dir: str | Path) -> int:
    """The lock a process needs to write ``run_dir``: inherited from its launcher, or taken now."""
    inherited = os.environ.get(INHERITED_ENV, "")
    if inherited.isdigit():
        fd = int(inherited)
        try:
            if os.fstat(fd).st_ino == os.stat(RunDir(Path(run_dir)).lock).st_ino:
                return fd
        except OSError:
            pass
    return acquire_run_lock(run_dir)
