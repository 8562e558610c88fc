"""Driving ``asyncrl`` commands from the integration tests: run one to its end, or wait for a run's step.

A test that interrupts a run (Ctrl-C, a killed role) at step ``s`` gives it many more steps than ``s``:
the tiny model trains a step in a fraction of a second, so with a handful of steps left the run can
finish between ``wait_for_step`` returning and the signal landing, and the test would then check a
finished run instead of an interrupted one.
"""

from __future__ import annotations

import subprocess
import time
from pathlib import Path

from asyncrl.metrics import read_metrics

POLL_S = 0.1


def asyncrl(procs, *args: str, timeout: float = 900) -> subprocess.CompletedProcess:
    """``python -m asyncrl ARGS`` to its end under ``procs`` (stdout and stderr together, as text)."""
    proc = procs.python("-m", "asyncrl", *args, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    out, _ = proc.communicate(timeout=timeout)
    return subprocess.CompletedProcess(proc.args, proc.returncode, out.decode(errors="replace"), "")


def run_script(procs, script: str | Path, *args: str, log: Path, timeout: float) -> int:
    """``python SCRIPT ARGS`` to its end under ``procs``, stdout and stderr into ``log``: its exit status. A script
    that does not end within ``timeout`` fails the test, showing the tail of its log."""
    import pytest

    with open(log, "wb") as f:
        proc = procs.python(str(script), *args, stdout=f, stderr=subprocess.STDOUT)
        try:
            return proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            pytest.fail(f"{Path(script).name} did not finish in {timeout} s:\n{log.read_text()[-3000:]}")


def reached_step(run_dir: Path) -> int:
    """The newest step in the run's ``metrics.jsonl`` (-1 before the first whole row; a row still being
    written is skipped by ``read_metrics``)."""
    return max((r["step"] for r in read_metrics(run_dir)), default=-1)


def wait_for_step(run_dir: Path, step: int, proc, timeout: float = 600) -> None:
    """Return once the run of ``proc`` logged ``step``; fail if ``proc`` ends first or ``timeout`` passes."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if reached_step(run_dir) >= step:
            return
        if proc.poll() is not None:  # it may have logged the step as it ended
            assert reached_step(run_dir) >= step, "the run ended before the step was reached"
            return
        time.sleep(POLL_S)
    raise AssertionError(f"step {step} not reached in {timeout:.0f} s")
