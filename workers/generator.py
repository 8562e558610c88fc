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

No thread dies while the process lives: an exception in any thread of the worker (an engine that fails,
a request it refuses, a broken socket) is fatal. The worker then hands its unfinished samples back in a
``Goodbye`` (the controller reissues them at once), closes its engine (and a server it started), and
the process exits with status 1, so a launcher restarts it instead of waiting on a worker that hangs.

Leaving: on SIGTERM (or ``Shutdown``) the worker stops asking for work, lets in-flight samples finish
for up to ``drain_s``, aborts the rest and hands them back in a ``Goodbye`` so the controller
reissues them; aborted partial samples are never sent as results. A worker stopped before its first
weights arrive (SIGTERM, or a run that ended while it started: the controller answers its heartbeats
with ``Shutdown``) gives up the fetch, says ``Goodbye`` and exits 0 at once.
"""

from __future__ import annotations

import contextlib
import logging
import os
import queue
import secrets
import signal
import socket
import sys
import threading
import time
from collections.abc import Sequence

import numpy as np
import zmq

import protocols as P
from asyncrl.engine.base import RolloutEngine
from asyncrl.engine.factory import EngineSpec, build_engine
from asyncrl.learner.memory import bound_kernel_caches, malloc_trim
from asyncrl.transport import (
    ChannelTimeout,
    WeightClient,
    WeightFetchCancelled,
    WeightFetchError,
    ZmqChannel,
    end_context,
    load_client_keys,
    private_context,
)
from workers.worker_args import NATIVE_KEYS, SGLANG_KEYS, built, engine_spec, parse_args, settings
from workers.worker_rejoin import RejoinMixin

log = logging.getLogger("asyncrl.worker")

# Timeouts (seconds). None is a wall-clock expectation of speed: each bounds a wait for a peer that may
# be gone, and a reachable peer ends the wait at once.
HELLO_TIMEOUT_S = 120.0
"""How long a worker keeps saying Hello before it gives up (the controller may still be starting)."""
HELLO_RETRY_S = 2.0
"""Wait for a Welcome before saying Hello again (a controller that restarted never saw the first)."""
ERROR_BACKOFF_S = 0.5
"""Pause after the controller answered with an error (``not_ready`` while starting, any other) before
asking again."""
DRAIN_S = 10.0
"""Default of ``drain_s=``: on SIGTERM or Shutdown, how long in-flight samples may finish before the rest
is aborted and handed back."""
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
SAMPLE_SEND_TIMEOUT_S = 30.0
"""How long a finished sample may wait at the samples socket's high-water mark (the controller not
reading) before it is kept for the next try."""
CONTROL_SEND_TIMEOUT_S = 5.0
"""A control message (heartbeat, work request, Goodbye) that cannot leave in this time is dropped and
logged (a stalled controller)."""
FLUSH_S = 5.0
"""On exit, the longest wait for the last samples and the Goodbye to leave (``end_context``: it returns
as soon as they have; this bounds only a controller that is gone)."""

class GeneratorWorker(RejoinMixin):
    def __init__(self, controller: str, *, worker_id: str = "", quant_fmt: str = "", slots: int = 0,
                 drain_s: float = DRAIN_S, hello_timeout_s: float = HELLO_TIMEOUT_S, curve=None, engine: str = "native",
                 device: str = "auto", sglang: dict[str, str] | None = None, log_dir: str = "",
                 native: dict[str, str] | None = None) -> None:
        self.curve = curve  # CurveConfig (client keys) when the job runs with transport.keys_dir
        self.engine_kind = engine
        self.device = device
        self.native = dict(native or {})  # decode_step / cuda_graphs / compile of a native engine
        self.sglang = dict(sglang or {})
        self.log_dir = log_dir
        self.fatal: BaseException | None = None  # the first error of any thread; the process exits with 1
        self.gave_up = ""  # why the worker left a run it cannot serve any more (exit 1, one line, no traceback)
        self.left = False
        # checked before any socket: a known engine, and SGLang serves full-precision formats only
        EngineSpec(kind=engine, quant_format=quant_fmt or ("fp32" if engine == "sglang" else "int8"),
                   decode_step=self.native.get("decode_step", "auto"), cuda_graphs=self.native.get("cuda_graphs", "auto"))
        self.controller = controller
        self.worker_id = worker_id or f"{socket.gethostname()}-{os.getpid()}"
        # this process's own socket identity: a second process under the same id is refused by name, not parked
        self.identity = f"{self.worker_id}/{os.getpid()}-{secrets.token_hex(4)}"
        self.requested_fmt = quant_fmt
        self.requested_slots = slots
        self.drain_s = drain_s
        self.hello_timeout_s = hello_timeout_s
        self.stop = threading.Event()
        self.results: queue.Queue = queue.Queue()
        self.outstanding: dict[str, str] = {}  # sample id -> group id, assigned and not yet sent
        self.samples_sent = 0
        self.weights_version = -1  # newest version handed to the engine (applied at its next step)
        self.tokens_generated = 0
        self.weight_sync_s = 0.0  # seconds spent fetching + unpacking + handing over new versions (comms thread)
        self.weight_syncs = 0
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

    # ------------------------------------------------------------------------------ handshake
    def _wire_format(self) -> str:
        """The published format to fetch: a native actor fetches its own; SGLang fetches fp32/bf16."""
        fmt = getattr(self, "fmt", self.requested_fmt)
        if self.engine_kind != "sglang":
            return fmt
        return EngineSpec(kind="sglang", quant_format=fmt or "fp32").wire_format

    def _hello(self) -> P.Hello:
        caps = {"engine": self.engine_kind, "quant_format": self._wire_format(), "slots": str(self.requested_slots),
                "pid": str(os.getpid()), "host": socket.gethostname()}
        return P.Hello(protocol_version=P.PROTOCOL_VERSION, role="generator", peer_id=self.worker_id,
                       capabilities=caps)

    def _handshake(self) -> P.Welcome:
        hello = self._hello()
        deadline = time.monotonic() + self.hello_timeout_s
        while time.monotonic() < deadline and not self.stop.is_set():
            self.ctl.send(hello)
            env = self.ctl.recv(HELLO_RETRY_S)
            if env is None:
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

    # ------------------------------------------------------------------------------------ run
    def run(self) -> int:
        # The control and sample sockets get a context of their own, so that leaving can wait until the
        # last samples and the Goodbye have left (end_context), however long that takes.
        self.ctx = private_context()
        self.ctl = ZmqChannel.connect(zmq.DEALER, self.controller, name="worker-ctl",
                                      identity=self.identity.encode(), curve=self.curve, context=self.ctx)
        try:
            welcome = self._handshake()
        except SystemExit:
            self.ctl.close()
            end_context(self.ctx)
            raise
        try:
            if (why := P.version_refusal(welcome.protocol_version, f"the controller at {self.controller}")) is not None:
                raise ValueError(why)
            setup = welcome.worker_setup()
            self.slots = self.requested_slots or setup.worker_slots
            if self.slots < setup.group_size:
                raise ValueError(f"{self.slots} slots cannot hold a group of {setup.group_size} samples, so this "
                                 f"worker would never be given work; start it with slots={setup.group_size} or "
                                 "more, or without slots= to take the run's rollout.worker_slots")
        except ValueError as e:
            self.ctl.close()
            raise SystemExit(f"worker {self.worker_id}: {e}") from None
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
            comms = threading.Thread(target=self._comms_main, name="worker-comms", daemon=True)
            comms.start()
            while comms.is_alive() and self.fatal is None:  # also while draining: in-flight samples finish
                for res in self.engine.poll(ENGINE_POLL_S):
                    self.results.put(res)
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

    @contextlib.contextmanager
    def _heartbeats_while_starting(self):
        """Heartbeats from a second thread while the engine is built and loaded, so the controller does not
        declare a worker dead whose server is still starting. That thread owns the control socket meanwhile
        (nothing else uses it until the comms thread starts, after this block)."""
        done = threading.Event()

        def beat() -> None:
            while not done.wait(self.heartbeat_s):
                self._send_ctl(self._heartbeat(-1, {"outstanding": 0.0, "samples": 0.0}))
                env = self.ctl.recv(0.0)
                while env is not None:  # nothing was asked yet: only a Shutdown (the run ended) matters
                    if isinstance(env.msg, P.Shutdown):
                        log.info("controller asked worker %s to stop while starting: %s", self.worker_id,
                                 env.msg.reason)
                        self.stop.set()
                    env = self.ctl.recv(0.0)

        beater = threading.Thread(target=beat, name="worker-start-heartbeat", daemon=True)
        beater.start()
        try:
            yield
        finally:
            done.set()
            beater.join()

    def _engine_spec(self, setup: P.WorkerSetup) -> EngineSpec:
        return engine_spec(setup, kind=self.engine_kind, fmt=self.fmt, device=self.device, slots=self.slots,
                           sglang=self.sglang, native=self.native, log_dir=self.log_dir)

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
        # (SmolLM2-135M int8: 0.15 GB after the build, 0.2 GB after each swap).
        malloc_trim()
        ann, buffers = self._weights.fetch(version, timeout_s=timeout_s, fmt=self.wire_fmt, cancel=cancel)
        if ann.version <= self.weights_version:
            return
        self._take_weights(ann, buffers, t0)

    def _take_weights(self, ann, buffers, t0: float) -> None:
        """Hand fetched weights to the engine (applied at its next step); ``t0``: when the fetch began."""
        from asyncrl.transport.publication import from_wire

        self._engine.update_weights(ann.version, from_wire(ann, buffers))
        self.weights_checksum = ann.checksum
        self.weights_version = ann.version
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
            self._flush_results()
            if draining_since is not None:
                if not self.outstanding or now - draining_since > self.drain_s:
                    self._leave()
                    return
            elif not request_in_flight and now >= next_request:
                free = self.slots - len(self.outstanding)
                if free >= self.min_credits:
                    self._send_ctl(P.WorkRequest(worker_id=self.worker_id, credits=free,
                                                 version=self.weights_version))
                    request_in_flight = True
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

    def _accept(self, a: P.RolloutAssignment) -> None:
        from asyncrl.engine import GenRequest, SamplingParams

        prompt = a.prompt_ids.to_numpy().tolist()
        p = a.params
        params = SamplingParams(max_new_tokens=p.max_new_tokens, temperature=p.temperature, top_p=p.top_p,
                                top_k=p.top_k, stop_token_ids=tuple(p.stop_token_ids) or None, seed=p.seed)
        # A group the controller took back (overdue, or this worker was declared dead) may come back to this
        # worker while its samples still run here: those keep running, and their results count for it.
        if len(new := [sid for sid in a.sample_ids if sid not in self.outstanding]) < len(a.sample_ids):
            log.info("group %s came back to worker %s while it still runs here", a.group_id, self.worker_id)
        for sid in a.sample_ids:
            self.outstanding[sid] = a.group_id
        if new:
            self._engine.submit([GenRequest(sample_id=sid, prompt_ids=prompt, params=params) for sid in new])

    def _flush_results(self) -> None:
        while True:
            try:
                res = self.results.get_nowait()
            except queue.Empty:
                return
            group_id = self.outstanding.get(res.sample_id)
            if group_id is None or res.finish_reason == "abort":
                continue  # aborted partial samples are handed back in Goodbye, never sent as results
            msg = P.FinishedSample(
                sample_id=res.sample_id, group_id=group_id,
                prompt_ids=P.Array.from_numpy(np.asarray(res.prompt_ids, np.int32)),
                response_ids=P.Array.from_numpy(np.asarray(res.response_ids, np.int32)),
                behav_logp=P.Array.from_numpy(res.behav_logp), versions=P.Array.from_numpy(res.versions),
                finish_reason=res.finish_reason, worker_id=self.worker_id, engine=self.engine_kind,
                quant_format=self.fmt, timings=res.timings,
            )
            try:
                self._push.send(msg, timeout_s=SAMPLE_SEND_TIMEOUT_S)
            except ChannelTimeout:
                log.error("controller stopped taking samples; keeping %s for the next try", res.sample_id)
                self.results.put(res)
                return
            del self.outstanding[res.sample_id]
            self.samples_sent += 1
            self.tokens_generated += len(res.response_ids)

    def _maybe_update_weights(self) -> bool:
        """Fetch and hand over the newest announced version; True if the engine got new weights."""
        if self.refetch:
            return self._fetch_from_new_learner()
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
        return {"outstanding": float(len(self.outstanding)), "samples": float(self.samples_sent),
                "tokens_per_s": self.tokens_generated / dt,
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
        unfinished = list(self.outstanding)
        if unfinished:
            self._engine.abort(unfinished)
        self._send_ctl(P.Goodbye(peer_id=self.worker_id, unfinished=unfinished, reason=reason))
        log.info("worker %s left: %d samples sent, %d handed back", self.worker_id, self.samples_sent,
                 len(unfinished))  # the Goodbye leaves before the process ends: run() flushes on close


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(sys.argv[1:] if argv is None else argv)
    bound_kernel_caches()  # before the engine's first oneDNN matmul (asyncrl/learner/memory.py)
    logging.basicConfig(level=getattr(args, "log_level", "INFO"), format="%(asctime)s %(name)s %(message)s")
    keys_dir = getattr(args, "transport_keys_dir", "")
    curve = load_client_keys(keys_dir, getattr(args, "transport_key_name", "")) if keys_dir else None
    worker = GeneratorWorker(args.controller, worker_id=getattr(args, "worker_id", ""),
                             quant_fmt=getattr(args, "quant_fmt", ""), slots=int(getattr(args, "slots", 0)),
                             drain_s=float(getattr(args, "drain_s", DRAIN_S)), curve=curve,
                             engine=getattr(args, "engine", "native"), device=getattr(args, "device", "auto"),
                             sglang=settings(args, SGLANG_KEYS, "sglang_"), native=settings(args, NATIVE_KEYS),
                             log_dir=getattr(args, "log_dir", ""))
    worker.no_learner_limit_s = float(getattr(args, "no_learner_s", worker.no_learner_limit_s))
    signal.signal(signal.SIGTERM, lambda *_: worker.stop.set())
    signal.signal(signal.SIGINT, lambda *_: worker.stop.set())
    rc = worker.run()
    if rc != 0:  # fatal: leave now, even if a thread of a library is still blocked somewhere
        for flush in (logging.shutdown, sys.stdout.flush, sys.stderr.flush):
            flush()
        os._exit(rc)
    return rc


if __name__ == "__main__":
    raise SystemExit(main())
