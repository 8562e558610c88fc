"""Generation worker process: ``asyncrl worker controller=tcp://HOST:PORT [key=value ...]``.

One process = one rollout engine. Joins a running job at any time from any host: the controller's
``Welcome`` carries everything else in its ``WorkerSetup`` (sample and weight addresses, the model
architecture, EOS ids, slots, heartbeat period), the worker fetches the newest weights in its
quantization format, then asks for work with a credit window and streams every finished sample at once.

The engine is any ``RolloutEngine`` (``engine=native``: torch on ``device=auto|cpu|cuda[:N]``;
``engine=sglang``: an SGLang server the worker starts, or attaches to with ``sglang.url=``); this file
calls only the interface (submit / poll / update_weights / abort / close / version), so both kinds keep
per-token versions, behaviour log-probs, interruptible weight updates and exactly-once accounting alike.

Threads: the *main thread* drives the engine (``poll``); the *comms thread* owns every socket
(control DEALER, sample PUSH, weight SUB/DEALER) and talks to the engine only through its
thread-safe surface (submit / update_weights / abort). Weight swaps land at a decode-step boundary.

Parts in their own modules: joining (Hello until Welcome, start-up heartbeats: ``workers/generator/join.py``),
the samples (assigned, streamed back, handed back: ``workers/generator/samples.py``), following a controller
or learner that restarted (``workers/generator/rejoin.py``), the command line (``workers/generator/args.py``).

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
from typing import Any

import zmq

import protocols as P
from asyncrl.config.roles import WorkerRoleConfig, check_worker_role
from asyncrl.engine.base import RolloutEngine
from asyncrl.engine.factory import EngineSpec, build_engine
from asyncrl.learner.memory import bound_kernel_caches, malloc_trim
from asyncrl.machine import describe
from asyncrl.transport import (
    ChannelTimeout,
    WeightClient,
    WeightFetchCancelled,
    WeightFetchError,
    ZmqChannel,
    end_context,
    load_client_keys,
)
from protocols.values import QUARANTINED
from workers.generator.args import built, engine_spec, parse_args
from workers.generator.join import ERROR_BACKOFF_S, HELLO_TIMEOUT_S, JoinMixin
from workers.generator.rejoin import RejoinMixin
from workers.generator.samples import SampleStream

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
FIRST_WEIGHTS_TIMEOUT_S = 120.0
"""The first weight fetch (the learner may still be publishing its first version)."""
WEIGHTS_TIMEOUT_S = 60.0
"""Fetching an announced version; on failure the worker keeps its current weights."""
CONTROL_SEND_TIMEOUT_S = 5.0
"""A control message (heartbeat, work request, Goodbye) that cannot leave in this time is dropped and
logged (a stalled controller)."""
FLUSH_S = 5.0
"""On exit, the longest wait for the last samples and the Goodbye to leave (``end_context``: it returns
as soon as they have; this bounds only a controller that is gone)."""


class GeneratorWorker(JoinMixin, RejoinMixin):
    def __init__(self, role: WorkerRoleConfig, *, hello_timeout_s: float = HELLO_TIMEOUT_S, curve=None) -> None:
        self.role = check_worker_role(role)  # its settings (asyncrl worker key=value ...), checked before any socket
        self.curve = curve  # CurveConfig (client keys) when the job runs with transport.keys_dir
        self.engine_kind = role.engine
        self.fatal: BaseException | None = None  # the first error of any thread; the process exits with 1
        self.gave_up = ""  # why the worker left a run it cannot serve any more (exit 1, one line, no traceback)
        self.left = False
        self.no_learner_limit_s = role.no_learner_s
        self.controller = role.controller
        self.worker_id = role.worker_id or f"{socket.gethostname()}-{os.getpid()}"
        # this process's own socket identity: a second process under the same id is refused by name, not parked
        self.identity = f"{self.worker_id}/{os.getpid()}-{secrets.token_hex(4)}"
        self.requested_fmt = role.quant.fmt
        self.requested_slots = role.slots
        self.drain_s = role.drain_s
        self.hello_timeout_s = hello_timeout_s
        self.stop = threading.Event()
        self.samples = SampleStream(self.worker_id, role.engine)  # assigned, streamed back, handed back
        self.weights_version = -1  # newest version handed to the engine (applied at its next step)
        self.asked_version = -1  # the version the last WorkRequest named (the engine's applied one then)
        self.weight_sync_s = 0.0  # seconds spent fetching + unpacking + handing over new versions (comms thread)
        self.weight_syncs = 0
        self.delta_ok = False  # whether the engine applies weight deltas (read once it is built)
        self.stream_ok = False  # whether it loads a version bucket by bucket as it arrives (native)
        self.weight_deltas = 0  # of those, versions fetched as a delta from the one before (transport.delta)
        self.weight_sync_bytes = 0  # payload bytes fetched, whole versions and deltas
        self.t_start = time.monotonic()
        # built by run() once the controller's Welcome says where to connect
        self.engine: RolloutEngine | None = None
        self.push: ZmqChannel | None = None
        self.weights: WeightClient | None = None

    @property
    def _engine(self) -> RolloutEngine:
        return built(self.engine, "engine")

    @property
    def _weights(self) -> WeightClient:
        return built(self.weights, "weight client")

    @property
    def _push(self) -> ZmqChannel:
        return built(self.push, "sample channel")

    # ------------------------------------------------------------------------------------ run
    def run(self) -> int:
        welcome, setup = self._join()
        self.fmt = self.requested_fmt or (setup.quant_format if self.engine_kind == "native" else "fp32")
        self.wire_fmt = self._wire_format()
        self.min_credits = max(1, setup.group_size)  # free slots worth asking with: groups are assigned whole
        self.heartbeat_s = setup.heartbeat_s
        self.engine = self.push = self.weights = comms = None
        old_hook = threading.excepthook
        threading.excepthook = self._thread_died  # any thread of this process, the engine's included
        try:
            with self._heartbeats_while_starting():  # an SGLang server can take minutes to start
                self.engine = build_engine(self._engine_spec(setup))
                self.stream_ok = callable(getattr(self.engine, "load_stream", None))  # before the first, largest load
                self.push = ZmqChannel.connect(zmq.PUSH, setup.samples_address, name="worker-samples",
                                               curve=self.curve, context=self.ctx)
                self.setup = setup
                self.weights = self._weight_client(setup)
                try:
                    self._load_weights(-1, cancel=self.stop)  # the newest the learner serves (the controller's view can lag)
                except WeightFetchCancelled:
                    pass  # handled below, once the start-up heartbeat thread has given the control socket back
            if self.weights_version < 0:
                # SIGTERM, or the run ended (the controller answers a heartbeat with Shutdown) before any
                # weights arrived: nothing was assigned yet, so leave quietly instead of timing out.
                log.info("worker %s: stopped before its first weights arrived; leaving", self.worker_id)
                self._leave(reason="stopped before its first weights")
                return 0
            log.info("worker %s ready: %s engine, %s actor, weights v%d, %d slots", self.worker_id,
                     self.engine_kind, self.fmt, self.weights_version, self.slots)
            caps = self.engine.capabilities()
            self.delta_ok = bool(caps.get("weight_delta"))  # the engine applies deltas: ask for them from now on
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
            if self.weights is not None:
                self.weights.close()
            for ch in (self.ctl, self.push):
                if ch is not None:
                    ch.close(linger_s=FLUSH_S)  # what was sent (samples, the Goodbye) may still leave
            if comms is None or not comms.is_alive():  # a comms thread still inside a socket would block it
                end_context(self.ctx)  # returns once the last samples and the Goodbye have left
            threading.excepthook = old_hook
        return 1 if self.fatal is not None or self.gave_up else 0

    def _engine_spec(self, setup: P.WorkerSetup) -> EngineSpec:
        return engine_spec(setup, self.role, fmt=self.fmt, slots=self.slots)

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

    def _load_weights(self, version: int, timeout_s: float = FIRST_WEIGHTS_TIMEOUT_S,
                      cancel: threading.Event | None = None) -> None:
        t0 = time.perf_counter()
        # The previous version's frames (and, at the first fetch, the fp32 skeleton the engine was quantized
        # from) are free by now but mostly stay in glibc's heap: give them back before the next arrives
        # (docs/benchmarks.md §8, where the job's memory goes).
        malloc_trim()
        base, base_checksum = self._delta_base()
        if self.stream_ok:
            self._stream_weights(version, timeout_s, cancel, base, base_checksum, t0)
            return
        ann, buffers = self._weights.fetch(version, timeout_s=timeout_s, fmt=self.wire_fmt, cancel=cancel,
                                           base_version=base, base_checksum=base_checksum)
        if ann.version <= self.weights_version:
            return
        self._take_weights(ann, buffers, t0)

    def _stream_weights(self, version: int, timeout_s: float, cancel: threading.Event | None, base: int,
                        base_checksum: str, t0: float) -> None:
        """The version in buckets, each loaded into the engine as it arrives (``transport.bucket_mb``); a learner
        that sends none (``bucket_mb=0``, protocol 1.5) answers in one piece, handed over as before. On an error
        the engine holds the version before; the next fetch after a failed delta is whole."""
        engine: Any = self._engine
        with self._weights.stream(version, timeout_s=timeout_s, fmt=self.wire_fmt, cancel=cancel, base_version=base,
                                  base_checksum=base_checksum) as stream:
            if stream.whole is not None:
                ann, buffers = stream.whole
                if ann.version > self.weights_version:
                    self._take_weights(ann, buffers, t0)
                return
            if stream.version <= self.weights_version:
                return
            try:
                loaded = engine.load_stream(stream.version, stream)
            except Exception:
                if base >= 0:
                    self.weights_checksum = ""
                raise
        self.weights_version, self.weights_checksum = loaded.version, loaded.checksum
        self.weight_deltas += int(loaded.is_delta)
        self.weight_sync_bytes += loaded.stream_bytes
        self.weight_sync_s += time.perf_counter() - t0
        self.weight_syncs += 1

    def _delta_base(self) -> tuple[int, str]:
        """(version, checksum) of the weights handed to the engine, offered as the base of a delta: only for an
        engine that applies deltas (native), and never after one failed to apply (that fetch goes whole)."""
        if not self.delta_ok or self.weights_version < 0 or not self.weights_checksum:
            return -1, ""
        return self.weights_version, self.weights_checksum

    def _take_weights(self, ann, buffers, t0: float) -> None:
        """Hand fetched weights to the engine (applied at its next step); ``t0``: when the fetch began."""
        from asyncrl.transport.publication import from_wire

        self._engine.update_weights(ann.version, from_wire(ann, buffers))
        self.weights_checksum = ann.checksum
        self.weights_version = ann.version
        if isinstance(ann, P.WeightDelta):
            self.weight_deltas += 1
            self.weight_sync_bytes += ann.total_bytes
        else:
            self.weight_sync_bytes += ann.total_bytes
        self.weight_sync_s += time.perf_counter() - t0
        self.weight_syncs += 1

    # -------------------------------------------------------------------------- comms thread
    def _comms_main(self) -> None:
        try:
            self._comms_loop()
        except BaseException as exc:  # noqa: B036 - a comms thread that died would leave a worker that hangs
            self._fail(exc, "comms thread")
            self._leave(reason=f"fatal: {exc!r}"[:200])

    def _comms_loop(self) -> None:
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
                self._send_ctl(self._heartbeat(self._engine.version, self._stats()))
                last_hb = now
            if self._maybe_update_weights():
                next_request = 0.0  # new weights: ask for the work they unlock now, not after a back-off
            if self._engine.version > self.asked_version:
                next_request = 0.0  # and again once the engine applied them (it asked with the version before)
            self.samples.flush(self._push, self.fmt)
            if draining_since is not None:
                if not self.samples.outstanding or now - draining_since > self.drain_s:
                    self._leave()
                    return
            elif not request_in_flight and now >= next_request:
                free = self.slots - len(self.samples.outstanding)
                if free >= self.min_credits:
                    request = self._work_request(free)
                    self._send_ctl(request)
                    self.asked_version, request_in_flight = request.version, True
            env = self.ctl.recv(COMMS_RECV_S)
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
                self.not_ready_since = None
                self._rejoined(msg)
                next_request = 0.0
            elif isinstance(msg, P.Reject):  # a Hello after not_registered, refused (its id taken meanwhile)
                self._give_up(f"the controller refused it when it joined again: {msg.reason}")
            elif isinstance(msg, P.Error):
                request_in_flight = False
                next_request = time.monotonic() + ERROR_BACKOFF_S
                if msg.code == "not_registered":  # declared dead (slow start, pause) or controller restarted
                    log.warning("controller does not know worker %s; joining again", self.worker_id)
                    self._send_ctl(self._hello())
                elif msg.code == "not_ready":  # a controller that restarted and has no learner yet
                    self._not_ready(time.monotonic())
                else:
                    log.warning("controller error: %s %s", msg.code, msg.message)

    def _work_request(self, free: int) -> P.WorkRequest:
        """Ask for ``free`` samples with the version the engine has *applied*: the controller hands it only groups
        admitted at that version or before, and the engine's next tokens come from it or a newer one. Weights
        handed over but not applied yet (``weights_version``) do not count: the first tokens of work taken on
        them could still come from the version before, older than the group's admission."""
        return P.WorkRequest(worker_id=self.worker_id, credits=free, version=max(-1, int(self._engine.version)))

    def _accept(self, a: P.RolloutAssignment) -> None:
        if new := self.samples.accept(a):
            self._engine.submit(new)

    def _maybe_update_weights(self) -> bool:
        """Fetch and hand over the newest announced version; True if the engine got new weights."""
        if self.refetch:
            return self._fetch_from_new_learner()
        if getattr(self._engine, "take_delta_failure", lambda: False)():
            # the engine kept the version before the delta: fetch the newest whole, from what it holds
            log.error("worker %s: a weight delta did not apply; fetching the newest version whole", self.worker_id)
            self.weights_version, self.weights_checksum = self._engine.version, ""
            try:
                self._load_weights(-1, timeout_s=WEIGHTS_TIMEOUT_S)
            except (WeightFetchError, ValueError) as e:
                log.error("could not load the newest weights, keeping v%d: %s", self._engine.version, e)
                return False
            return True
        ann = self._weights.poll_announce(0.0, fmt=self.wire_fmt)
        if ann is None or ann.version <= self.weights_version:
            return False
        try:
            self._load_weights(ann.version, timeout_s=WEIGHTS_TIMEOUT_S)
        except (WeightFetchError, ValueError) as e:  # QuantError is a ValueError: keep the old version
            log.error("could not load weights v%d, keeping v%d: %s", ann.version, self._engine.version, e)
            return False
        return True

    def _stats(self) -> dict[str, float]:
        dt = max(1e-6, time.monotonic() - self.t_start)
        return {"outstanding": float(len(self.samples.outstanding)), "samples": float(self.samples.sent),
                "tokens_per_s": self.samples.tokens / dt,
                "weight_sync_s": self.weight_sync_s, "weight_syncs": float(self.weight_syncs)}

    def _heartbeat(self, version: int, stats: dict[str, float]) -> P.Heartbeat:
        """``version``: the engine's weights version (-1: none yet)."""
        return P.Heartbeat(peer_id=self.worker_id, time=time.time(), stats=stats, version=max(-1, int(version)))

    def _send_ctl(self, msg) -> None:
        try:
            self.ctl.send(msg, timeout_s=CONTROL_SEND_TIMEOUT_S)
        except ChannelTimeout:
            log.warning("control channel stalled; dropped %s", type(msg).__name__)

    def _leave(self, reason: str = "stopping") -> None:
        if self.left:
            return
        self.left = True
        unfinished = self.samples.unfinished()
        if unfinished:
            self._engine.abort(unfinished)
        self._send_ctl(P.Goodbye(peer_id=self.worker_id, unfinished=unfinished, reason=reason))
        log.info("worker %s left: %d samples sent, %d handed back; %d weight versions fetched (%d as deltas), "
                 "%.1f MB", self.worker_id, self.samples.sent, len(unfinished), self.weight_syncs,
                 self.weight_deltas, self.weight_sync_bytes / 1e6)  # the Goodbye leaves before the process ends


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
