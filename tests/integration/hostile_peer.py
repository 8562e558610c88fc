"""Hostile clients of a running controller (real processes, real sockets), for tests/integration.

Run as ``python tests/integration/hostile_peer.py ROLE CONTROL_ADDRESS`` (or ``@RUN_DIR/controller.json``: wait
for the run's controller to write its addresses, so an attacker can start with the run); each prints "ready"
once its attack is under way and keeps attacking until SIGTERM:
  flood    sends 300k work requests as fast as the socket takes them and never reads a reply
  hang     registers as a worker, takes assignments, heartbeats every second, never returns a sample
  poison   registers as a worker and returns every assigned sample with out-of-vocabulary token ids
"""

from __future__ import annotations

import os
import signal
import sys
import time

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

import protocols as P  # noqa: E402

STOP = {"flag": False}


def _arr(x) -> P.Array:
    return P.Array.from_numpy(np.ascontiguousarray(x))


def _register(ch, peer_id: str):
    while not STOP["flag"]:
        ch.send(P.Hello(protocol_version=P.PROTOCOL_VERSION, role="generator", peer_id=peer_id,
                        capabilities={"quant_format": "int8"}))
        env = ch.recv(10.0)
        if env is not None and isinstance(env.msg, P.Welcome):
            return env.msg
        time.sleep(0.5)
    raise SystemExit(0)


def main() -> int:
    import zmq

    from asyncrl.transport import ChannelTimeout, ZmqChannel

    signal.signal(signal.SIGTERM, lambda *_: STOP.update(flag=True))
    role, address = sys.argv[1], sys.argv[2]
    if address.startswith("@"):  # the controller's address file, once it exists
        import json

        while not os.path.exists(address[1:]):
            if STOP["flag"]:
                return 0
            time.sleep(0.05)
        address = json.loads(open(address[1:]).read())["control"]
    if role == "flood":
        ch = ZmqChannel.connect(zmq.DEALER, address, identity=b"flood", hwm=100_000)
        print("ready", flush=True)
        for _ in range(300_000):
            if STOP["flag"]:
                break
            ch.send(P.WorkRequest(worker_id="flood", credits=64), timeout_s=None)
        while not STOP["flag"]:  # connected, never reading
            time.sleep(0.2)
        return 0
    ch = ZmqChannel.connect(zmq.DEALER, address, identity=role.encode())
    welcome = _register(ch, role)
    setup = welcome.worker_setup()
    vocab = setup.vocab_size()
    push = ZmqChannel.connect(zmq.PUSH, setup.samples_address)
    print("ready", flush=True)
    last_beat = last_ask = 0.0

    def send(msg, via=ch) -> None:  # never blocks: once the run is over the controller reads no more
        try:
            via.send(msg, timeout_s=0.0)
        except ChannelTimeout:
            pass

    while not STOP["flag"]:
        now = time.monotonic()
        if now - last_beat > 1.0:
            send(P.Heartbeat(peer_id=role, time=time.time(), version=10**6))
            last_beat = now
        if now - last_ask > 0.05:  # as eager as a real worker: it competes for every admitted group
            # it claims the newest weights, so the controller hands it groups of every version
            send(P.WorkRequest(worker_id=role, credits=8, version=10**6))
            last_ask = now
        env = ch.recv(0.02)
        if env is None:
            continue
        msg = env.msg
        if isinstance(msg, P.RolloutAssignment) and role == "poison":
            for sid in msg.sample_ids:
                ids = np.array([vocab + 7, vocab + 100, 2], np.int32)  # right shapes, ids outside the vocabulary
                send(P.FinishedSample(sample_id=sid, group_id=msg.group_id, prompt_ids=msg.prompt_ids,
                                      response_ids=_arr(ids), behav_logp=_arr(np.full(3, -0.5, np.float32)),
                                      versions=_arr(np.full(3, welcome.latest_version, np.int32)),
                                      finish_reason="stop", worker_id=role), via=push)
        elif isinstance(msg, P.Welcome):
            welcome = msg
        elif isinstance(msg, P.Error) and msg.code == "not_registered":
            welcome = _register(ch, role)
    return 0


if __name__ == "__main__":
    sys.exit(main())
