"""Training runs a benchmark starts (``asyncrl train`` as a subprocess of this interpreter) and the resident
memory of their processes.

Owns: the command line and environment of a benchmark's ``asyncrl train`` (the launcher's own for its
children), waiting for it, stopping it by PID (SIGTERM, SIGKILL after two minutes), the run folder it
wrote, the controller's per-step records of it; the role a process of a run plays, read from its command
line (``run_role``), a memory field of ``/proc/PID/status``, ``TreeMemory`` (a thread sampling the RSS of a
process tree: the job's peak, each role's kernel-recorded peak, optionally the timeline) and running any
command with it (``run_measured``). Never: kills a process it did not start, or by name.
"""

from __future__ import annotations

import signal
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import IO, Any

from asyncrl.bench.report import ROOT


def train_env() -> dict[str, str]:
    """Environment of an ``asyncrl train`` started by a benchmark: the launcher's own for its children (one
    thread per process, offline, the repository on the path)."""
    from workers.launcher import child_env

    return child_env()


def train_cmd(overrides: list[str], *, runs_dir: Path | str, run_name: str) -> list[str]:
    """The command line of ``asyncrl train runs_dir=RUNS run_name=NAME *overrides`` under this interpreter."""
    return [sys.executable, "-m", "asyncrl", "train", f"runs_dir={runs_dir}", f"run_name={run_name}", *overrides]


def start_train(overrides: list[str], *, runs_dir: Path, run_name: str, log: IO[bytes]) -> subprocess.Popen:
    """Start ``train_cmd`` with its output going to ``log``; the caller waits for it and, on any exit of its
    own, stops it with ``stop_train`` (by PID). The working directory is the repository root, so the models
    and warm starts are cached in ``.cache/models``."""
    cmd = train_cmd(overrides, runs_dir=runs_dir, run_name=run_name)
    return subprocess.Popen(cmd, cwd=ROOT, env=train_env(), stdout=log, stderr=subprocess.STDOUT)


def train_result(rc: int, overrides: list[str], *, runs_dir: Path, run_name: str, log_path: Path) -> Path:
    """The run folder of a finished ``start_train`` (the launcher prints it); ``RuntimeError`` with the tail
    of the log for a failed run."""
    text = log_path.read_text(errors="replace")
    if rc != 0:
        tail = "\n".join(text.splitlines()[-25:])
        raise RuntimeError(f"asyncrl train {' '.join(overrides)} failed (exit {rc}); log {log_path}:\n{tail}")
    for line in text.splitlines():
        if line.startswith("asyncrl train: run folder "):
            return Path(line.split("run folder ", 1)[1].strip())
    return Path(runs_dir) / run_name


def run_train(overrides: list[str], *, runs_dir: Path, run_name: str, log_path: Path,
              timeout_s: float = 3600.0) -> Path:
    """Run ``asyncrl train runs_dir=RUNS run_name=NAME *overrides`` to completion; return the run folder.

    The launcher's output goes to ``log_path``. On ``timeout_s`` the launcher gets SIGTERM (it stops its
    own children by PID and writes a checkpoint), then SIGKILL after two minutes. A failed run raises
    ``RuntimeError`` with the tail of its log.
    """
    log_path.parent.mkdir(parents=True, exist_ok=True)
    with open(log_path, "wb") as log:
        proc = start_train(overrides, runs_dir=runs_dir, run_name=run_name, log=log)
        try:
            rc = proc.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            stop_train(proc)
            rc = -1
        except BaseException:  # Ctrl-C or SIGTERM (exit_on_sigterm): stop the run we started, then leave
            stop_train(proc)
            raise
    return train_result(rc, overrides, runs_dir=runs_dir, run_name=run_name, log_path=log_path)


def stop_train(proc: subprocess.Popen) -> None:
    """SIGTERM the launcher (it stops its own children by PID), SIGKILL after two minutes."""
    proc.terminate()
    try:
        proc.wait(timeout=120)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()


def exit_on_sigterm() -> None:
    """Turn SIGTERM into ``SystemExit`` so the script's ``finally`` blocks stop what it started."""
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))


