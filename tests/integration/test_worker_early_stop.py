"""A worker whose run ends before its first weights arrive leaves at once, with status 0.

A real ``asyncrl worker`` joins a controller stand-in on real sockets. Its weight server is a real
ROUTER socket that never answers (the learner of a finished run is gone), so the worker's first fetch
would wait ``FIRST_WEIGHTS_TIMEOUT_S`` (120 s) and then fail with status 1. The stand-in answers the
worker's start-up heartbeats with ``Shutdown``, as the controller does once training is done: the worker
must give up the fetch, say ``Goodbye`` and exit 0 (a launcher does not restart a worker that left).
"""

from __future__ import annotations

import subprocess
import time

import pytest
import zmq
from transformers import AutoConfig

import protocols as P
from asyncrl.models import ensure_tiny_model
from asyncrl.transport import ZmqChannel
from workers.generator.weights import FIRST_WEIGHTS_TIMEOUT_S

pytestmark = pytest.mark.integration


def test_worker_told_to_stop_while_waiting_for_its_first_weights_leaves_with_status_zero(procs, tmp_path):
    model_dir = ensure_tiny_model(tmp_path / "tiny")
    ctl = ZmqChannel.bind(zmq.ROUTER, "tcp://127.0.0.1:0", reply_errors=True)
    pull = ZmqChannel.bind(zmq.PULL, "tcp://127.0.0.1:0")
    silent_fetch = ZmqChannel.bind(zmq.ROUTER, "tcp://127.0.0.1:0")  # receives fetches, never answers
    silent_announce = ZmqChannel.bind(zmq.PUB, "tcp://127.0.0.1:0")
    try:
        setup = P.WorkerSetup(samples_address=pull.address, weights_announce=silent_announce.address,
                              weights_fetch=silent_fetch.address, worker_slots=4, heartbeat_s=0.5,
                              model_config=AutoConfig.from_pretrained(model_dir).to_json_string(use_diff=False),
                              eos_token_ids=[2], quant_format="fp32", max_seq_len=64)
        worker = procs.python("-m", "asyncrl", "worker", f"controller={ctl.address}", "worker_id=w0",
                              "rollout.device=cpu", stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
        fetch_seen, goodbye, shutdowns = False, None, 0
        deadline = time.monotonic() + FIRST_WEIGHTS_TIMEOUT_S + 60
        while goodbye is None and worker.poll() is None and time.monotonic() < deadline:
            if silent_fetch.recv(0.0) is not None:
                fetch_seen = True
            env = ctl.recv(0.05)
            if env is None:
                continue
            m = env.msg
            if isinstance(m, P.Hello):
                ctl.send(P.Welcome(protocol_version=P.PROTOCOL_VERSION, server_id="stand-in",
                                   latest_version=0, setup=setup), to=env.peer)
            elif isinstance(m, P.Heartbeat) and fetch_seen:  # the run ends while the fetch waits
                ctl.send(P.Shutdown(reason="training finished"), to=env.peer)
                shutdowns += 1
            elif isinstance(m, P.WorkRequest):
                pytest.fail("a worker without weights asked for work")
            elif isinstance(m, P.Goodbye):
                goodbye = m
        out, _ = worker.communicate(timeout=60)
        text = out.decode(errors="replace")
        assert fetch_seen and shutdowns >= 1, text[-3000:]
        assert worker.returncode == 0, text[-3000:]
        assert goodbye is not None and goodbye.unfinished == [], text[-3000:]
        assert goodbye.reason == "stopped before its first weights"
        assert "stopped before its first weights arrived" in text
    finally:
        for ch in (ctl, pull, silent_fetch, silent_announce):
            ch.close()
