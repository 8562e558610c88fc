"""A generation worker's control link to its controller: Hello until Welcome, the Welcome's setup checked,
heartbeats while its engine starts, and every control message after.

Owns: ``ControlLink``, the worker's control socket and its context, its ``Hello`` (engine, its own quant.fmt,
slots, pid, host), said until the controller answers (a controller still starting answers ``not_ready``; one
that restarted never saw the first), the checks of the Welcome (protocol 1.4 or later, slots that hold a
group), its heartbeats (from a second thread while the engine starts), and control messages that may drop.
Never: builds the engine, fetches weights or speaks the work protocol (``workers/generator/process.py``); follows
a controller or learner that restarted under a joined worker (``workers/generator/rejoin.py``).

Invariant: the control socket has one user at a time: ``join``, then the start-up heartbeat thread
(``heartbeats_while_starting``), then the comms thread.
"""

from __future__ import annotations

import contextlib
import logging
import os
import socket
import threading
import time
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

import zmq

import protocols as P
from asyncrl.transport import ChannelTimeout, ZmqChannel, end_context, private_context
from asyncrl.transport.zap import PlainHandshakeWatch

if TYPE_CHECKING:
    from asyncrl.transport import CurveConfig

log = logging.getLogger("asyncrl.worker")

# Timeouts (seconds): each bounds a wait for a controller that may be gone; a reachable one ends it at once.
HELLO_TIMEOUT_S = 120.0
"""How long a worker keeps saying Hello before it gives up (the controller may still be starting)."""
HELLO_RETRY_S = 2.0
"""Wait for a Welcome before saying Hello again (a controller that restarted never saw the first)."""
ERROR_BACKOFF_S = 0.5
"""Pause after the controller answered with an error (``not_ready`` while starting, any other) before
asking again."""
CONTROL_SEND_TIMEOUT_S = 5.0
"""A control message (heartbeat, work request, Goodbye) that cannot leave in this time is dropped and
logged (a stalled controller)."""