def step_records(run_dir: Path) -> list[dict[str, Any]]:
    """The controller's one-per-learner-step metrics records (those carrying the learner's timings)."""
    from asyncrl.metrics import read_metrics

    return [r for r in read_metrics(run_dir) if r.get("time/learner_train_s") is not None]


def run_measured(cmd: list[str], log_path: Path, label: Callable[[str], str | None], what: str,
                 env: dict[str, str], *, interval_s: float = 0.5, timeline: bool = False) -> TreeMemory:
    """Run ``cmd`` to its end (in the repository root) with its output in ``log_path`` and its process
    tree's memory sampled (``TreeMemory``: ``label`` names the processes to track apart); a failure
    raises with the log's last lines."""
    with open(log_path, "wb") as log:
        proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT)
        try:
            with TreeMemory(proc.pid, label, interval_s, timeline=timeline) as mem:
                rc = proc.wait()
        except BaseException:
            stop_train(proc)
            raise
    if rc != 0:
        tail = "\n".join(log_path.read_text(errors="replace").splitlines()[-30:])
        raise RuntimeError(f"{what} failed (exit {rc}); log {log_path}:\n{tail}")
    return mem


def run_role(cmdline: str) -> str | None:
    """The run's role a process plays, from its command line (``workers/launcher.py`` starts them)."""
    if "workers.controller" in cmdline:
        return "controller"
    if "-m workers.learner" in cmdline and "torchrun" not in cmdline:
        return "learner"
    if "workers.generator" in cmdline:
        ids = [w.split("=", 1)[1] for w in cmdline.split() if w.startswith("worker_id=")]
        return ids[0] if ids else "worker"
    if " asyncrl train " in f" {cmdline} ":
        return "launcher"
    return None


def proc_status_bytes(pid: int | str, field: str) -> int:
    """A memory field of ``/proc/PID/status`` in bytes (``VmRSS``: resident now, ``VmHWM``: peak resident so
    far); ``pid`` may be ``"self"``. 0 when the process is gone."""
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                if line.startswith(f"{field}:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 0


class TreeMemory:
    """Samples, in a thread, the resident memory of a process and all its descendants every ``interval_s``.

    ``peak_total_bytes``: the largest sum of RSS over the tree at one sample (the whole job's peak, to
    within one interval). ``peak_by_label``: per label, the largest kernel-recorded peak (``VmHWM``, exact
    up to the last sample before the process exited) of any process that ``label(cmdline)`` names; a
    process whose label is None counts only in the total. With ``timeline=True``, ``timeline`` holds every
    sample: (seconds since the first, RSS bytes summed per label, unlabelled processes under "other").
    """

    def __init__(self, root_pid: int, label: Callable[[str], str | None] = lambda cmdline: None,
                 interval_s: float = 0.5, timeline: bool = False) -> None:
        import threading

        self.root_pid, self.label, self.interval_s = root_pid, label, interval_s
        self.peak_total_bytes = 0
        self.peak_by_label: dict[str, int] = {}
        self.timeline: list[tuple[float, dict[str, int]]] | None = [] if timeline else None
        self._t0 = time.monotonic()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="tree-memory", daemon=True)

    def __enter__(self) -> TreeMemory:
        self._thread.start()
        return self

    def __exit__(self, *exc: Any) -> None:
        self._stop.set()
        self._thread.join()

    def sample(self) -> None:
        import psutil  # type: ignore[import-untyped]

        try:
            root = psutil.Process(self.root_pid)
            procs = [root, *root.children(recursive=True)]
        except psutil.Error:
            return
        total = 0
        by_label: dict[str, int] = {}
        for p in procs:
            try:
                rss = p.memory_info().rss
                name = self.label(" ".join(p.cmdline()))
            except psutil.Error:
                continue
            total += rss
            by_label[name or "other"] = by_label.get(name or "other", 0) + rss
            if name is not None:
                self.peak_by_label[name] = max(self.peak_by_label.get(name, 0), proc_status_bytes(p.pid, "VmHWM"))
        self.peak_total_bytes = max(self.peak_total_bytes, total)
        if self.timeline is not None:
            self.timeline.append((time.monotonic() - self._t0, by_label))

    def _run(self) -> None:
        while not self._stop.is_set():
            self.sample()
            self._stop.wait(self.interval_s)
