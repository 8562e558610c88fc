"""Generation worker process: ``asyncrl worker controller=tcp://HOST:PORT [key=value ...]``.

One process = one rollout engine. Joins a running job at any time from any host: the controller's
``Welcome`` carries everything else in its ``WorkerSetup`` (sample and weight addresses, the model
architecture, EOS ids, slots, heartbeat period), the worker fetches the newest weights in its
quantization format, then asks for work with a credit window and streams every finished sample at once.

The engine is any ``RolloutEngine`` (``rollout.engine=native``: torch on ``rollout.device=auto|cpu|cuda[:N]``;
``rollout.engine=sglang``: an SGLang server the worker starts, or attaches to with ``sglang.url=``); this file
calls only the interface (submit / poll / update_weights / abort / close / version), so both kinds keep
per-token versions, behaviour log-probs, interruptible weight updates and exactly-once accounting alike.

Threads: the *main thread* drives the engine (``poll``); the *comms thread* owns every socket
(control DEALER, sample PUSH, weight SUB/DEALER) and talks to the engine only through its
thread-safe surface (submit / update_weights / abort). Weight swaps land at a decode-step boundary.

Parts, each an object the worker holds: its control link (Hello until Welcome, heartbeats, control messages:
``ControlLink``, ``workers/generator/join.py``), its samples (assigned, streamed back, handed back:
``SampleStream``, ``samples.py``), its weights (fetched, handed to the engine: ``WeightSync``, ``weights.py``),
where its sample and weight sockets point, followed when a controller or learner restarted (``Peers``,
``rejoin.py``); the command line is ``args.py``.

No thread dies while the process lives: an exception in any thread of the worker (an engine that fails,
a request it refuses, a broken socket) is fatal. The worker then hands its unfinished samples back in a
``Goodbye`` (the controller reissues them at once), closes its engine (and a server it started), and
the process exits with status 1, so a launcher restarts it instead of waiting on a worker that hangs.

A ``Shutdown`` whose reason starts with ``protocols.values.QUARANTINED`` (its samples kept failing the
controller's validation, ``rollout.quarantine_after``) makes the worker leave at once with that reason as
an error line and exit 1.

Leaving: on SIGTERM (or ``Shutdown``) the worker stops asking for work, lets in-flight samples finish
for up to ``drain_s``, aborts the rest and hands them back in a ``Goodbye`` so the controller
reissues them; aborted partial samples are never sent as results. A worker stopped before its first
weights arrive (SIGTERM, or a run that ended while it started: the controller answers its heartbeats
with ``Shutdown``) gives up the fetch, says ``Goodbye`` and exits 0 at once.
"""

from __future__ import annotations

import logging
import os
import secrets
import signal
import socket
import sys
import threading
import time
from collections.abc import Sequence

import protocols as P
from asyncrl.config.roles import WorkerRoleConfig, check_worker_role
from asyncrl.engine.base import RolloutEngine
from asyncrl.engine.factory import build_engine
from asyncrl.learner.memory import bound_kernel_caches
from asyncrl.machine import describe
from asyncrl.transport import WeightFetchCancelled, end_context, load_client_keys
from protocols.values import QUARANTINED
from workers.generator.args import built, engine_spec, parse_args
from workers.generator.join import ERROR_BACKOFF_S, HELLO_TIMEOUT_S, ControlLink
from workers.generator.rejoin import Peers
from workers.generator.samples import SampleStream
from workers.generator.weights import WeightSync

log = logging.getLogger("asyncrl.worker")

# Timeouts (seconds). None is a wall-clock expectation of speed: each bounds a wait for a peer that may
# be gone, and a reachable peer ends the wait at once.
COMMS_EXIT_MARGIN_S = 30.0
"""Beyond ``drain_s``, how long the engine thread waits for the comms thread to leave."""
ENGINE_POLL_S = 0.1
"""Engine thread: longest wait for finished samples before it checks that the comms thread lives."""
COMMS_RECV_S = 0.01
"""Comms thread: longest wait for a control message per turn; each turn also sends results, heartbeats
and work requests, so this bounds their delay."""
FLUSH_S = 5.0
"""On exit, the longest wait for the last samples and the Goodbye to leave (``end_context``: it returns
as soon as they have; this bounds only a controller that is gone)."""


