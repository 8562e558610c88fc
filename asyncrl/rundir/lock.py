"""One live job per run folder: an advisory ``flock`` on ``RUN/.lock`` that names its holder's PID.

Owns: taking the lock (non-blocking), writing the holder's PID into it, and the refusal message
("in use by PID n"). The lock belongs to an open file description, so it is released when every
process holding it exits, however it exits (SIGKILL included); a launcher passes its descriptor to
the controller it starts (``ASYNCRL_RUN_LOCK_FD``), so the lock stays held while either lives.
Never: waits for a lock, breaks one, or kills the holder.
"""

from __future__ import annotations

import fcntl
import os
from pathlib import Path

from asyncrl.rundir.paths import RunDir

INHERITED_ENV = "ASYNCRL_RUN_LOCK_FD"


class RunFolderInUse(ValueError):
    """Another live process holds the run folder."""


def acquire_run_lock(run_dir: str | Path) -> int:
    """Hold ``run_dir``'s lock; returns the descriptor (keep it open). ``RunFolderInUse`` names the holder."""
    path = RunDir(Path(run_dir)).lock
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
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
