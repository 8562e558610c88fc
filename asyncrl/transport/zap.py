"""The ZAP handler and handshake counters: one thread per zmq context that admits allow-listed keys.

Owns: applying a ``CurveConfig`` (``keys``) to a zmq socket (``secure_socket``), the process-global
registry with one ZAP handler thread per zmq context that answers with the allow-list of the
socket's ZAP domain (re-read when its folder changes), the counters of accepted and denied
handshakes (``transport/auth/*``) with the fix each failure suggests in its log line, and
``PlainHandshakeWatch``, which lets a keyless client tell that its server requires CURVE.
Never: sends or reads asyncrl messages (``channel`` does); weakens a socket that has keys (a server
socket with keys enforces its ZAP domain, so without a running handler every client is refused);
reads key files itself (``keys`` does); imports torch.

Lifetime: a context's handler starts with its first secured socket and runs (a daemon thread) for the
life of the context: the process-global one (``channel.shared_context``) is never terminated; a
private one (``channel.private_context``) is ended by ``channel.end_context``, which stops its handler
first (``shutdown_security``).

Counting: every secured socket gets a zmq monitor; the ZAP thread reads the monitor events and
counts per socket (``ChannelStats.auth``) and per process (``auth_metrics()``). Reasons:
``unknown_key`` (a CURVE client whose key is not in the allow-list), ``no_curve`` (a plain client at a
CURVE socket, when this side notices the mechanism mismatch first), ``aborted`` (the peer hung up
mid-handshake: a plain client that noticed the mismatch first, or a port scanner), ``bad_key`` (a client
holding the wrong server public key, or a corrupt handshake), ``protocol`` (any other ZMTP error), and
on the client side ``refused`` (the server denied our key). A client that keeps retrying is counted at
every attempt (zmq reconnects every 100 ms by default).
"""

from __future__ import annotations

import collections
import logging
import os
import queue
import threading
from collections.abc import Callable

import zmq
from zmq.utils import z85
from zmq.utils.monitor import parse_monitor_message

from asyncrl.transport.keys import CurveConfig

log = logging.getLogger("asyncrl.transport.auth")

ZAP_ENDPOINT = "inproc://zeromq.zap.01"
_MONITOR_EVENTS = (zmq.EVENT_HANDSHAKE_SUCCEEDED | zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL
                   | zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL | zmq.EVENT_HANDSHAKE_FAILED_AUTH
                   | zmq.EVENT_MONITOR_STOPPED)


_HINTS = {
    (False, "refused"): "; this key is not in the server's allow-list",
    (True, "no_curve"): "; a client without CURVE keys: it needs transport.keys_dir=DIR with server.key and a client "
                        "key pair from `asyncrl keys generate`",
    (True, "aborted"): "; the client hung up mid-handshake: a client without CURVE keys (it needs "
                       "transport.keys_dir=DIR), or not an asyncrl client",
    (False, "no_curve"): "; the server does not use CURVE keys: connect without transport.keys_dir, or start the "
                         "server with them",
}
"""What a failed handshake tells the operator to do, by (server side?, reason)."""


