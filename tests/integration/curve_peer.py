"""Peer processes for the CURVE tests: a secured server and clients with or without the right key.

Run as ``python tests/integration/curve_peer.py ROLE ...``:
  server KEYS_DIR OUT_JSON        bind a CURVE ROUTER (control), PULL (samples) and a WeightServer on
                                  loopback; print their addresses as one JSON line; echo every control
                                  message but a Heartbeat, answered with version = the samples received from
                                  its peer_id; on SIGTERM write the counters to OUT_JSON and exit 0
  client ADDRS_JSON [KEYS_DIR NAME]  with keys (or plain without): Hello on control, push one sample (a
                                  served client asks until the server counts it), fetch the weights; print
                                  one JSON line of what worked; exit 0. A client with keys first waits for
                                  each socket's handshake outcome, so what it reports never depends on speed
  bind HOST [KEYS_DIR]            apply the bind policy to tcp://HOST:0 and bind; exit 0 if it bound
  weights OUT_JSON                a plain WeightServer (what learner rank 0 runs) serving version 1 of
                                  WEIGHTS, for the fuzz test; prints its addresses; on SIGTERM writes
                                  its counters to OUT_JSON and exits 0
"""

from __future__ import annotations

import json
import os
import signal
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

import zmq  # noqa: E402

import protocols as P  # noqa: E402
from asyncrl.transport import (  # noqa: E402
    WeightClient,
    WeightFetchError,
    WeightServer,
    ZmqChannel,
    auth_metrics,
    check_bind_security,
    load_client_keys,
    load_server_keys,
)
from tests.integration.wire_peer import example_messages  # noqa: E402

WEIGHTS = b"\x07" * 64


def server(keys_dir: str, out_path: str) -> int:
    stop = {"flag": False}
    signal.signal(signal.SIGTERM, lambda *_: stop.update(flag=True))
    curve = load_server_keys(keys_dir)
    ctl = ZmqChannel.bind(zmq.ROUTER, "tcp://127.0.0.1:0", name="control", curve=curve, reply_errors=True)
    pull = ZmqChannel.bind(zmq.PULL, "tcp://127.0.0.1:0", name="samples", curve=curve)
    weights = WeightServer(curve=curve)
    spec = P.TensorSpec(name="w", dtype="uint8", shape=(len(WEIGHTS),), nbytes=len(WEIGHTS))
    weights.publish(P.WeightAnnounce(version=1, fmt="int8", manifest=[spec], checksum="00",
                                     total_bytes=len(WEIGHTS)), [WEIGHTS])
    print(json.dumps({"control": ctl.address, "samples": pull.address, "announce": weights.announce_address,
                      "fetch": weights.fetch_address}), flush=True)
    samples = []
    while not stop["flag"]:
        env = pull.recv(0.0)
        if env is not None:
            samples.append(env.msg.worker_id)
        env = ctl.recv(0.02)
        if env is not None and isinstance(env.msg, P.Heartbeat):  # "how many of my samples came?"
            ctl.send(P.Heartbeat(peer_id=env.msg.peer_id, time=env.msg.time,
                                 version=samples.count(env.msg.peer_id)), to=env.peer)
        elif env is not None:
            ctl.send(env.msg, to=env.peer)
    out = {"samples_from": samples, "fetches_served": weights.fetches_served,
           **ctl.stats.as_metrics("transport/control"), **pull.stats.as_metrics("transport/samples"),
           **weights.as_metrics("transport/weights"), **auth_metrics()}
    with open(out_path, "w") as f:
        json.dump(out, f)
    weights.close()
    ctl.close()
    pull.close()
    return 0


def weights(out_path: str) -> int:
    stop = {"flag": False}
    signal.signal(signal.SIGTERM, lambda *_: stop.update(flag=True))
    server = WeightServer()
    spec = P.TensorSpec(name="w", dtype="uint8", shape=(len(WEIGHTS),), nbytes=len(WEIGHTS))
    server.publish(P.WeightAnnounce(version=1, fmt="int8", manifest=[spec], checksum="00",
                                    total_bytes=len(WEIGHTS)), [WEIGHTS])
    print(json.dumps({"announce": server.announce_address, "fetch": server.fetch_address}), flush=True)
    while not stop["flag"]:
        time.sleep(0.02)
    server.close()  # joins the serving thread: the counters are final
    out = {"fetches_served": server.fetches_served, **server.as_metrics("transport/weights")}
    with open(out_path, "w") as f:
        json.dump(out, f)
    return 0