class ControlLink:
    """The control link of worker ``worker_id`` (socket identity ``identity``) to the controller at ``controller``;
    its Hello names ``engine``, the worker's own ``quant.fmt`` (``fmt``, "" = none: the controller decides the formats
    and states them in its Welcome) and ``slots`` (0 = the run's)."""

    ctx: zmq.Context
    ctl: ZmqChannel

    def __init__(self, controller: str, worker_id: str, identity: str, curve: CurveConfig | None, *, engine: str,
                 fmt: str, slots: int, hello_timeout_s: float) -> None:
        self.controller, self.worker_id, self.identity, self.curve = controller, worker_id, identity, curve
        self.engine, self.fmt, self.slots, self.hello_timeout_s = engine, fmt, slots, hello_timeout_s

    def hello(self) -> P.Hello:
        caps = {"engine": self.engine, "quant_format": self.fmt, "slots": str(self.slots),
                "pid": str(os.getpid()), "host": socket.gethostname()}
        return P.Hello(protocol_version=P.PROTOCOL_VERSION, role="generator", peer_id=self.worker_id,
                       capabilities=caps)

    def heartbeat(self, version: int, stats: dict[str, float]) -> None:
        """``version``: the engine's weights version (-1: none yet)."""
        self.send(P.Heartbeat(peer_id=self.worker_id, time=time.time(), stats=stats, version=max(-1, int(version))))

    def send(self, msg: Any) -> None:
        try:
            self.ctl.send(msg, timeout_s=CONTROL_SEND_TIMEOUT_S)
        except ChannelTimeout:
            log.warning("control channel stalled; dropped %s", type(msg).__name__)

    def _handshake(self, stop: threading.Event) -> P.Welcome:
        hello = self.hello()
        deadline = time.monotonic() + self.hello_timeout_s
        # a keyless worker sees a CURVE controller only in its socket's handshakes (the socket is this thread's)
        plain = PlainHandshakeWatch(self.ctl._sock) if self.curve is None else None
        try:
            return self._say_hello(hello, deadline, plain, stop)
        finally:
            if plain is not None:
                plain.close()

    def _say_hello(self, hello: P.Hello, deadline: float, plain: PlainHandshakeWatch | None,
                   stop: threading.Event) -> P.Welcome:
        while time.monotonic() < deadline and not stop.is_set():
            self.ctl.send(hello)
            env = self.ctl.recv(HELLO_RETRY_S)
            if env is None:
                if (why := self._keys_mismatch(plain)):
                    raise SystemExit(f"worker {self.worker_id}: {why}")
                continue
            msg = env.msg
            if isinstance(msg, P.Welcome):
                return msg
            if isinstance(msg, P.Reject):
                raise SystemExit(f"controller refused worker {self.worker_id}: {msg.reason}")
            if isinstance(msg, P.Error) and msg.code == "not_ready":
                time.sleep(ERROR_BACKOFF_S)
                continue
            log.warning("unexpected reply to Hello: %r", msg)
        raise SystemExit(f"no Welcome from controller {self.controller} within {self.hello_timeout_s}s; "
                         "is the job running and the address right?")

    def _keys_mismatch(self, plain: PlainHandshakeWatch | None) -> str:
        """Why no handshake with the controller can succeed, when its CURVE use and this worker's differ ("" if
        nothing says so): the side that can tell says it at once instead of waiting for the Hello timeout."""
        if plain is not None:
            if plain.server_wants_curve():
                return (f"the controller at {self.controller} requires CURVE keys and this worker has none: start it "
                        "with transport.keys_dir=DIR, a folder with the run's server.key and a client key pair its "
                        "controller admits (`asyncrl keys generate`, `asyncrl keys add`)")
            return ""
        auth = self.ctl.stats.auth_counts()
        if auth.get("accepted"):
            return ""
        if auth.get("no_curve") or auth.get("aborted", 0) >= 2:
            return (f"the controller at {self.controller} does not use CURVE keys, but this worker has "
                    "transport.keys_dir: start the worker without transport.keys_dir, or the controller with "
                    "transport.keys_dir=DIR")
        if auth.get("bad_key"):  # (a key not yet allow-listed: it keeps asking, `asyncrl keys add` admits it)
            return (f"the CURVE handshake with {self.controller} failed: this worker's server.key is not the "
                    "controller's; copy server.key from the controller's keys folder")
        return ""

    def join(self, stop: threading.Event) -> tuple[P.WorkerSetup, int]:
        """Connect the control socket, say Hello until the controller's Welcome, and check its setup (this
        worker's slots hold a group): the setup and the slots granted. A refusal, no answer, or a setup it cannot
        serve: ``SystemExit`` with one line, the control socket closed."""
        # The control and sample sockets get a context of their own, so that leaving can wait until the
        # last samples and the Goodbye have left (end_context), however long that takes.
        self.ctx = private_context()
        self.ctl = ZmqChannel.connect(zmq.DEALER, self.controller, name="worker-ctl",
                                      identity=self.identity.encode(), curve=self.curve, context=self.ctx)
        try:
            welcome = self._handshake(stop)
        except SystemExit:
            self.ctl.close()
            end_context(self.ctx)
            raise
        try:
            if (why := P.version_refusal(welcome.protocol_version, f"the controller at {self.controller}")) is not None:
                raise ValueError(why)
            setup = welcome.worker_setup()
            slots = self.slots or setup.worker_slots
            if slots < setup.group_size:
                raise ValueError(f"{slots} slots cannot hold a group of {setup.group_size} samples, so this "
                                 f"worker would never be given work; start it with rollout.worker_slots="
                                 f"{setup.group_size} or more, or without it to take the run's")
        except ValueError as e:
            self.ctl.close()
            raise SystemExit(f"worker {self.worker_id}: {e}") from None
        return setup, slots

    @contextlib.contextmanager
    def heartbeats_while_starting(self, period_s: float, stop: threading.Event) -> Iterator[None]:
        """Heartbeats from a second thread while the engine is built and loaded, so the controller does not
        declare a worker dead whose server is still starting. That thread owns the control socket meanwhile
        (nothing else uses it until the comms thread starts, after this block)."""
        done = threading.Event()

        def beat() -> None:
            while not done.wait(period_s):
                self.heartbeat(-1, {"outstanding": 0.0, "samples": 0.0})
                env = self.ctl.recv(0.0)
                while env is not None:  # nothing was asked yet: only a Shutdown (the run ended) matters
                    if isinstance(env.msg, P.Shutdown):
                        log.info("controller asked worker %s to stop while starting: %s", self.worker_id,
                                 env.msg.reason)
                        stop.set()
                    env = self.ctl.recv(0.0)

        beater = threading.Thread(target=beat, name="worker-start-heartbeat", daemon=True)
        beater.start()
        try:
            yield
        finally:
            done.set()
            beater.join()