# ---------------------------------------------------------------------- ZAP handler + monitors
class _Security:
    """One per zmq context: a thread that answers ZAP requests and reads socket monitors.

    The ZAP socket is bound here (caller thread) and then only used by the thread; monitor PAIR
    sockets are created and connected by the caller and handed over through a queue (a migration
    with a memory barrier, which zmq allows).
    """

    def __init__(self, context: zmq.Context) -> None:
        self._ctx = context
        self._zap = context.socket(zmq.REP)
        self._zap.linger = 0
        self._zap.bind(ZAP_ENDPOINT)
        self._domains: dict[str, CurveConfig] = {}
        self._allow_cache: dict[str, tuple[float, frozenset[bytes]]] = {}
        self._new: queue.SimpleQueue = queue.SimpleQueue()
        self._lock = threading.Lock()
        self.totals: collections.Counter = collections.Counter()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="asyncrl-zap", daemon=True)
        self._thread.start()

    def register(self, curve: CurveConfig) -> str:
        with self._lock:
            self._domains[curve.domain] = curve
        return curve.domain

    def watch(self, sock: zmq.Socket, server: bool, count: Callable[[str], None] | None) -> None:
        pair = sock.get_monitor_socket(_MONITOR_EVENTS)
        self._new.put((pair, server, count))

    def _allowed(self, domain: str) -> frozenset[bytes]:
        with self._lock:
            curve = self._domains.get(domain)
        if curve is None:
            return frozenset()
        if not curve.allowed_dir:
            return curve.allowed_keys
        try:
            stamp = os.stat(curve.allowed_dir).st_mtime_ns
        except OSError:
            stamp = -1
        cached = self._allow_cache.get(domain)
        if cached is None or cached[0] != stamp:
            cached = (stamp, curve.allowed())
            self._allow_cache[domain] = cached
        return cached[1]

    def _answer(self, frames: list[bytes]) -> None:
        version, request_id, domain, _address, _identity, mechanism = frames[:6]
        ok = (mechanism == b"CURVE" and len(frames) == 7
              and z85.encode(frames[6]) in self._allowed(domain.decode(errors="replace")))
        status = (b"200", b"OK", b"asyncrl") if ok else (b"400", b"key not in the allow-list", b"")
        self._zap.send_multipart([version, request_id, *status, b""])

    def _event(self, frames: list[bytes], server: bool, count: Callable[[str], None] | None) -> bool:
        ev = parse_monitor_message(frames)
        kind, value = ev["event"], ev["value"]
        if kind == zmq.EVENT_MONITOR_STOPPED:
            return False
        if kind == zmq.EVENT_HANDSHAKE_SUCCEEDED:
            reason = "accepted"
        elif kind == zmq.EVENT_HANDSHAKE_FAILED_AUTH:
            reason = "unknown_key" if server else "refused"
        elif kind == zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL and value == zmq.PROTOCOL_ERROR_ZMTP_MECHANISM_MISMATCH:
            reason = "no_curve"
        elif kind == zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL and value == zmq.PROTOCOL_ERROR_ZMTP_CRYPTOGRAPHIC:
            reason = "bad_key"
        elif kind == zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL:
            reason = "aborted"  # the peer hung up mid-handshake (value: errno), e.g. a plain client that saw CURVE
        else:
            reason = "protocol"
        with self._lock:
            self.totals[reason] += 1
            n = self.totals[reason]
        if count is not None:
            count(reason)
        if reason != "accepted" and n & (n - 1) == 0:  # 1st, 2nd, 4th, ...: a retrying client cannot flood the log
            log.warning("%s-side CURVE handshake failed: %s (%d so far; zmq event %#x value %#x)%s",
                        "server" if server else "client", reason, n, int(kind), int(value), _HINTS.get((server, reason), ""))
        return True

    def _run(self) -> None:
        poller = zmq.Poller()
        poller.register(self._zap, zmq.POLLIN)
        monitors: dict[zmq.Socket, tuple[bool, Callable[[str], None] | None]] = {}
        while not self._stop.is_set():
            while not self._new.empty():
                pair, server, count = self._new.get()
                monitors[pair] = (server, count)
                poller.register(pair, zmq.POLLIN)
            for sock, _ in poller.poll(50):
                if sock is self._zap:
                    frames = self._zap.recv_multipart()
                    if len(frames) < 6:
                        self._zap.send_multipart([b"1.0", frames[1] if len(frames) > 1 else b"", b"400",
                                                  b"malformed ZAP request", b"", b""])
                    else:
                        self._answer(frames)
                    continue
                server, count = monitors[sock]
                if not self._event(sock.recv_multipart(), server, count):
                    poller.unregister(sock)
                    monitors.pop(sock)
                    sock.close(linger=0)
        for sock in monitors:
            sock.close(linger=0)
        self._zap.close(linger=0)

    def close(self) -> None:
        self._stop.set()
        self._thread.join(timeout=5)


_SECURITY: dict[int, _Security] = {}
_SECURITY_LOCK = threading.Lock()


def _security(context: zmq.Context) -> _Security:
    with _SECURITY_LOCK:
        sec = _SECURITY.get(id(context))
        if sec is None:
            sec = _SECURITY[id(context)] = _Security(context)
        return sec


