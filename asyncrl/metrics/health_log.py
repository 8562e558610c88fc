"""The run folder's record of training-health alarms: ``run_dir/health.jsonl``, and the controller's watch.

Owns: the file (one strict-JSON object per alarm: ``step``, ``time``, ``alarm``, ``value``,
``threshold``, ``threshold_key``, ``message``, ``cause``, ``fix``, ``stop``), its one-line rendering
(``format_alarm``: what the launcher prints and ``asyncrl log show`` lists), reading it back, and
``HealthWatch``: the ``HealthMonitor`` of a live run, fed every ``metrics.jsonl`` record the controller
writes, which logs each alarm, appends it to the file, and names the ``learner.stop_on`` alarm that
ends training.
Never: stops a process itself (the controller answers the learner's next batch request with
``Shutdown``, the ``learner.time_budget_s`` path), or rewrites a record except the explicit purge on
resume (records after the resumed step, which the resumed run raises again).

Invariants:
- A line is written with one ``os.write`` on an ``O_APPEND`` descriptor: a reader following the file
  (``tail_metrics`` reads it too: every record has an int ``step``) sees whole lines only.
- A resumed controller replays the kept ``metrics.jsonl`` records through a fresh monitor, so windows,
  early values and the rate limit continue as if the run had never stopped.
"""

from __future__ import annotations

import json
import logging
import os
import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from asyncrl.config.health import HealthConfig
from asyncrl.metrics.health import Alarm, HealthMonitor, health_config, replay
from asyncrl.metrics.writer import parse_line, purge_records, read_metrics
from asyncrl.rundir import RunDir

log = logging.getLogger("asyncrl.health")

def health_path(run_dir: str | Path) -> Path:
    return RunDir(Path(run_dir)).health


def format_alarm(record: Mapping[str, Any]) -> str:
    """``health alarm zero_variance at step 12: ...; likely cause: ...; try ...`` (one line)."""
    stop = " -> stopping (learner.stop_on)" if record.get("stop") else ""
    return (f"health alarm {record.get('alarm')} at step {record.get('step')}: {record.get('message')}; "
            f"likely cause: {record.get('cause')}; try {record.get('fix')}{stop}")


def read_alarms(run_dir: str | Path) -> list[dict[str, Any]]:
    """The alarms of a run in file order ([] when none were raised); corrupt lines are skipped."""
    path = health_path(run_dir)
    if not path.exists():
        return []
    out = []
    for raw in path.read_bytes().split(b"\n"):
        if raw.strip() and (rec := parse_line(raw)) is not None and "alarm" in rec:
            out.append(rec)
    return out


class HealthWatch:
    """The controller's watch over a live run. ``observe(step, record)`` with every metrics record it
    writes; ``stop_reason`` becomes set (once) when an alarm named in ``stop_on`` fires.

    ``resume_step``: the version a resumed run continues from: records of the old run after it are
    dropped from ``health.jsonl`` and the kept ``metrics.jsonl`` records (already purged by the
    ``MetricsWriter``) are replayed into the monitor without being raised again."""

    def __init__(self, run_dir: str | Path, cfg: HealthConfig, stop_on: Sequence[str] = (), *,
                 resume_step: int | None = None) -> None:
        self.path = health_path(run_dir)
        self.monitor = HealthMonitor(cfg)
        self.stop_on = set(stop_on)
        self.stop_reason: str | None = None
        self.raised = 0
        if resume_step is not None:
            purge_records(self.path, resume_step + 1)
            for r in read_metrics(run_dir):
                if r["step"] <= resume_step:
                    self.monitor.observe(int(r["step"]), r)
        self._fd: int | None = None
        if cfg.enabled:
            self._fd = os.open(self.path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)

    def observe(self, step: int, record: Mapping[str, Any], *,
                quarantined: Mapping[str, str] | None = None) -> list[dict[str, Any]]:
        """Raises (logs and records) the alarms of ``record``; returns their records. ``quarantined``: the
        workers the controller quarantined so far and why (the worker_quarantined alarm names them)."""
        out = []
        for alarm in self.monitor.observe(step, record, quarantined=quarantined):
            out.append(self._raise(alarm))
        return out

    def _raise(self, alarm: Alarm) -> dict[str, Any]:
        stop = alarm.name in self.stop_on and self.stop_reason is None
        rec = {"step": alarm.step, "time": time.time(), **{k: v for k, v in alarm.as_record().items() if k != "step"},
               "stop": stop}
        if stop:
            self.stop_reason = f"health alarm {alarm.name} at step {alarm.step} (learner.stop_on): {alarm.detail}"
        line = json.dumps(rec, allow_nan=False, separators=(",", ":")) + "\n"
        if self._fd is not None:
            os.write(self._fd, line.encode("utf-8"))
        self.raised += 1
        log.warning("%s", format_alarm(rec))
        return rec

    def close(self) -> None:
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None


def summarize_alarms(run_dir: str | Path) -> dict[str, Any]:
    """The summary's view: how many alarms, and ``name@step`` of each (``health_alarms`` /
    ``health_alarm_list``); ``{"health_alarms": 0}`` for a quiet run."""
    alarms = read_alarms(run_dir)
    out: dict[str, Any] = {"health_alarms": len(alarms)}
    if alarms:
        out["health_alarm_list"] = ", ".join(f"{a['alarm']}@{a['step']}" for a in alarms)
    return out


def alarms_report(run_dir: str | Path) -> str:
    """What ``asyncrl log show`` prints: the run's alarms (step, name, message), one per line. A run
    without ``health.jsonl`` (from before the alarms existed, or with ``health.enabled=false``) has its
    ``metrics.jsonl`` replayed with the run's ``health`` settings and says so."""
    run_dir = Path(run_dir)
    source = health_path(run_dir).name
    if health_path(run_dir).exists():
        alarms = read_alarms(run_dir)
    else:
        records = read_metrics(run_dir)
        if not records:
            return "health alarms: none (no metrics.jsonl)"
        config = RunDir(run_dir).config
        section = json.loads(config.read_text()).get("health") if config.is_file() else None
        cfg = health_config(section)
        if not cfg.enabled:
            cfg = health_config({**(section or {}), "enabled": True})
        alarms = [{**a.as_record(), "stop": False} for a in replay(records, cfg)]
        source = "replayed from metrics.jsonl"
    if not alarms:
        return f"health alarms: none ({source})"
    lines = [f"health alarms: {len(alarms)} ({source})"]
    for a in alarms:
        stop = "  [stopped training]" if a.get("stop") else ""
        lines.append(f"  step {a.get('step'):>5}  {a.get('alarm'):<16}  {a.get('message')}{stop}")
        lines.append(f"  {'':>10}  {'':<16}  likely cause: {a.get('cause')}; try {a.get('fix')}")
    return "\n".join(lines)
