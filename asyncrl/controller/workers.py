"""The generation workers a controller knows: who they are, where to reach them, when they spoke last.

Owns: ``WorkerInfo`` (reply address, fetched and actor formats, last heartbeat, newest weights version, samples,
tokens/s) and ``WorkerRegistry`` (worker id -> info): joining, the workers behind one reply address,
the silent ones, and the fleet's throughput. Standard library only (checked by tests/unit/test_layout.py).
Never: decides what happens to a worker's work (``Membership.forget`` reissues it) or reads messages.
"""

from __future__ import annotations

import dataclasses
import math


@dataclasses.dataclass
class WorkerInfo:
    peer: bytes
    quant_format: str  # the published format it fetches
    last_seen: float
    actor_format: str = ""  # the format its actor runs (asyncrl.config.roles.worker_formats)
    version: int = -1
    samples: int = 0
    tokens_per_s: float = 0.0
    weight_sync_s: float = 0.0  # the worker's own totals (heartbeat stats): seconds fetching new versions, and how many
    weight_syncs: float = 0.0
    host: str = ""  # where the worker said it runs (Hello capabilities), for a refusal that names it
    pid: str = ""

    def heartbeat(self, version: int, stats: dict[str, float]) -> None:
        """What a heartbeat says: the engine's weights version and the worker's throughput and weight-sync totals
        (non-finite or negative values are ignored). Its assignments' deadlines stand."""
        self.version = max(self.version, version)
        tps = stats.get("tokens_per_s", 0.0)
        self.tokens_per_s = tps if math.isfinite(tps) else 0.0
        sync_s, syncs = stats.get("weight_sync_s", 0.0), stats.get("weight_syncs", 0.0)
        if math.isfinite(sync_s) and math.isfinite(syncs) and sync_s >= 0 and syncs >= 0:
            self.weight_sync_s, self.weight_syncs = sync_s, syncs


class WorkerRegistry(dict[str, WorkerInfo]):
    """Worker id -> ``WorkerInfo`` (a dict, so lookups read as before), plus the questions a controller asks."""

    def join(self, worker_id: str, *, peer: bytes, quant_format: str, now: float, host: str = "",
             pid: str = "") -> WorkerInfo:
        """Register ``worker_id`` (the caller forgets an earlier registration of it first)."""
        info = self[worker_id] = WorkerInfo(peer=peer, quant_format=quant_format, last_seen=now, host=host, pid=pid)
        return info

    def behind(self, peer: bytes) -> list[str]:
        """The workers that reply address ``peer`` reaches."""
        return [wid for wid, w in self.items() if w.peer == peer]

    def silent(self, now: float, dead_after_s: float) -> list[tuple[str, float]]:
        """(worker id, seconds since it was last heard) of every worker silent for more than ``dead_after_s``."""
        return [(wid, now - w.last_seen) for wid, w in self.items() if now - w.last_seen > dead_after_s]

    def tokens_per_s(self) -> float:
        """The fleet's generation throughput, as the workers last reported it."""
        return float(sum(w.tokens_per_s for w in self.values()))

    def weight_sync_s(self) -> float | None:
        """Seconds per version and worker spent taking new weights (fetch + unpack + hand-over, as the
        workers measure it); None before any worker reported a sync."""
        syncs = sum(w.weight_syncs for w in self.values())
        return sum(w.weight_sync_s for w in self.values()) / syncs if syncs > 0 else None
