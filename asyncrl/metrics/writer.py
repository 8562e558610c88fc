"""Scalar metrics of a run: ``run_dir/metrics.jsonl`` plus TensorBoard events under ``run_dir/tb/``.

Owns: the JSONL format (one object per line: ``"step"``, ``"time"``, then the metrics in the order
given; non-finite numbers written as ``null`` so every line is strict JSON), the TensorBoard mirror of
the same scalars, repair of a torn last line when a run is reopened (resume), and reading the file back.
Never: rewrites a complete line (except the explicit ``purge_step`` on resume, which drops the records
a resumed run is about to log again), imports torch, or imports tensorboard before a writer is opened.

Invariants:
- A line is written with a single ``os.write`` on an ``O_APPEND`` descriptor and made visible to other
  processes at once (no user-space buffering), so a reader following the file (``tail_metrics``) only
  ever sees whole lines or a torn tail, never two records interleaved.
- After ``MetricsWriter.__init__`` returns, the file is empty or ends with ``"\\n"``: a torn tail left
  by a crash is cut off (and logged) so the next record cannot be glued onto it.
- ``read_metrics`` returns every complete, parseable line; a torn or corrupt line is skipped and counted.

TensorBoard: each writer opens a new event file in ``tb/`` (TensorBoard merges all files of a folder).
Non-finite values go to TensorBoard unchanged (it shows NaN/inf); only the JSONL writes ``null``. With
``purge_step`` the new event file starts with a ``SessionLog.START`` at that step, which makes TensorBoard
discard the older events at steps >= ``purge_step`` (the same mechanism as torch's ``purge_step``).
"""

from __future__ import annotations

import dataclasses
import json
import logging
import math
import os
import threading
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from asyncrl.rundir import RunDir

log = logging.getLogger(__name__)

RESERVED_KEYS = ("step", "time")


def metrics_path(run_dir: str | Path) -> Path:
    return RunDir(Path(run_dir)).metrics


def _scalar(key: str, value: Any) -> float | int:
    """A JSON-able number from ``value`` (Python/numpy numbers, 0-d tensors); ValueError otherwise."""
    if isinstance(value, bool):
        return float(value)
    if isinstance(value, int):
        return value
    try:
        return float(value)
    except (TypeError, ValueError) as e:
        raise ValueError(
            f"metric {key!r} has value {value!r} of type {type(value).__name__}; metrics are scalars: "
            "pass a float (e.g. float(x) or tensor.item())"
        ) from e


def as_step(step: Any) -> int:
    """``step`` as a Python int (numpy integers accepted); ValueError for anything else."""
    if isinstance(step, bool) or not hasattr(step, "__index__"):
        raise ValueError(f"step must be an int, got {step!r}; pass the learner step as int")
    return int(step.__index__())


def encode_record(step: int, metrics: Mapping[str, Any], wall_time: float) -> tuple[bytes, dict[str, float]]:
    """The JSONL line (with its newline) and the validated scalars for TensorBoard.

    Returns ``(line, scalars)``; ``scalars`` keeps non-finite values, the line has them as ``null``.
    """
    step = as_step(step)
    record: dict[str, Any] = {"step": step, "time": float(wall_time)}
    scalars: dict[str, float] = {}
    for key, value in metrics.items():
        if not isinstance(key, str) or not key:
            raise ValueError(f"metric names must be non-empty strings, got {key!r}")
        if key in RESERVED_KEYS:
            raise ValueError(
                f"metric name {key!r} is reserved for the record itself; rename it (e.g. 'train/{key}')"
            )
        v = _scalar(key, value)
        scalars[key] = float(v)
        record[key] = v if math.isfinite(v) else None
    line = json.dumps(record, allow_nan=False, separators=(",", ":")) + "\n"
    return line.encode("utf-8"), scalars


def parse_line(line: bytes) -> dict[str, Any] | None:
    """One complete line -> record, or None when it is not a valid record (no "step")."""
    try:
        obj = json.loads(line)
    except (json.JSONDecodeError, UnicodeDecodeError):
        return None
    if not isinstance(obj, dict) or not isinstance(obj.get("step"), int):
        return None
    return obj


@dataclasses.dataclass(frozen=True)
class MetricsScan:
    """What ``scan_metrics`` found: the records, and how many lines it had to skip."""

    records: list[dict[str, Any]]
    skipped_lines: int  # complete lines that were not valid records
    torn_tail: bool  # the file ended in a partial line (a writer crashed mid-write); it was skipped


def scan_metrics(run_dir: str | Path) -> MetricsScan:
    """Reads ``run_dir/metrics.jsonl``; a missing file is an empty run, not an error."""
    path = metrics_path(run_dir)
    if not path.exists():
        return MetricsScan([], 0, False)
    data = path.read_bytes()
    lines = data.split(b"\n")
    tail = lines.pop()  # b"" when the file ends with a newline
    records: list[dict[str, Any]] = []
    skipped = 0
    for raw in lines:
        if not raw.strip():
            continue
        rec = parse_line(raw)
        if rec is None:
            skipped += 1
        else:
            records.append(rec)
    torn = bool(tail.strip())
    if torn or skipped:
        log.warning(
            "%s: skipped %d corrupt line(s)%s",
            path,
            skipped,
            " and a torn last line (a crash mid-write)" if torn else "",
        )
    return MetricsScan(records, skipped, torn)


