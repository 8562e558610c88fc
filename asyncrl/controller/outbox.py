"""Per-peer fairness for the controller's replies: no peer can make the event loop wait on it.

Owns: one bounded queue of replies per peer, sent without blocking (``timeout_s=0``) each time the
loop turns; a peer whose queue passes ``max_pending`` (it sends requests but does not read the
replies, so its socket pipe is full too) is *dropped*: its queue is discarded, it is counted, the
``on_drop`` callback runs (the controller forgets a dropped worker and reissues its work), and every
later message from it is ignored (``muted``). A peer that has disconnected loses its queued replies
(counted). ``protected`` peers (the learner) are never dropped.
Never: blocks, retries a send in a loop, or keeps more than ``max_pending`` replies for one peer.
Not thread-safe: the controller's event loop owns it.
"""

from __future__ import annotations

import collections
import logging
from collections.abc import Callable
from typing import Any

from asyncrl.transport import ChannelClosed, ChannelTimeout

log = logging.getLogger("asyncrl.controller")

MAX_MUTED = 100_000  # identities remembered as dropped (oldest forgotten first)


class PeerOutbox:
    def __init__(self, send: Callable[..., None], *, max_pending: int = 256,
                 on_drop: Callable[[bytes], None] | None = None) -> None:
        if max_pending < 1:
            raise ValueError(f"max_pending must be >= 1, got {max_pending}")
        self._send = send
        self.max_pending = max_pending
        self.on_drop = on_drop
        self.protected: set[bytes] = set()
        self._pending: dict[bytes, collections.deque] = {}
        self._muted: collections.OrderedDict[bytes, None] = collections.OrderedDict()
        self.counters: collections.Counter = collections.Counter()

    def muted(self, peer: bytes) -> bool:
        return peer in self._muted

    def put(self, peer: bytes, msg: Any) -> None:
        if peer in self._muted:
            self.counters["control/muted_peer_reply_dropped"] += 1
            return
        q = self._pending.setdefault(peer, collections.deque())
        q.append(msg)
        if len(q) > self.max_pending and peer not in self.protected:
            self.drop(peer, reason=f"{len(q)} replies pending: it does not read them")

    def drop(self, peer: bytes, *, reason: str) -> None:
        q = self._pending.pop(peer, collections.deque())
        self.counters["control/peers_dropped"] += 1
        self.counters["control/reply_dropped"] += len(q)
        self._muted[peer] = None
        while len(self._muted) > MAX_MUTED:
            self._muted.popitem(last=False)
        log.warning("peer %r dropped (%s); its further messages are ignored", peer, reason)
        if self.on_drop is not None:
            self.on_drop(peer)

    def flush(self) -> None:
        """Send what each peer's socket accepts now, without waiting on any peer."""
        for peer in list(self._pending):
            q = self._pending[peer]
            while q:
                try:
                    self._send(q[0], to=peer, timeout_s=0.0)
                except ChannelTimeout:
                    break  # its pipe is full: try again next turn, the others go on
                except ChannelClosed:  # disconnected: nobody will read these
                    self.counters["control/reply_dropped"] += len(q)
                    q.clear()
                    break
                q.popleft()
            if not q:
                del self._pending[peer]

    def pending(self, peer: bytes) -> int:
        q = self._pending.get(peer)
        return 0 if q is None else len(q)
