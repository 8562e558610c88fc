"""Shared plumbing of the bench_*.py scripts: the --quick/--json convention and the printed table.

Every benchmark prints one table whose key column is a ratio measured in the same run, and writes
the same rows as JSON (``--json PATH``; default ``benchmarks/results/<name>.json``) together with
the machine and the command, so a figure in docs/benchmarks.md can be traced to its run.
"""

from __future__ import annotations

import argparse
import datetime
import json
import math
import os
import platform
import random
import signal
import statistics
import subprocess
import sys
import time
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import IO, Any

from asyncrl.machine import cpu_model, describe, int8_dot_native, machine_record

ROOT = Path(__file__).resolve().parent.parent
_LOADAVG_AT_START = list(os.getloadavg())  # the machine is shared: record how busy it was


def parser(name: str, description: str, *, smoke: bool = False) -> argparse.ArgumentParser:
    """The shared options. ``smoke=True`` adds ``--smoke``: the smallest run that exercises every code
    path of the script (seconds to a minute; its figures mean nothing), used by the tests."""
    p = argparse.ArgumentParser(prog=f"{name}.py", description=description,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--quick", action="store_true", help="a run of a minute or two (smaller sizes, fewer repeats)")
    if smoke:
        p.add_argument("--smoke", action="store_true",
                       help="smallest run that exercises every code path (tests; figures are meaningless)")
    p.add_argument("--json", metavar="PATH", default=str(ROOT / "benchmarks" / "results" / f"{name}.json"),
                   help="write the table as JSON here (default: %(default)s)")
    return p


def sync_run_args(p: argparse.ArgumentParser, *, runs: str, formats: str) -> None:
    """The options of the weight-sync benchmarks that train a model for consecutive versions (bench_delta.py,
    bench_buckets.py): which model, runs (full fine-tuning, LoRA), formats, how many versions, batch size."""
    p.add_argument("--model", default=None, help="smollm2 (default) or tiny (the --smoke default)")
    p.add_argument("--runs", default=runs, help="comma list of full, lora (default: %(default)s)")
    p.add_argument("--formats", default=formats, help="comma list (default: %(default)s)")
    p.add_argument("--versions", type=int, default=None, help="consecutive versions after the first "
                                                              "(default 6, quick 3, smoke 2)")
    p.add_argument("--batch", type=int, default=16, help="questions per optimiser step (default 16)")


def machine() -> dict[str, Any]:
    """Where the numbers come from: the CPU's model, cores and the ISA flags the numerics choose by
    (asyncrl/machine.py), and the commit. ``commit`` is HEAD of the checkout the script runs from, with
    ``dirty`` true when tracked files differ from it; a snapshot exported with ``git archive`` (no ``.git``;
    used to benchmark a fixed commit while others edit the shared checkout) names its commit in
    ``$ASYNCRL_BENCH_COMMIT``."""
    def git(*args: str) -> str:
        try:
            out = subprocess.run(["git", *args], cwd=ROOT, capture_output=True, text=True, check=False)
        except OSError:
            return ""
        return out.stdout.strip() if out.returncode == 0 else ""

    commit = git("rev-parse", "--short", "HEAD")
    dirty = bool(git("status", "--porcelain", "--untracked-files=no")) if commit else False
    if not commit:
        commit = os.environ.get("ASYNCRL_BENCH_COMMIT", "")
    return {"platform": platform.platform(), "python": platform.python_version(), "cpus": os.cpu_count(),
            "processor": cpu_model(), **machine_record(), "commit": commit, "dirty": dirty,
            "loadavg_at_start": _LOADAVG_AT_START, "loadavg_at_write": list(os.getloadavg())}


class WorkerChild:
    """A weight-sync benchmark's worker side in a spawned process: ``target(conn, *args)`` receives the weight
    server's ``addresses``, answers ``"ready"``, then one reply per ``ask(request)`` until ``None`` ends it.
    A context manager: leaving it ends the child (terminated if it does not stop by itself)."""

    def __init__(self, target: Callable[..., None], args: tuple, addresses: tuple[str, str], timeout_s: float) -> None:
        import multiprocessing as mp

        ctx = mp.get_context("spawn")
        self.conn, child = ctx.Pipe()
        self.proc = ctx.Process(target=target, args=(child, *args), daemon=True)
        self.timeout_s = timeout_s
        self.proc.start()
        self.conn.send(addresses)
        if not self.conn.poll(timeout_s) or self.conn.recv() != "ready":
            self.close()
            raise RuntimeError("the worker child did not start")

    def ask(self, request: Any) -> Any:
        """Send ``request`` and wait (up to the timeout) for the child's answer."""
        self.conn.send(request)
        if not self.conn.poll(self.timeout_s):
            raise RuntimeError(f"the worker child did not answer {request!r}")
        return self.conn.recv()

    def close(self) -> None:
        if self.proc.is_alive():
            try:
                self.conn.send(None)
            except OSError:
                pass
            self.proc.join(60)
        if self.proc.is_alive():
            self.proc.terminate()
            self.proc.join(10)

    def __enter__(self) -> WorkerChild:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def print_table(title: str, rows: list[dict[str, Any]], columns: list[str]) -> None:
    def fmt(v: Any) -> str:
        if isinstance(v, float):
            return f"{v:.4g}" if abs(v) < 1e5 else f"{v:.3e}"
        return str(v)

    cells = [[fmt(r.get(c, "")) for c in columns] for r in rows]
    widths = [max(len(c), *(len(row[i]) for row in cells)) for i, c in enumerate(columns)]
    print(f"\n{title}")
    print("  ".join(c.ljust(w) for c, w in zip(columns, widths, strict=True)))
    print("  ".join("-" * w for w in widths))
    for row in cells:
        print("  ".join(v.ljust(w) for v, w in zip(row, widths, strict=True)))


def write_json(path: str, name: str, tables: dict[str, list[dict[str, Any]]], args: argparse.Namespace,
               **extra: Any) -> None:
    out = {"benchmark": name, "date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
           "command": " ".join([Path(sys.argv[0]).name, *sys.argv[1:]]), "quick": bool(args.quick),
           "smoke": bool(getattr(args, "smoke", False)),
           "machine": machine(), "tables": tables, **extra}
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    Path(path).write_text(json.dumps(out, indent=2))
    print(f"\nwrote {path}")
    print(f"measured on {describe()}; the CPU int8 kernel here: "
          f"{'int_mm (torch._int_mm)' if int8_dot_native() else 'int_mm_fp32 (no int8 dot product)'}")


# ------------------------------------------------------------------ confidence intervals
# two-sided 97.5% Student t quantiles for 1..30 degrees of freedom
T975 = [12.706, 4.303, 3.182, 2.776, 2.571, 2.447, 2.365, 2.306, 2.262, 2.228, 2.201, 2.179, 2.160, 2.145,
        2.131, 2.120, 2.110, 2.101, 2.093, 2.086, 2.080, 2.074, 2.069, 2.064, 2.060, 2.056, 2.052, 2.048,
        2.045, 2.042]


def ci95(xs: Sequence[float | None]) -> tuple[float, float]:
    """(mean, half-width of the 95% CI from Student's t) over the finite values of ``xs``; half-width nan
    for fewer than 2 values, both nan for none."""
    vals = [x for x in xs if x is not None and math.isfinite(x)]
    if not vals:
        return math.nan, math.nan
    if len(vals) < 2:
        return vals[0], math.nan
    t = T975[len(vals) - 2] if len(vals) - 1 <= len(T975) else 1.96
    return statistics.fmean(vals), t * statistics.stdev(vals) / math.sqrt(len(vals))


def wilson(k: int, n: int, z: float = 1.959964) -> tuple[float, float]:
    """Wilson score interval of a proportion ``k/n`` (95% for the default ``z``); ``(nan, nan)`` if n=0."""
    if n <= 0:
        return (math.nan, math.nan)
    p = k / n
    centre = (p + z * z / (2 * n)) / (1 + z * z / n)
    half = z * math.sqrt(p * (1 - p) / n + z * z / (4 * n * n)) / (1 + z * z / n)
    return (max(0.0, centre - half), min(1.0, centre + half))


# ------------------------------------------------------------------ ratios that hold still
def interleaved(paths: Mapping[str, Callable[[], float]], rounds: int, *, warmup: int = 1,
                seed: int = 0) -> dict[str, Any]:
    """Run every compared path once per round, ``rounds`` times, the order shuffled each round (seeded).

    Each callable measures itself once and returns its figure (seconds, or a rate). ``warmup`` rounds
    run first and are dropped. Paths measured in the same round saw the same machine load, so the
    ratio of two paths is taken per round (``ratio_stats``) before any summary: a neighbour's burst
    moves both figures of one round, not one path's best against another's worst. Returns
    ``{"values": {path: [figure per round]}, "load": [1-min load average after each round], "order":
    [[paths in the order run] per round]}``.
    """
    if rounds < 1:
        raise ValueError(f"rounds must be >= 1, got {rounds}")
    rng = random.Random(seed)
    names = list(paths)
    values: dict[str, list[float]] = {n: [] for n in names}
    load: list[float] = []
    order: list[list[str]] = []
    for r in range(warmup + rounds):
        this = names[:]
        rng.shuffle(this)
        got = {n: float(paths[n]()) for n in this}
        if r < warmup:
            continue
        for n in names:
            values[n].append(got[n])
        load.append(os.getloadavg()[0])
        order.append(this)
    return {"values": values, "load": load, "order": order}


def ratio_stats(num: Sequence[float], den: Sequence[float]) -> dict[str, float]:
    """Per-round ratios ``num[i] / den[i]`` summarised: median, min, max, and the interquartile spread
    relative to the median (``spread`` = (q3 - q1) / median; 0.05 means the middle half of the rounds
    lies within 5% of each other)."""
    if len(num) != len(den) or not num:
        raise ValueError(f"need the same non-zero number of rounds, got {len(num)} and {len(den)}")
    ratios = [a / b for a, b in zip(num, den, strict=True)]
    med = statistics.median(ratios)
    if len(ratios) >= 2:
        q1, _, q3 = statistics.quantiles(ratios, n=4, method="inclusive")
    else:
        q1 = q3 = med
    return {"ratio_median": med, "ratio_min": min(ratios), "ratio_max": max(ratios),
            "spread": (q3 - q1) / med if med else float("nan"), "rounds": len(ratios)}


def load_average_stats(load: Sequence[float]) -> dict[str, float]:
    """The 1-min load average seen across the rounds (median, max) and the machine's core count."""
    return {"load_median": statistics.median(load) if load else float("nan"),
            "load_max": max(load) if load else float("nan"), "cpus": float(os.cpu_count() or 0)}


def print_ratio(label: str, stats: Mapping[str, float], load: Mapping[str, float] | None = None) -> None:
    """One line: median ratio, [min, max], spread, rounds, and the load average during the rounds."""
    line = (f"{label}: {stats['ratio_median']:.3f}x median of {int(stats['rounds'])} interleaved rounds "
            f"[min {stats['ratio_min']:.3f}, max {stats['ratio_max']:.3f}, IQR/median {stats['spread']:.1%}]")
    if load is not None:
        line += f"; load average {load['load_median']:.2f} (max {load['load_max']:.2f}) on {int(load['cpus'])} cpus"
    print(line, flush=True)


# ------------------------------------------------------------------ training runs as subprocesses
def device_sync(device: Any) -> None:
    """Wait for the work queued on ``device`` (a ``torch.device`` or its name) before a clock is read: a
    CUDA synchronize; nothing on the CPU, which runs ops as they are called."""
    import torch

    device = torch.device(device)
    if device.type == "cuda":
        torch.cuda.synchronize(device)


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


# ------------------------------------------------------------------ resident memory of a process tree
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


def run_measured(cmd: list[str], log_path: Path, label, what: str, env: dict, *, interval_s: float = 0.5,
                 timeline: bool = False) -> TreeMemory:
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

    def __init__(self, root_pid: int, label=lambda cmdline: None, interval_s: float = 0.5,
                 timeline: bool = False) -> None:
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
        import psutil

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
