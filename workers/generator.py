"""Generation worker process: ``asyncrl worker controller=tcp://HOST:PORT [key=value ...]``.

One process = one rollout engine. Joins a running job at any time from any host: the controller's
``Welcome`` carries everything else (sample and weight addresses, the model architecture, EOS ids),
the worker fetches the newest weights in its quantization format, then asks for work with a credit
window and streams every finished sample at once.

Threads: the *main thread* drives the engine (decode steps); the *comms thread* owns every socket
(control DEALER, sample PUSH, weight SUB/DEALER) and talks to the engine only through its
thread-safe surface (submit / update_weights / abort). Weight swaps land at a decode-step boundary.

Leaving: on SIGTERM (or ``Shutdown``) the worker stops asking for work, lets in-flight samples finish
for up to ``drain_s``, aborts the rest and hands them back in a ``Goodbye`` so the controller
reissues them; aborted partial samples are never sent as results.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import queue
import signal
import socket
import sys
import threading
import time
from collections.abc import Sequence

import numpy as np
import zmq

import protocols as P
from asyncrl.transport import ChannelTimeout, WeightClient, WeightFetchError, ZmqChannel, load_client_keys

log = logging.getLogger("asyncrl.worker")


def _build_engine(model_config_json: str, fmt: str, eos_ids: list[int], slots: int, max_seq_len: int):
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    from asyncrl.engine.native import NativeEngine

    torch.set_num_threads(1)
    cfg_dict = json.loads(model_config_json)
    config = AutoConfig.for_model(cfg_dict.pop("model_type"), **cfg_dict)
    torch.manual_seed(0)  # weights are replaced by the first fetch; the seed only makes init cheap to reason about
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    return NativeEngine(model, quant_format=fmt, version=-1, max_batch_size=slots,
                        max_seq_len=max_seq_len or None, eos_token_ids=eos_ids)


class GeneratorWorker:
    def __init__(self, controller: str, *, worker_id: str = "", quant_fmt: str = "", slots: int = 0,
                 drain_s: float = 10.0, hello_timeout_s: float = 120.0, curve=None) -> None:
        self.curve = curve  # CurveConfig (client keys) when the job runs with transport.keys_dir
        self.controller = controller
        self.worker_id = worker_id or f"{socket.gethostname()}-{os.getpid()}"
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
        self.t_start = time.monotonic()

    # ------------------------------------------------------------------------------ handshake
    def _hello(self) -> P.Hello:
        fmt = getattr(self, "fmt", self.requested_fmt)
        caps = {"engine": "native", "quant_format": fmt, "slots": str(self.requested_slots),
                "pid": str(os.getpid()), "host": socket.gethostname()}
        return P.Hello(protocol_version=P.PROTOCOL_VERSION, role="generator", peer_id=self.worker_id,
                       capabilities=caps)

    def _handshake(self) -> P.Welcome:
        hello = self._hello()
        deadline = time.monotonic() + self.hello_timeout_s
        while time.monotonic() < deadline and not self.stop.is_set():
            self.ctl.send(hello)
            env = self.ctl.recv(2.0)
            if env is None:
                continue
            msg = env.msg
            if isinstance(msg, P.Welcome):
                return msg
            if isinstance(msg, P.Reject):
                raise SystemExit(f"controller refused worker {self.worker_id}: {msg.reason}")
            if isinstance(msg, P.Error) and msg.code == "not_ready":
                time.sleep(0.5)
                continue
            log.warning("unexpected reply to Hello: %r", msg)
        raise SystemExit(f"no Welcome from controller {self.controller} within {self.hello_timeout_s}s; "
                         "is the job running and the address right?")

    # ------------------------------------------------------------------------------------ run
    def run(self) -> int:
        self.ctl = ZmqChannel.connect(zmq.DEALER, self.controller, name="worker-ctl",
                                      identity=self.worker_id.encode(), curve=self.curve)
        try:
            welcome = self._handshake()
        except SystemExit:
            self.ctl.close()
            raise
        cfg = welcome.config
        self.fmt = self.requested_fmt or cfg["quant_format"]
        self.slots = self.requested_slots or int(cfg["worker_slots"])
        self.heartbeat_s = float(cfg.get("heartbeat_s", "1.0"))
        self.engine = _build_engine(cfg["model_config"], self.fmt, json.loads(cfg["eos_token_ids"]), self.slots,
                                    int(cfg.get("max_seq_len", "0")))
        self.push = ZmqChannel.connect(zmq.PUSH, cfg["samples_address"], name="worker-samples", curve=self.curve)
        self.weights = WeightClient(cfg["weights_announce"], cfg["weights_fetch"],
                                    identity=f"{self.worker_id}-w".encode(), curve=self.curve)
        self._load_weights(-1)  # the newest the learner serves (the controller's view can lag behind it)
        log.info("worker %s ready: %s actor, weights v%d, %d slots", self.worker_id, self.fmt,
                 self.weights_version, self.slots)
        comms = threading.Thread(target=self._comms_loop, name="worker-comms", daemon=True)
        comms.start()
        try:
            while not self.stop.is_set():
                if self.engine.wait(0.1):
                    for res in self.engine.step():
                        self.results.put(res)
        finally:
            self.stop.set()
            comms.join(timeout=self.drain_s + 30)
            self.engine.close()
            for ch in (self.ctl, self.push, self.weights):
                ch.close()
        return 0

    def _load_weights(self, version: int, timeout_s: float = 120.0) -> None:
        from asyncrl.transport.publication import from_wire

        ann, buffers = self.weights.fetch(version, timeout_s=timeout_s, fmt=self.fmt)
        if ann.version <= self.weights_version:
            return
        self.engine.update_weights(ann.version, from_wire(ann, buffers))
        self.weights_version = ann.version

    # -------------------------------------------------------------------------- comms thread
    def _comms_loop(self) -> None:
        draining_since: float | None = None
        next_request = 0.0
        request_in_flight = False
        last_hb = 0.0
        while True:
            now = time.monotonic()
            if self.stop.is_set() and draining_since is None:
                draining_since = now
            if now - last_hb >= self.heartbeat_s:
                self._send_ctl(P.Heartbeat(peer_id=self.worker_id, time=time.time(), stats=self._stats()))
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
                if free > 0:
                    self._send_ctl(P.WorkRequest(worker_id=self.worker_id, credits=free,
                                                 version=self.weights_version))
                    request_in_flight = True
            env = self.ctl.recv(0.01)
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
                log.info("worker %s re-registered with the controller", self.worker_id)
            elif isinstance(msg, P.Error):
                request_in_flight = False
                next_request = time.monotonic() + 0.5
                if msg.code == "not_registered":  # declared dead (slow start, pause) or controller restarted
                    log.warning("controller does not know worker %s; joining again", self.worker_id)
                    self._send_ctl(self._hello())
                else:
                    log.warning("controller error: %s %s", msg.code, msg.message)

    def _accept(self, a: P.RolloutAssignment) -> None:
        from asyncrl.engine import GenRequest, SamplingParams

        prompt = a.prompt_ids.to_numpy().tolist()
        p = a.params
        params = SamplingParams(max_new_tokens=p.max_new_tokens, temperature=p.temperature, top_p=p.top_p,
                                top_k=p.top_k, stop_token_ids=tuple(p.stop_token_ids) or None, seed=p.seed)
        for sid in a.sample_ids:
            self.outstanding[sid] = a.group_id
        self.engine.submit([GenRequest(sample_id=sid, prompt_ids=prompt, params=params) for sid in a.sample_ids])

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
                finish_reason=res.finish_reason, worker_id=self.worker_id, engine="native",
                quant_format=self.fmt, timings=res.timings,
            )
            try:
                self.push.send(msg, timeout_s=30.0)
            except ChannelTimeout:
                log.error("controller stopped taking samples; keeping %s for the next try", res.sample_id)
                self.results.put(res)
                return
            del self.outstanding[res.sample_id]
            self.samples_sent += 1
            self.tokens_generated += len(res.response_ids)

    def _maybe_update_weights(self) -> bool:
        """Fetch and hand over the newest announced version; True if the engine got new weights."""
        ann = self.weights.poll_announce(0.0, fmt=self.fmt)
        if ann is None or ann.version <= self.weights_version:
            return False
        try:
            self._load_weights(ann.version, timeout_s=60.0)
        except (WeightFetchError, ValueError) as e:  # QuantError is a ValueError: keep the old version
            log.error("could not load weights v%d, keeping v%d: %s", ann.version, self.engine.version, e)
            return False
        return True

    def _stats(self) -> dict[str, float]:
        dt = max(1e-6, time.monotonic() - self.t_start)
        return {"version": float(self.engine.version), "outstanding": float(len(self.outstanding)),
                "samples": float(self.samples_sent), "tokens_per_s": self.tokens_generated / dt}

    def _send_ctl(self, msg) -> None:
        try:
            self.ctl.send(msg, timeout_s=5.0)
        except ChannelTimeout:
            log.warning("control channel stalled; dropped %s", type(msg).__name__)

    def _leave(self) -> None:
        unfinished = list(self.outstanding)
        if unfinished:
            self.engine.abort(unfinished)
        self._send_ctl(P.Goodbye(peer_id=self.worker_id, unfinished=unfinished, reason="stopping"))
        log.info("worker %s left: %d samples sent, %d handed back", self.worker_id, self.samples_sent,
                 len(unfinished))
        time.sleep(0.2)  # let the Goodbye leave before linger=0 closes the socket


def parse_args(argv: Sequence[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="asyncrl worker", description="join a running asyncrl job as a "
                                "generation worker", epilog="also accepts key=value: controller=ADDR, "
                                "quant.fmt=int8, worker_id=NAME, slots=N")
    p.add_argument("overrides", nargs="*", help="controller=tcp://HOST:PORT and other key=value settings")
    args = p.parse_args(argv)
    kv = {}
    for ov in args.overrides:
        if "=" not in ov:
            p.error(f"{ov!r} is not key=value")
        k, v = ov.split("=", 1)
        kv[k] = v
    known = {"controller", "quant.fmt", "worker_id", "slots", "drain_s", "log_level", "transport.keys_dir",
             "transport.key_name"}
    unknown = set(kv) - known
    if unknown:
        p.error(f"unknown setting(s) {sorted(unknown)}; known: {sorted(known)}")
    if "controller" not in kv:
        p.error("controller=tcp://HOST:PORT is required (printed by `asyncrl train` at start)")
    return argparse.Namespace(**{k.replace(".", "_"): v for k, v in kv.items()})


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(sys.argv[1:] if argv is None else argv)
    logging.basicConfig(level=getattr(args, "log_level", "INFO"), format="%(asctime)s %(name)s %(message)s")
    keys_dir = getattr(args, "transport_keys_dir", "")
    curve = load_client_keys(keys_dir, getattr(args, "transport_key_name", "")) if keys_dir else None
    worker = GeneratorWorker(args.controller, worker_id=getattr(args, "worker_id", ""),
                             quant_fmt=getattr(args, "quant_fmt", ""), slots=int(getattr(args, "slots", 0)),
                             drain_s=float(getattr(args, "drain_s", 10.0)), curve=curve)
    signal.signal(signal.SIGTERM, lambda *_: worker.stop.set())
    signal.signal(signal.SIGINT, lambda *_: worker.stop.set())
    return worker.run()


if __name__ == "__main__":
    raise SystemExit(main())
