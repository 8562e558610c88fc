"""Shared fixtures: one thread per process, and process tracking by PID.

Every process a test starts goes through ``procs`` and is ended by PID at teardown (SIGTERM,
then SIGKILL after a grace period). Nothing is ever killed by name.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import pytest

os.environ.setdefault("OMP_NUM_THREADS", "1")
os.environ.setdefault("MKL_NUM_THREADS", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
os.environ.setdefault("HF_HUB_OFFLINE", "1")

try:  # torch is a runtime dependency, but protocols tests must not need it loaded first
    import torch

    torch.set_num_threads(1)
except ImportError:  # pragma: no cover
    pass

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


class ProcessTracker:
    """Starts child processes and ends exactly those, by PID."""

    def __init__(self) -> None:
        self.children: list[subprocess.Popen] = []

    def spawn(self, args: list[str], **kwargs) -> subprocess.Popen:
        env = dict(os.environ)
        env.setdefault("PYTHONPATH", REPO_ROOT)
        env.update(kwargs.pop("env", {}) or {})
        kwargs.setdefault("cwd", REPO_ROOT)
        proc = subprocess.Popen(args, env=env, **kwargs)
        self.children.append(proc)
        return proc

    def python(self, *args: str, **kwargs) -> subprocess.Popen:
        return self.spawn([sys.executable, *args], **kwargs)

    def stop_all(self, grace_s: float = 5.0) -> None:
        """SIGTERM each child, SIGKILL it after ``grace_s``, then SIGKILL whatever it started that is still
        alive (its descendants, recorded by PID before the children were signalled: a killed launcher
        or torchrun agent must not leave processes behind)."""
        import psutil

        descendants: list[psutil.Process] = []
        for proc in self.children:
            try:
                descendants += psutil.Process(proc.pid).children(recursive=True)
            except psutil.NoSuchProcess:
                pass
        for proc in self.children:
            if proc.poll() is None:
                proc.send_signal(signal.SIGTERM)
        deadline = time.monotonic() + grace_s
        for proc in self.children:
            remaining = max(0.0, deadline - time.monotonic())
            try:
                proc.wait(timeout=remaining)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait(timeout=5)
        _, alive = psutil.wait_procs(descendants, timeout=max(0.0, deadline - time.monotonic()))
        for p in alive:
            try:
                p.kill()
            except psutil.NoSuchProcess:
                pass


@pytest.fixture
def procs():
    tracker = ProcessTracker()
    try:
        yield tracker
    finally:
        tracker.stop_all()
