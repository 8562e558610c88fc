"""Process lifetime: a child that must not outlive the process that started it.

Owns: ``die_with_parent`` (Linux ``PR_SET_PDEATHSIG``), used by each learner rank so that a killed
torchrun agent (SIGKILL included, which it cannot forward) does not leave ranks holding ports.
Never: kills any process but the caller itself.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import os
import signal
import sys

PR_SET_PDEATHSIG = 1


def die_with_parent(sig: int = signal.SIGKILL) -> bool:
    """Ask the kernel to send ``sig`` to this process when its parent exits; True if armed.

    If the parent is already gone (it died before this call), exits at once.
    """
    if not sys.platform.startswith("linux"):
        return False
    parent = os.getppid()
    libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
    if libc.prctl(PR_SET_PDEATHSIG, sig, 0, 0, 0) != 0:
        return False
    if os.getppid() != parent:  # orphaned before the signal was armed
        os._exit(128 + sig)
    return True
