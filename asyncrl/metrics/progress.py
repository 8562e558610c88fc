"""Live progress for the launcher: a tqdm bar on a terminal, plain periodic lines elsewhere (CI, files),
and ``tail_metrics`` to follow a ``metrics.jsonl`` that another process is writing.

Owns: what the progress line shows (step, train reward, last eval accuracy, staleness, tokens/s), how
often it is printed when the stream is not a terminal, and notes printed between progress lines
(training-health alarms, ``note``).
Never: reads a partial line (``tail_metrics`` returns only complete lines and an offset just past the
last one, so the rest is read on the next call), or writes to stdout (stdout is the launcher's summary).
"""

from __future__ import annotations

import logging
import os
import sys
import time
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any, TextIO

from asyncrl.metrics.writer import parse_line

log = logging.getLogger(__name__)

# (metric key, short label, format) shown after the step, in this order; the last value seen is kept,
# so a metric logged only every N steps (eval) stays on display between evaluations.
DISPLAY = (
    ("train/reward_mean", "reward", "{:.3f}"),
    ("eval/accuracy", "eval", "{:.3f}"),
    ("staleness/max", "staleness", "{:.0f}"),
    ("throughput/tokens_per_s", "tok/s", "{:.0f}"),
)


class Progress:
    """Progress of ``total_steps`` learner steps, rendered to ``stream`` (default: stderr).

    On a terminal: a tqdm bar with the metrics as postfix. Otherwise: one plain line at most every
    ``interval_s`` seconds (and always for the last step and at ``close``), so CI logs stay short.
    """

    def __init__(
        self,
        total_steps: int,
        *,
        stream: TextIO | None = None,
        interval_s: float = 5.0,
        start_step: int = 0,
        display: tuple[tuple[str, str, str], ...] = DISPLAY,
        clock: Callable[[], float] = time.monotonic,
        force_plain: bool = False,
    ) -> None:
        if total_steps < 1:
            raise ValueError(
                f"total_steps must be >= 1, got {total_steps}; pass the configured learner steps"
            )
        self.total = int(total_steps)
        self.stream = stream if stream is not None else sys.stderr
        self.interval_s = float(interval_s)
        self.display = display
        self.clock = clock
        self.step = int(start_step)
        self._start_step = int(start_step)
        self._t0 = clock()
        self._last_print: float | None = None
        self._printed_step: int | None = None
        self._values: dict[str, float] = {}
        self._closed = False
        isatty = getattr(self.stream, "isatty", None)
        self.plain = force_plain or not (callable(isatty) and isatty())
        self._bar = None
        if not self.plain:
            from tqdm import tqdm

            self._bar = tqdm(
                total=self.total,
                initial=self.step,
                file=self.stream,
                unit="step",
                dynamic_ncols=True,
                leave=True,
                desc="train",
            )

    def postfix(self) -> str:
        """``reward=0.812 eval=0.950 staleness=2 tok/s=1234``: the last value of each displayed metric."""
        parts = []
        for key, label, fmt in self.display:
            v = self._values.get(key)
            if v is not None:
                parts.append(f"{label}={fmt.format(v)}")
        return " ".join(parts)

    def line(self) -> str:
        """The plain progress line (what non-terminal streams get)."""
        from tqdm import tqdm

        elapsed = self.clock() - self._t0
        done = self.step - self._start_step
        eta = ""
        if done > 0 and self.step < self.total:
            eta = f"<{tqdm.format_interval(elapsed / done * (self.total - self.step))}"
        pct = 100.0 * self.step / self.total
        text = f"step {self.step}/{self.total} ({pct:.0f}%) [{tqdm.format_interval(elapsed)}{eta}]"
        post = self.postfix()
        return f"{text} {post}" if post else text

    def update(self, step: int, metrics: Mapping[str, Any] | None = None) -> None:
        """Moves to ``step`` (absolute, not an increment) and records the displayed metrics it has."""
        if self._closed:
            return
        for key, _, _ in self.display:
            v = (metrics or {}).get(key)
            if isinstance(v, (int, float)) and not isinstance(v, bool):
                self._values[key] = float(v)
        self.step = max(self.step, int(step))
        if self._bar is not None:
            self._bar.n = min(self.step, self.total)
            self._bar.set_postfix_str(self.postfix(), refresh=False)
            self._bar.refresh()
            return
        now = self.clock()
        due = self._last_print is None or now - self._last_print >= self.interval_s
        if due or self.step >= self.total:
            self._print(now)

    def note(self, line: str) -> None:
        """Prints ``line`` on its own line (a training-health alarm), above the bar on a terminal."""
        if self._bar is not None:
            self._bar.write(line, file=self.stream)
            return
        self.stream.write(line + "\n")
        self.stream.flush()

    def _print(self, now: float) -> None:
        if self._printed_step == self.step and self._last_print is not None:
            return
        self.stream.write(self.line() + "\n")
        self.stream.flush()
        self._last_print = now
        self._printed_step = self.step

    def close(self) -> None:
        """Final render (the last state is always shown once); idempotent."""
        if self._closed:
            return
        self._closed = True
        if self._bar is not None:
            self._bar.close()
        else:
            self._print(self.clock())

    def __enter__(self) -> Progress:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def tail_metrics(path: str | Path, offset: int) -> tuple[list[dict[str, Any]], int]:
    """The complete new records of a ``metrics.jsonl`` after byte ``offset``, and the next offset.

    Reads only up to the last newline: a line still being written is left for the next call. A
    missing file gives ``([], offset)``. If the file is now shorter than ``offset`` (rewritten by a
    resume with ``purge_step``), it is read again from the start. A complete line that is not a
    valid record is skipped with a warning and not returned again.
    """
    path = Path(path)
    if offset < 0:
        raise ValueError(f"offset must be >= 0, got {offset}; start following at 0")
    try:
        fd = os.open(path, os.O_RDONLY)
    except FileNotFoundError:
        return [], offset
    try:
        size = os.fstat(fd).st_size
        if size < offset:
            log.warning(
                "%s shrank below offset %d (rewritten on resume); reading it again from the start",
                path,
                offset,
            )
            offset = 0
        chunks = []
        pos = offset
        while pos < size:
            chunk = os.pread(fd, min(1 << 20, size - pos), pos)
            if not chunk:
                break
            chunks.append(chunk)
            pos += len(chunk)
    finally:
        os.close(fd)
    data = b"".join(chunks)
    end = data.rfind(b"\n")
    if end < 0:
        return [], offset
    records: list[dict[str, Any]] = []
    for raw in data[:end].split(b"\n"):
        if not raw.strip():
            continue
        rec = parse_line(raw)
        if rec is None:
            log.warning("%s: skipping a corrupt line near byte %d", path, offset)
        else:
            records.append(rec)
    return records, offset + end + 1