def secure_socket(sock: zmq.Socket, curve: CurveConfig, context: zmq.Context, *,
                  count: Callable[[str], None] | None = None) -> None:
    """Apply ``curve`` to ``sock`` before it binds (server side) or connects (client side).

    Server side: ``curve_server``, the secret key, the allow-list's ZAP domain (enforced: no handler,
    no connection); client side: its key pair and ``curve_serverkey``. Handshake outcomes are passed
    to ``count(reason)`` from the ZAP thread and added to ``auth_metrics()``.
    """
    sec = _security(context)
    if curve.is_server:
        sock.setsockopt(zmq.CURVE_SERVER, 1)
        sock.setsockopt(zmq.CURVE_SECRETKEY, curve.secret_key)
        sock.setsockopt(zmq.ZAP_DOMAIN, sec.register(curve).encode())
        sock.setsockopt(zmq.ZAP_ENFORCE_DOMAIN, 1)
    else:
        sock.setsockopt(zmq.CURVE_PUBLICKEY, curve.public_key)
        sock.setsockopt(zmq.CURVE_SECRETKEY, curve.secret_key)
        sock.setsockopt(zmq.CURVE_SERVERKEY, curve.server_key)
    sec.watch(sock, curve.is_server, count)


class PlainHandshakeWatch:
    """The handshakes of one plain (keyless) client socket, read by its own thread while it waits for a first
    answer: a server that speaks CURVE fails every handshake with a mechanism mismatch (or hangs up at once,
    when it noticed first), which a plain socket otherwise never reports. ``close`` before the socket's."""

    def __init__(self, sock: zmq.Socket) -> None:
        self._sock = sock
        self._pair = sock.get_monitor_socket(zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL | zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL
                                             | zmq.EVENT_HANDSHAKE_SUCCEEDED)
        self.counts: collections.Counter = collections.Counter()

    def server_wants_curve(self) -> bool:
        """True once the server refused a plain handshake: a mechanism mismatch, or two hang-ups mid-handshake
        and no handshake that succeeded."""
        while self._pair.poll(0):
            ev = parse_monitor_message(self._pair.recv_multipart())
            if ev["event"] == zmq.EVENT_HANDSHAKE_SUCCEEDED:
                self.counts["accepted"] += 1
            elif ev["value"] == zmq.PROTOCOL_ERROR_ZMTP_MECHANISM_MISMATCH:
                self.counts["no_curve"] += 1
            else:
                self.counts["aborted"] += 1
        return not self.counts["accepted"] and (self.counts["no_curve"] > 0 or self.counts["aborted"] >= 2)

    def close(self) -> None:
        self._sock.disable_monitor()
        self._pair.close(linger=0)


def auth_metrics(context: zmq.Context | None = None, prefix: str = "transport/auth") -> dict[str, float]:
    """Handshake counters of every secured socket of ``context`` (default: the shared one); {} if none."""
    ctx = context or zmq.Context.instance()
    with _SECURITY_LOCK:
        sec = _SECURITY.get(id(ctx))
    if sec is None:
        return {}
    with sec._lock:
        totals = dict(sec.totals)
    return auth_counter_metrics(totals, prefix)


def auth_counter_metrics(counts: dict[str, int], prefix: str) -> dict[str, float]:
    """``{prefix}/accepted``, ``{prefix}/denied`` (all failures) and ``{prefix}/denied/<reason>``."""
    denied = {k: v for k, v in counts.items() if k != "accepted"}
    out = {f"{prefix}/accepted": float(counts.get("accepted", 0)), f"{prefix}/denied": float(sum(denied.values()))}
    out.update({f"{prefix}/denied/{k}": float(v) for k, v in sorted(denied.items())})
    return out


def shutdown_security(context: zmq.Context) -> None:
    """Stop the ZAP thread of ``context`` and close its sockets (``channel.end_context`` calls this
    before ``context.term()``, which would otherwise wait for them forever)."""
    with _SECURITY_LOCK:
        sec = _SECURITY.pop(id(context), None)
    if sec is not None:
        sec.close()


__all__ = [
    "PlainHandshakeWatch",
    "auth_counter_metrics",
    "auth_metrics",
    "secure_socket",
    "shutdown_security",
]
