"""A channel's counters: messages sent and received, rejected frames by reason, CURVE handshake outcomes.

Owns: ``ChannelStats`` and its metrics form (``transport/<name>/...``, ``as_metrics``).
Never: touches a socket (``asyncrl.transport.channel`` counts into it, the ZAP thread of
``asyncrl.transport.zap`` counts handshakes into ``auth`` under the lock).
"""

from __future__ import annotations

import collections
import dataclasses
import threading

from asyncrl.transport.zap import auth_counter_metrics


@dataclasses.dataclass
class ChannelStats:
    """Counters a long-running process exports as metrics (``transport/<name>/...``)."""

    received: int = 0
    sent: int = 0
    rejected: collections.Counter = dataclasses.field(default_factory=collections.Counter)
    last_errors: collections.deque = dataclasses.field(default_factory=lambda: collections.deque(maxlen=16))
    auth: collections.Counter = dataclasses.field(default_factory=collections.Counter)
    """CURVE handshake outcomes (``accepted``, ``unknown_key``, ``no_curve``, ...), counted by the ZAP thread."""
    secured: bool = False
    _auth_lock: threading.Lock = dataclasses.field(default_factory=threading.Lock, repr=False, compare=False)

    def count_auth(self, reason: str) -> None:
        with self._auth_lock:
            self.auth[reason] += 1

    def auth_counts(self) -> dict[str, int]:
        with self._auth_lock:
            return dict(self.auth)

    def reject(self, reason: str, message: str) -> None:
        self.rejected[reason] += 1
        self.last_errors.append(f"{reason}: {message}")

    @property
    def rejected_total(self) -> int:
        return sum(self.rejected.values())

    def as_metrics(self, prefix: str) -> dict[str, float]:
        out = {f"{prefix}/received": float(self.received), f"{prefix}/sent": float(self.sent)}
        out[f"{prefix}/rejected"] = float(self.rejected_total)
        for reason, n in self.rejected.items():
            out[f"{prefix}/rejected/{reason}"] = float(n)
        if self.secured:
            out.update(auth_counter_metrics(self.auth_counts(), f"{prefix}/auth"))
        return out