def read_metrics(run_dir: str | Path) -> list[dict[str, Any]]:
    """Every valid record of the run in file order; torn/corrupt lines are skipped with a warning.

    Non-finite values read back as ``None``. Use ``scan_metrics`` to get the skipped counts.
    """
    return scan_metrics(run_dir).records


def _repair_tail(path: Path) -> int:
    """Cuts a torn last line off ``path``; returns the number of bytes removed."""
    if not path.exists():
        return 0
    size = path.stat().st_size
    if size == 0:
        return 0
    with open(path, "rb") as f:
        f.seek(size - 1)
        if f.read(1) == b"\n":
            return 0
        # Find the last newline, reading backwards in blocks.
        end = size
        keep = 0
        while end > 0:
            start = max(0, end - 65536)
            f.seek(start)
            block = f.read(end - start)
            i = block.rfind(b"\n")
            if i >= 0:
                keep = start + i + 1
                break
            end = start
    os.truncate(path, keep)
    return size - keep


def purge_records(path: Path, purge_step: int) -> int:
    """Rewrites ``path`` without records at steps >= ``purge_step``; returns how many were dropped."""
    if not path.exists():
        return 0
    kept: list[bytes] = []
    dropped = 0
    for raw in path.read_bytes().split(b"\n"):
        if not raw.strip():
            continue
        rec = parse_line(raw)
        if rec is not None and rec["step"] >= purge_step:
            dropped += 1
        else:
            kept.append(raw + b"\n")
    if dropped:
        tmp = path.with_name(path.name + ".tmp")
        tmp.write_bytes(b"".join(kept))
        os.replace(tmp, path)
    return dropped


class MetricsWriter:
    """Appends scalar records to ``run_dir/metrics.jsonl`` and ``run_dir/tb/``. Thread-safe.

    ``purge_step``: when resuming from a checkpoint whose next step is ``purge_step``, records at
    steps >= ``purge_step`` left by the crashed run are dropped (JSONL rewritten, TensorBoard told to
    discard them), so the resumed run's records are not duplicates. Do this before any other process
    follows the file. ``tensorboard=False`` writes the JSONL only.
    """

    def __init__(
        self,
        run_dir: str | Path,
        *,
        purge_step: int | None = None,
        tensorboard: bool = True,
        tb_flush_secs: float = 10.0,
    ) -> None:
        self.run_dir = Path(run_dir)
        self.run_dir.mkdir(parents=True, exist_ok=True)
        self.path = metrics_path(self.run_dir)
        removed = _repair_tail(self.path)
        if removed:
            log.warning("%s: cut a torn last line of %d bytes left by an interrupted run", self.path, removed)
        self.torn_bytes_removed = removed
        self.purged_records = 0
        if purge_step is not None:
            self.purged_records = purge_records(self.path, int(purge_step))
            if self.purged_records:
                log.info(
                    "%s: dropped %d record(s) at steps >= %d (resume)",
                    self.path,
                    self.purged_records,
                    purge_step,
                )
        self._fd: int | None = os.open(self.path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
        self._lock = threading.Lock()
        self._tb = None
        if tensorboard:
            self._tb = _open_tb(RunDir(self.run_dir).tb, purge_step=purge_step, flush_secs=tb_flush_secs)

    def log(self, step: int, metrics: Mapping[str, Any], *, wall_time: float | None = None) -> None:
        """Appends one record. ``metrics``: name -> scalar; ``wall_time`` defaults to ``time.time()``."""
        t = time.time() if wall_time is None else float(wall_time)
        step = as_step(step)
        line, scalars = encode_record(step, metrics, t)
        with self._lock:
            if self._fd is None:
                raise ValueError(f"MetricsWriter for {self.run_dir} is closed; open a new one to append")
            view = memoryview(line)
            while view:
                n = os.write(self._fd, view)
                view = view[n:]
            if self._tb is not None and scalars:
                self._tb.add_event(_scalar_event(step, scalars, t))

    def flush(self) -> None:
        """Makes everything logged so far durable (fsync of the JSONL, flush of the event file)."""
        with self._lock:
            if self._fd is None:
                return
            os.fsync(self._fd)
            if self._tb is not None:
                self._tb.flush()

    def close(self) -> None:
        """Flushes and closes; idempotent."""
        with self._lock:
            if self._fd is None:
                return
            os.fsync(self._fd)
            os.close(self._fd)
            self._fd = None
            if self._tb is not None:
                self._tb.close()
                self._tb = None

    @property
    def closed(self) -> bool:
        return self._fd is None

    def __enter__(self) -> MetricsWriter:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _open_tb(tb_dir: Path, *, purge_step: int | None, flush_secs: float):
    # tensorboard's own writer: no torch import (torch.utils.tensorboard costs seconds to import).
    from tensorboard.compat.proto import event_pb2
    from tensorboard.summary.writer.event_file_writer import EventFileWriter

    writer = EventFileWriter(str(tb_dir), max_queue_size=100, flush_secs=flush_secs)
    if purge_step is not None:
        writer.add_event(
            event_pb2.Event(
                wall_time=time.time(),
                step=int(purge_step),
                session_log=event_pb2.SessionLog(status=event_pb2.SessionLog.START),
            )
        )
        writer.flush()
    return writer


def _scalar_event(step: int, scalars: Mapping[str, float], wall_time: float):
    from tensorboard.compat.proto import event_pb2, summary_pb2

    values = [summary_pb2.Summary.Value(tag=k, simple_value=v) for k, v in scalars.items()]
    return event_pb2.Event(wall_time=wall_time, step=step, summary=summary_pb2.Summary(value=values))