WAIT_S = 60.0
"""Bounds a wait for what a served client must get (a handshake, an echo, the weights): a hang guard, never a
speed claim. A client that must get nothing waits ``SILENCE_S``: its silence is what the test checks."""
SILENCE_S = 3.0


def handshake(ch, curve) -> str:
    """A client with keys: wait until its socket's CURVE handshake was accepted or refused (the monitor's
    counters); "" for a plain client, whose socket has no monitor (it waits ``SILENCE_S`` for nothing)."""
    if curve is None:
        return ""
    deadline = time.monotonic() + WAIT_S
    while time.monotonic() < deadline:
        for outcome in ("accepted", "refused"):
            if ch.stats.auth_counts().get(outcome, 0):
                return outcome
        time.sleep(0.01)
    raise SystemExit(f"no CURVE handshake outcome within {WAIT_S:.0f} s")


def client(addrs_path: str, keys_dir: str = "", name: str = "") -> int:
    addrs = json.loads(open(addrs_path).read())
    curve = load_client_keys(keys_dir, name) if keys_dir else None
    who = name or "plain"
    result = {"who": who}
    with ZmqChannel.connect(zmq.DEALER, addrs["control"], curve=curve) as ctl, \
            ZmqChannel.connect(zmq.PUSH, addrs["samples"], curve=curve) as push:
        served = handshake(ctl, curve) == "accepted"
        hello = P.Hello(protocol_version=P.PROTOCOL_VERSION, role="generator", peer_id=who)
        try:
            ctl.send(hello, timeout_s=1.0)
            env = ctl.recv(WAIT_S if served else SILENCE_S)
        except TimeoutError:  # a refused connection leaves zmq no pipe to queue on
            env = None
        result["hello_echoed"] = env is not None and env.msg == hello
        sample = next(m for m in example_messages() if isinstance(m, P.FinishedSample))
        pushed = handshake(push, curve) == "accepted"
        try:
            push.send(P.FinishedSample(**{f: getattr(sample, f) for f in sample.__struct_fields__} | {"worker_id": who}),
                      timeout_s=1.0)
        except TimeoutError:
            pushed = False
        if served and pushed:  # push is fire-and-forget: ask the server until it counts the sample
            deadline, got = time.monotonic() + WAIT_S, 0
            while not got and time.monotonic() < deadline:
                ctl.send(P.Heartbeat(peer_id=who, time=0.0), timeout_s=WAIT_S)
                env = ctl.recv(WAIT_S)
                got = env.msg.version if env is not None and isinstance(env.msg, P.Heartbeat) else 0
                time.sleep(0.05)
        else:
            time.sleep(0.3)  # a sample that must not arrive: the chance it had to leave before the close
        result["refused"] = ctl.stats.auth.get("refused", 0)
    wc = WeightClient(addrs["announce"], addrs["fetch"], curve=curve)
    try:
        fetch_served = handshake(wc, curve) == "accepted"  # a refusal is known before the fetch times out
        _, buffers = wc.fetch(1, timeout_s=WAIT_S if fetch_served else SILENCE_S)
        result["weights"] = bytes(buffers[0]) == WEIGHTS
    except WeightFetchError as e:
        result["weights"] = False
        result["fetch_error"] = str(e)
    finally:
        wc.close()
    print(json.dumps(result), flush=True)
    return 0


def bind(host: str, keys_dir: str = "") -> int:
    address = f"tcp://{host}:0"
    try:
        check_bind_security(address, keys=bool(keys_dir), insecure=False)
    except ValueError as e:
        print(e, file=sys.stderr, flush=True)
        return 2
    with ZmqChannel.bind(zmq.ROUTER, address, curve=load_server_keys(keys_dir) if keys_dir else None) as ch:
        print(ch.address, flush=True)
    return 0


if __name__ == "__main__":
    role, rest = sys.argv[1], sys.argv[2:]
    sys.exit({"server": server, "client": client, "bind": bind, "weights": weights}[role](*rest))
