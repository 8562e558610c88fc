"""What the controller writes of a run per learner version: ``RunReport``.

Owns: the ``metrics.jsonl`` / TensorBoard row of each ``VersionUpdate`` (the learner's metrics, its control
flags as marks, the controller's metrics, the transport counters, samples logged per second since the previous
row, seconds since the controller started), feeding that row to the training-health watch (whose
``learner.stop_on`` alarm ends training), the weight server's counters the learner reported last, and the
transport part of the end-of-run summary. The writer, the watch and the transport counters are injected
(``workers/controller.py`` builds them; a test passes its own).
Never: decides anything about training (``ControllerCore`` turns a stop reason into the learner's Shutdown).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping

import protocols as P
from asyncrl.metrics import MetricsWriter
from asyncrl.metrics.health_log import HealthWatch


class RunReport:
    """``transport``: the channels' counters now (``transport/*`` metrics); ``clock``: monotonic seconds."""

    def __init__(self, writer: MetricsWriter, health: HealthWatch, *,
                 transport: Callable[[], dict[str, float]] = dict, clock: Callable[[], float] = time.monotonic) -> None:
        self.writer, self.health, self.transport, self.clock = writer, health, transport, clock
        self.t0 = self.t_last = clock()
        self.samples_at_last = 0
        self.weights: dict[str, float] = {}  # the weight server's counters, as the learner reported them last

    def version(self, msg: P.VersionUpdate, controller: dict[str, float], *, samples_logged: int,
                quarantined: Mapping[str, str]) -> str | None:
        """Write the row of ``msg`` (``controller``: the controller's metrics now) and watch it; returns the
        reason to stop once a ``learner.stop_on`` alarm fired. ``quarantined``: the workers quarantined so far."""
        self.weights.update({k: v for k, v in msg.metrics.items() if k.startswith("transport/weights")})
        now = self.clock()
        marks = {name: 1.0 for name in ("checkpoint", "done") if getattr(msg, name)}  # ``done`` marks the final row
        m = dict(msg.metrics) | marks | controller | self.transport()
        m["throughput/samples_per_s"] = (samples_logged - self.samples_at_last) / max(1e-9, now - self.t_last)
        self.samples_at_last, self.t_last = samples_logged, now
        m["time/wall_s"] = now - self.t0
        self.writer.log(msg.version, m)
        self.health.observe(msg.version, m, quarantined=quarantined)
        return self.health.stop_reason

    def final(self) -> dict[str, float]:
        """The transport counters and the weight server's, for the end-of-run summary."""
        return self.transport() | self.weights

    def close(self) -> None:
        self.writer.close()
        self.health.close()