class GeneratorWorker:
    def __init__(self, role: WorkerRoleConfig, *, hello_timeout_s: float = HELLO_TIMEOUT_S, curve=None) -> None:
        self.role = check_worker_role(role)  # its settings (asyncrl worker key=value ...), checked before any socket
        self.engine_kind = role.rollout.engine
        self.fatal: BaseException | None = None  # the first error of any thread; the process exits with 1
        self.gave_up = ""  # why the worker left a run it cannot serve any more (exit 1, one line, no traceback)
        self.left = False
        self.worker_id = role.worker_id or f"{socket.gethostname()}-{os.getpid()}"
        self.drain_s = role.drain_s
        self.stop = threading.Event()
        # the socket identity is this process's own: a second process under the same id is refused by name, not parked
        self.link = ControlLink(role.controller, self.worker_id, f"{self.worker_id}/{os.getpid()}-{secrets.token_hex(4)}",
                                curve, engine=role.rollout.engine, fmt=role.quant.fmt,
                                slots=role.rollout.worker_slots,
                                hello_timeout_s=hello_timeout_s)
        self.samples = SampleStream(self.worker_id, role.rollout.engine)  # assigned, streamed back, handed back
        self.asked_version = -1  # the version the last WorkRequest named (the engine's applied one then)
        self.t_start = time.monotonic()
        # built by run() once the controller's Welcome says where to connect
        self.engine: RolloutEngine | None = None
        self.weights: WeightSync | None = None
        self.peers: Peers | None = None

    @property
    def _engine(self) -> RolloutEngine:
        return built(self.engine, "engine")

    # ------------------------------------------------------------------------------------ run
    def run(self) -> int:
        setup, self.slots = self.link.join(self.stop)
        self.fmt = setup.actor_format or setup.quant_format  # the controller decided both (worker_formats)
        self.min_credits = max(1, setup.group_size)  # free slots worth asking with: groups are assigned whole
        self.heartbeat_s = setup.heartbeat_s
        comms = None
        old_hook = threading.excepthook
        threading.excepthook = self._thread_died  # any thread of this process, the engine's included
        try:
            with self.link.heartbeats_while_starting(self.heartbeat_s, self.stop):  # an SGLang server takes minutes
                self.engine = build_engine(engine_spec(setup, self.role, fmt=self.fmt, slots=self.slots))
                self.weights = WeightSync(self.engine, setup.quant_format, self.link, self._give_up)
                self.peers = Peers(setup, self.weights, self.link, self.role.no_learner_s)
                try:
                    self.weights.first(self.stop)  # the newest the learner serves (the controller's view can lag)
                except WeightFetchCancelled:
                    pass  # handled below, once the start-up heartbeat thread has given the control socket back
            if self.weights.version < 0:
                # SIGTERM, or the run ended (the controller answers a heartbeat with Shutdown) before any
                # weights arrived: nothing was assigned yet, so leave quietly instead of timing out.
                log.info("worker %s: stopped before its first weights arrived; leaving", self.worker_id)
                self._leave(reason="stopped before its first weights")
                return 0
            log.info("worker %s ready: %s engine, %s actor, weights v%d, %d slots", self.worker_id,
                     self.engine_kind, self.fmt, self.weights.version, self.slots)
            caps = self.engine.capabilities()
            self.weights.delta_ok = bool(caps.get("weight_delta"))  # the engine applies deltas: ask for them now
            if self.engine_kind == "native":  # which kernels the actor runs, and why (asyncrl/machine.py)
                from asyncrl.quant.kernels import explain_kernels

                log.info("worker %s precision: %s, on %s", self.worker_id,
                         explain_kernels(self.fmt, set(caps.get("kernels", ())), caps["device"].split(":")[0]),
                         describe() if caps["device"] == "cpu" else caps["device"])
            comms = threading.Thread(target=self._comms_main, name="worker-comms", daemon=True)
            comms.start()
            while comms.is_alive() and self.fatal is None:  # also while draining: in-flight samples finish
                for res in self.engine.poll(ENGINE_POLL_S):
                    self.samples.finished(res)
        except BaseException as exc:  # noqa: B036 - every failure of the engine thread ends the process
            self._fail(exc, "engine thread")
        finally:
            self.stop.set()
            if comms is not None:
                comms.join(timeout=self.drain_s + COMMS_EXIT_MARGIN_S)
            if self.fatal is not None and not (comms is not None and comms.is_alive()):
                self._leave(reason=f"fatal: {self.fatal!r}"[:200])  # no-op when the comms thread already left
            if self.engine is not None:
                self.engine.close()
            if self.weights is not None and self.weights.client is not None:
                self.weights.client.close()
            for ch in (self.link.ctl, self.peers.push if self.peers else None):
                if ch is not None:
                    ch.close(linger_s=FLUSH_S)  # what was sent (samples, the Goodbye) may still leave
            if comms is None or not comms.is_alive():  # a comms thread still inside a socket would block it
                end_context(self.link.ctx)  # returns once the last samples and the Goodbye have left
            threading.excepthook = old_hook
        return 1 if self.fatal is not None or self.gave_up else 0

    def _fail(self, exc: BaseException, where: str) -> None:
        """Record the first fatal error of any thread and stop the worker (the process exits with 1)."""
        if self.fatal is None:
            self.fatal = exc
            log.critical("worker %s: fatal error in the %s; handing back its samples and exiting", self.worker_id,
                         where, exc_info=(type(exc), exc, exc.__traceback__))
        self.stop.set()

    def _thread_died(self, args: threading.ExceptHookArgs) -> None:
        if args.exc_type is SystemExit:
            return
        self._fail(args.exc_value or args.exc_type(), f"thread {args.thread.name if args.thread else '?'}")

    def _give_up(self, reason: str) -> None:
        """Leave at once (unfinished samples handed back), exit 1 with ``reason`` as the last line."""
        if not self.gave_up:
            log.error("worker %s leaves: %s", self.worker_id, reason)
            self.gave_up = reason
            self.drain_s = 0.0
            self.stop.set()

    # -------------------------------------------------------------------------- comms thread
    def _comms_main(self) -> None:
        try:
            self._comms_loop()
        except BaseException as exc:  # noqa: B036 - a comms thread that died would leave a worker that hangs
            self._fail(exc, "comms thread")
            self._leave(reason=f"fatal: {exc!r}"[:200])

    def _comms_loop(self) -> None:
        peers, weights = built(self.peers, "sample channel"), built(self.weights, "weights")
        draining_since: float | None = None
        next_request = 0.0
        request_in_flight = False
        last_hb = 0.0
        while True:
            now = time.monotonic()
            if self.stop.is_set() and draining_since is None:
                draining_since = now
            if self.fatal is not None:
                self._leave(reason=f"fatal: {self.fatal!r}"[:200])
                return
            if now - last_hb >= self.heartbeat_s:
                self.link.heartbeat(self._engine.version, self._stats())
                last_hb = now
            if weights.poll(self.stop):
                next_request = 0.0  # new weights: ask for the work they unlock now, not after a back-off
            if self._engine.version > self.asked_version:
                next_request = 0.0  # and again once the engine applied them (it asked with the version before)
            self.samples.flush(peers.push, self.fmt)
            if draining_since is not None:
                if not self.samples.outstanding or now - draining_since > self.drain_s:
                    self._leave()
                    return
            elif not request_in_flight and now >= next_request:
                free = self.slots - len(self.samples.outstanding)
                if free >= self.min_credits:
                    request = self._work_request(free)
                    self.link.send(request)
                    self.asked_version, request_in_flight = request.version, True
            env = self.link.ctl.recv(COMMS_RECV_S)
            if env is None:
                continue
            msg = env.msg
            if isinstance(msg, P.RolloutAssignment):
                self._accept(msg)
                request_in_flight = False
            elif isinstance(msg, P.NoWork):
                request_in_flight = False
                next_request = time.monotonic() + msg.retry_after_s
            elif isinstance(msg, P.Shutdown):
                if msg.reason.startswith(QUARANTINED):  # its samples kept failing validation: no more work here
                    self._give_up(f"the controller quarantined it: {msg.reason.removeprefix(QUARANTINED)}")
                else:
                    log.info("controller asked worker %s to stop: %s", self.worker_id, msg.reason)
                    self.stop.set()
            elif isinstance(msg, P.Welcome):
                peers.rejoined(msg)
                next_request = 0.0
            elif isinstance(msg, P.Reject):  # a Hello after not_registered, refused (its id taken meanwhile)
                self._give_up(f"the controller refused it when it joined again: {msg.reason}")
            elif isinstance(msg, P.Error):
                request_in_flight = False
                next_request = time.monotonic() + ERROR_BACKOFF_S
                if msg.code == "not_registered":  # declared dead (slow start, pause) or controller restarted
                    log.warning("controller does not know worker %s; joining again", self.worker_id)
                    self.link.send(self.link.hello())
                elif msg.code == "not_ready":  # a controller that restarted and has no learner yet
                    if why := peers.not_ready(time.monotonic()):
                        self._give_up(why)
                else:
                    log.warning("controller error: %s %s", msg.code, msg.message)

    def _work_request(self, free: int) -> P.WorkRequest:
        """Ask for ``free`` samples with the version the engine has *applied*: the controller hands it only groups
        admitted at that version or before, and the engine's next tokens come from it or a newer one. Weights
        handed over but not applied yet (``WeightSync.version``) do not count: the first tokens of work taken on
        them could still come from the version before, older than the group's admission."""
        return P.WorkRequest(worker_id=self.worker_id, credits=free, version=max(-1, int(self._engine.version)))

    def _accept(self, a: P.RolloutAssignment) -> None:
        if new := self.samples.accept(a):
            self._engine.submit(new)

    def _stats(self) -> dict[str, float]:
        dt = max(1e-6, time.monotonic() - self.t_start)
        w = built(self.weights, "weights")
        return {"outstanding": float(len(self.samples.outstanding)), "samples": float(self.samples.sent),
                "tokens_per_s": self.samples.tokens / dt, "weight_sync_s": w.sync_s, "weight_syncs": float(w.syncs)}

    def _leave(self, reason: str = "stopping") -> None:
        if self.left:
            return
        self.left = True
        unfinished = self.samples.unfinished()
        if unfinished:
            self._engine.abort(unfinished)
        self.link.send(P.Goodbye(peer_id=self.worker_id, unfinished=unfinished, reason=reason))
        log.info("worker %s left: %d samples sent, %d handed back; %s", self.worker_id, self.samples.sent,
                 len(unfinished), self.weights or "no weights")  # the Goodbye leaves before the process ends


def main(argv: Sequence[str] | None = None) -> int:
    try:
        role = parse_args(sys.argv[1:] if argv is None else argv)
    except ValueError as e:  # as `asyncrl worker` says it, also for `python -m workers.generator`
        print(f"asyncrl worker: {e}", file=sys.stderr)
        return 2
    bound_kernel_caches()  # before the engine's first oneDNN matmul (asyncrl/learner/memory.py)
    logging.basicConfig(level=role.log_level, format="%(asctime)s %(name)s %(message)s")
    keys = role.transport
    worker = GeneratorWorker(role, curve=load_client_keys(keys.keys_dir, keys.key_name) if keys.keys_dir else None)
    signal.signal(signal.SIGTERM, lambda *_: worker.stop.set())
    signal.signal(signal.SIGINT, lambda *_: worker.stop.set())
    rc = worker.run()
    if worker.gave_up:  # the last line of its log: what a launcher shows when it reports the worker's exit
        print(f"worker {worker.worker_id}: {worker.gave_up}", file=sys.stderr, flush=True)
    if rc != 0:  # fatal: leave now, even if a thread of a library is still blocked somewhere
        for flush in (logging.shutdown, sys.stdout.flush, sys.stderr.flush):
            flush()
        os._exit(rc)
    return rc
