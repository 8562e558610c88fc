"""Hostile input against every listening socket of real processes: the controller (control ROUTER and
samples PULL) and a weight server (fetch ROUTER and announcement PUB).

Thousands of frames per socket: random bytes, truncated and bit-flipped valid messages, Hello with a
wrong protocol version, msgpack length fields that lie, valid framing around absurd arrays (dtype,
shape and byte length that disagree), NaN behaviour log-probs in an otherwise valid FinishedSample,
unknown tags, multi-frame garbage, multi-megabyte frames, valid messages sent to the wrong socket, and
raw TCP garbage below ZeroMQ. The processes must keep serving and count every rejection exactly as
this test's own decoder predicts (``protocols.decode_frames`` is the contract both sides share).
"""

from __future__ import annotations

import collections
import json
import math
import socket
import subprocess
import sys
import time

import msgspec
import numpy as np
import pytest
import zmq

import protocols as P
from asyncrl.transport import ZmqChannel
from tests.integration.wire_peer import example_messages

pytestmark = pytest.mark.integration
PEER = "tests/integration/curve_peer.py"
# Hello would change what the readiness probe sees; VersionUpdate moves the controller's version.
STATEFUL = (P.Hello, P.VersionUpdate)
ZMTP_GREETING = b"\xff" + b"\x00" * 8 + b"\x7f" + b"\x03\x00" + b"NULL".ljust(20, b"\x00") + b"\x00" * 32


def _pack(obj) -> bytes:
    return msgspec.msgpack.encode(obj)


def _sample_dict(**fields) -> dict:
    fs = next(m for m in example_messages() if isinstance(m, P.FinishedSample))
    d = msgspec.msgpack.decode(P.encode(fs))  # plain dict, bytes kept as bytes
    d["sample_id"], d["group_id"] = "fuzz-9/0", "fuzz-9"
    d.update(fields)
    return d


def absurd_array(rng: np.random.Generator) -> list:
    """[dtype, shape, data] that frames fine and lies about its size or kind."""
    lies = [
        ["float32", [10**12], b"\x00" * 8],
        ["float32", [-5], b""],
        ["int32", [2**40, 2**40], b"\x00" * 4],
        ["int32", [1] * 9, b"\x00" * 4],  # rank 9
        ["complex128", [1], b"\x00" * 16],
        ["", [0], b""],
        ["int32", [3], b"\x00" * 11],
        ["int32", "shape", b""],
        ["float64", [2], b"\x00" * 16],  # right size, wrong dtype for the field
        ["int32", [2**63 - 1], b"\x00" * 4],
    ]
    return lies[int(rng.integers(len(lies)))]


def length_lie(rng: np.random.Generator) -> bytes:
    """A message map whose next field carries a str/bin/array/map header claiming up to 4 GiB."""
    headers = [b"\xdb\xff\xff\xff\xff", b"\xc6\xff\xff\xff\xff", b"\xdd\xff\xff\xff\xff", b"\xdf\xff\xff\xff\xff",
               b"\xc6\x7f\xff\xff\xff", b"\xdc\xff\xff", b"\xda\xff\xff", b"\xc5\xff\xff"]  # str/bin/array/map
    header = headers[int(rng.integers(len(headers)))]
    tag = ["finished_sample", "hello", "weight_fetch", "heartbeat"][int(rng.integers(4))]
    return b"\x83\xa4type" + _pack(tag) + b"\xa9sample_id" + header + rng.bytes(int(rng.integers(0, 32)))


def deep_nesting(rng: np.random.Generator) -> bytes:
    """A valid Heartbeat plus an unknown field (skipped by the decoder) nested up to 200k levels deep."""
    level = [b"\x91", b"\x81\xa1a"][int(rng.integers(2))]
    return (b"\x84\xa4type\xa9heartbeat\xa7peer_id\xa1x\xa4time" + _pack(1.0) + b"\xa3zzz"
            + level * int(rng.integers(10, 200_000)) + b"\xc0")


class Hostile:
    """Generators of one hostile frame list each; ``frames(per_kind)`` draws ``per_kind`` of every kind."""

    WRONG_VERSIONS = ("2.0", "0.9", "1", "abc", "", "3.1.4", "99999999999.0")
    TOKEN_FIELDS = ("prompt_ids", "response_ids", "behav_logp", "versions")

    def __init__(self, rng: np.random.Generator) -> None:
        self.rng = rng
        self.examples = [m for m in example_messages() if not isinstance(m, STATEFUL)]
        self.encoded = [P.encode(m) for m in example_messages()]

    def pick(self, seq):
        return seq[int(self.rng.integers(len(seq)))]

    def random(self) -> list[bytes]:
        return [self.rng.bytes(int(self.rng.integers(0, 512)))]

    def truncated(self) -> list[bytes]:
        e = self.pick(self.encoded)
        return [e[: int(self.rng.integers(0, len(e)))]]

    def bitflip(self) -> list[bytes]:
        return [_flip(self.rng, P.encode(self.pick(self.examples)))]

    def wrong_version_hello(self) -> list[bytes]:
        return [_pack({"type": "hello", "role": self.pick(["generator", "learner"]), "peer_id": "fuzz",
                       "protocol_version": self.pick(self.WRONG_VERSIONS)})]

    def absurd_arrays(self) -> list[bytes]:
        return [_pack(_sample_dict(**{self.pick(self.TOKEN_FIELDS): absurd_array(self.rng)}))]

    def length_lies(self) -> list[bytes]:
        return [length_lie(self.rng)]

    def nan_logp(self) -> list[bytes]:
        logp = np.array([np.nan, -np.inf, np.inf, -0.5, np.nan], np.float32)[self.rng.permutation(5)]
        return [_pack(_sample_dict(behav_logp=["float32", [5], logp.tobytes()]))]

    def unknown_tag(self) -> list[bytes]:
        return [self.pick([_pack({"type": self.rng.bytes(6).hex(), "peer_id": "x"}), _pack({"peer_id": "x"}),
                           _pack({"type": 7})])]

    def multi_frame(self) -> list[bytes]:
        extra = [self.rng.bytes(int(self.rng.integers(0, 64))) for _ in range(int(self.rng.integers(1, 6)))]
        return [self.pick(self.encoded), *extra]

    def wrong_socket(self) -> list[bytes]:
        """A valid message this socket does not take (a WeightChunk with its payload frame)."""
        m = self.pick(self.examples)
        return [P.encode(m)] + ([b"\x00" * m.nbytes] if isinstance(m, P.WeightChunk) else [])

    def deep_nesting(self) -> list[bytes]:
        return [deep_nesting(self.rng)]

    KINDS = ("random", "truncated", "bitflip", "wrong_version_hello", "absurd_arrays", "length_lies", "nan_logp",
             "unknown_tag", "multi_frame", "wrong_socket", "deep_nesting")

    def frames(self, per_kind: int) -> list[tuple[str, list[bytes]]]:
        """``per_kind`` frame lists of each kind plus four multi-megabyte ones, shuffled."""
        out = [(k, getattr(self, k)()) for k in self.KINDS for _ in range(per_kind)]
        out += [("huge", [self.rng.bytes(4 << 20)]) for _ in range(3)]
        chunk = P.WeightChunk(version=1, index=0, count=1, name="w", dtype="uint8", shape=(4,), nbytes=4)
        out += [("huge", [P.encode(chunk), self.rng.bytes(8 << 20)])]  # the payload lies about its size
        return [out[i] for i in self.rng.permutation(len(out))]


def hostile_frames(rng: np.random.Generator, per_kind: int) -> list[tuple[str, list[bytes]]]:
    return Hostile(rng).frames(per_kind)


def _flip(rng: np.random.Generator, buf: bytes) -> bytes:
    b = bytearray(buf)
    for i in rng.integers(0, len(b), size=int(rng.integers(1, 4))):
        b[i] ^= 1 << int(rng.integers(8))
    return bytes(b)


def predict(frames_list) -> tuple[collections.Counter, list]:
    """What a server must reject (by reason) and what it must accept, per ``protocols.decode_frames``."""
    rejected, valid = collections.Counter(), []
    for _, frames in frames_list:
        try:
            valid.append(P.decode_frames(frames)[0])
        except P.ProtocolError as e:
            rejected[e.reason] += 1
    return rejected, valid


def tcp_garbage(address: str, rng: np.random.Generator, n: int, *, signature: bool) -> None:
    """Raw TCP connections of random bytes. With the ZMTP signature first, libzmq fails the handshake and
    no message results; without it, libzmq takes the peer for ZMTP/1.0 and frames the bytes as messages."""
    host, port = address[len("tcp://"):].rsplit(":", 1)
    for i in range(n):
        payload = (ZMTP_GREETING[: 10 + 54 * (i % 2)] if signature else b"") + rng.bytes(int(rng.integers(1, 4096)))
        try:
            with socket.create_connection((host, int(port)), timeout=2.0) as s:
                s.sendall(payload)
        except OSError:  # the peer may reset a connection it finds hostile: that is its right
            pass


def _zmtp_frame(flags: int, body: bytes) -> bytes:
    if len(body) < 256:
        return bytes([flags, len(body)]) + body
    return bytes([flags | 0x02]) + len(body).to_bytes(8, "big") + body


def zmtp_connect(address: str, socket_type: bytes) -> socket.socket:
    """A hand-made ZMTP 3.0 NULL-mechanism peer (no libzmq on this side): greeting, READY, then raw frames."""
    host, port = address[len("tcp://"):].rsplit(":", 1)
    s = socket.create_connection((host, int(port)), timeout=10.0)
    s.sendall(ZMTP_GREETING)
    _read_exactly(s, 64)  # the server's greeting
    s.sendall(_zmtp_frame(0x04, b"\x05READY\x0bSocket-Type" + len(socket_type).to_bytes(4, "big") + socket_type))
    flags, size = _read_exactly(s, 2)
    _read_exactly(s, size)  # the server's READY (short command frame)
    assert flags == 0x04
    return s


def _read_exactly(s: socket.socket, n: int) -> bytes:
    buf = b""
    while len(buf) < n:
        chunk = s.recv(n - len(buf))
        assert chunk, "the server closed a ZMTP handshake"
        buf += chunk
    return buf


def zmtp_send(s: socket.socket, frames_list) -> None:
    s.sendall(b"".join(_zmtp_frame(int(i < len(frames) - 1), f)
                       for _, frames in frames_list for i, f in enumerate(frames)))


def send_and_drain(dealer: ZmqChannel, frames_list) -> list:
    """Send every frame list, reading replies as they come (the server never blocks on us)."""
    replies = []
    for _, frames in frames_list:
        dealer.send_frames(frames, timeout_s=10.0)
        while (env := dealer.recv(0.0)) is not None:
            replies.append(env.msg)
    return replies


def drain_until(dealer: ZmqChannel, replies: list, done, timeout_s: float = 30.0):
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        env = dealer.recv(0.5)
        if env is not None:
            replies.append(env.msg)
            if done(env.msg):
                return env.msg
    raise AssertionError(f"no final reply within {timeout_s}s; last replies: {replies[-3:]}")


def rejected_counts(metrics: dict, prefix: str) -> dict[str, int]:
    skip = {"error_reply_dropped", "fetch_aborted", "unexpected"}
    return {k[len(prefix) + 1:]: int(v) for k, v in metrics.items()
            if k.startswith(prefix + "/") and k[len(prefix) + 1:] not in skip}


# --------------------------------------------------------------------------------- controller
@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory):
    from asyncrl.config.loader import load_train_config
    from asyncrl.models.prepare import prepare_model

    cache = tmp_path_factory.mktemp("models")
    overrides = ["model.warmstart_steps=0", f"model.cache_dir={cache}"]
    return overrides, prepare_model(load_train_config(overrides), log=lambda _: None)


def start_controller(procs, tmp_path, tiny_model):
    from asyncrl.config.loader import load_train_config, save_config

    overrides, model_dir = tiny_model
    run = tmp_path / "run"
    run.mkdir()
    save_config(load_train_config([*overrides, f"runs_dir={tmp_path}"]), run / "config.json")
    stderr = open(tmp_path / "controller.stderr", "w+b")
    proc = procs.spawn([sys.executable, "-m", "workers.controller", "--run-dir", str(run), "--model-dir",
                        str(model_dir), "--publish-formats", "int8"], stderr=stderr)
    deadline = time.monotonic() + 60
    while not (run / "controller.json").exists():
        assert proc.poll() is None, (tmp_path / "controller.stderr").read_text()
        assert time.monotonic() < deadline, "controller did not start listening"
        time.sleep(0.1)
    time.sleep(0.1)  # written before it starts polling; let the loop begin
    return proc, run, json.loads((run / "controller.json").read_text()), tmp_path / "controller.stderr"


def hello(peer_id: str) -> P.Hello:
    return P.Hello(protocol_version=P.PROTOCOL_VERSION, role="generator", peer_id=peer_id)


def answered(msg) -> bool:
    return isinstance(msg, P.Welcome) or (isinstance(msg, P.Error) and msg.code == "not_ready")


def test_controller_survives_thousands_of_hostile_frames_per_socket_and_counts_each(procs, tmp_path, tiny_model):
    rng = np.random.default_rng(7)
    proc, run, addrs, stderr = start_controller(procs, tmp_path, tiny_model)
    for address in addrs.values():
        tcp_garbage(address, rng, 60, signature=True)
    # Hostile frames from hand-made ZMTP peers, then from libzmq peers; all counted in one prediction.
    raw_control, raw_samples = [], []
    to_control, to_samples = [], []
    for _ in range(8):
        for address, kind, sent, socks in ((addrs["control"], b"DEALER", to_control, raw_control),
                                           (addrs["samples"], b"PUSH", to_samples, raw_samples)):
            frames = hostile_frames(rng, per_kind=3)
            socks.append(zmtp_connect(address, kind))
            zmtp_send(socks[-1], frames)
            sent += frames
    from_zmq_samples, from_zmq_control = hostile_frames(rng, per_kind=300), hostile_frames(rng, per_kind=300)
    push = ZmqChannel.connect(zmq.PUSH, addrs["samples"], hwm=0)
    for _, frames in from_zmq_samples:
        push.send_frames(frames, timeout_s=10.0)
    with ZmqChannel.connect(zmq.DEALER, addrs["control"], hwm=0) as dealer:
        replies = send_and_drain(dealer, from_zmq_control)
        dealer.send(hello("probe"))  # processed after every frame before it on this connection
        drain_until(dealer, replies, answered)
    to_control += from_zmq_control
    to_samples += from_zmq_samples
    for i in range(5):  # and the control loop keeps turning after the sample burst
        with ZmqChannel.connect(zmq.DEALER, addrs["control"]) as fresh:
            fresh.send(hello(f"fresh-{i}"))
            assert answered(drain_until(fresh, [], answered, timeout_s=10.0))
        time.sleep(0.05)
    assert proc.poll() is None, stderr.read_text()
    proc.terminate()
    assert proc.wait(timeout=30) == 0
    push.close()
    for s in raw_control + raw_samples:  # open until now: the controller's replies to them must not drop
        s.close()
    assert b"Traceback" not in stderr.read_bytes()

    final = json.loads((run / "controller_final.json").read_text())
    sample_rejects, sample_valid = predict(to_samples)
    control_rejects, control_valid = predict(to_control)
    assert len(to_samples) > 3000 and sum(control_rejects.values()) > 2000
    assert rejected_counts(final, "transport/samples/rejected") == dict(sample_rejects)
    assert rejected_counts(final, "transport/control/rejected") == dict(control_rejects)
    assert final["transport/samples/rejected"] == sum(sample_rejects.values())
    # Every Error reply went out or, when the peer's pipe was full (the controller never blocks on a
    # peer; a loaded machine can starve its I/O thread), was counted as dropped: nothing unaccounted.
    dropped = int(final.get("transport/control/rejected/error_reply_dropped", 0))
    assert final["transport/control/rejected"] == sum(control_rejects.values()) + dropped
    assert final["transport/samples/received"] == len(sample_valid)
    assert final["transport/control/received"] == len(control_valid) + 6
    decode_errors = [r for r in replies if isinstance(r, P.Error) and r.code in control_rejects]
    expected = sum(predict(from_zmq_control)[0].values())  # each answered with its reason, or counted
    assert len(decode_errors) <= expected <= len(decode_errors) + dropped

    # Valid frames that are still wrong are counted by the controller and change nothing.
    c = collections.Counter(type(m) for m in control_valid)
    handled = {P.Hello, P.WorkRequest, P.Heartbeat, P.Goodbye, P.BatchRequest, P.VersionUpdate}
    assert final["controller/control/rejected_hello"] == c[P.Hello] > 0
    assert final["controller/control/unexpected"] == sum(n for t, n in c.items() if t not in handled)
    samples = [m for m in sample_valid if isinstance(m, P.FinishedSample)]
    nonfinite = sum(not np.isfinite(m.behav_logp.to_numpy()).all() for m in samples)
    assert final["controller/samples/nonfinite_behav_logp"] == nonfinite > 0
    assert final["controller/samples/unknown"] == len(samples)
    assert final["controller/samples/unexpected_message"] == len(sample_valid) - len(samples)
    assert final["controller/samples_logged"] == 0 and final["controller/cursor"] == 0


# ------------------------------------------------------------------------------- weight server
def weight_fetch_frames(rng: np.random.Generator, n: int) -> list[tuple[str, list[bytes]]]:
    """WeightFetch requests that decode but ask for absurd things (answered, never counted as rejects)."""
    versions = [2**63 - 1, -(2**63), 10**12, 0, 5]
    return [("fetch", [P.encode(P.WeightFetch(version=versions[int(rng.integers(len(versions)))],
                                              fmt=["int8", "", "x" * 10_000, "nvfp4"][int(rng.integers(4))]))])
            for _ in range(n)]


def test_weight_server_survives_hostile_frames_and_still_serves_the_right_bytes(procs, tmp_path):
    from asyncrl.transport import WeightClient
    from tests.integration.curve_peer import WEIGHTS

    rng = np.random.default_rng(11)
    out = tmp_path / "weights.json"
    proc = procs.python(PEER, "weights", str(out), stdout=subprocess.PIPE)
    addrs = json.loads(proc.stdout.readline().decode())
    for address in addrs.values():
        tcp_garbage(address, rng, 60, signature=True)
    raw = [zmtp_connect(addrs["fetch"], b"DEALER") for _ in range(4)]
    raw_frames = []
    for s in raw:
        raw_frames.append(hostile_frames(rng, per_kind=3))
        zmtp_send(s, raw_frames[-1])
    ctx = zmq.Context.instance()
    xsub = ctx.socket(zmq.XSUB)  # the only peer a PUB accepts; it may send anything upstream
    xsub.linger = 0
    xsub.connect(addrs["announce"])
    for _ in range(1000):
        xsub.send(rng.bytes(int(rng.integers(0, 256))))

    frames = hostile_frames(rng, per_kind=200) + weight_fetch_frames(rng, 50)
    frames = [frames[i] for i in rng.permutation(len(frames))]
    with ZmqChannel.connect(zmq.DEALER, addrs["fetch"], hwm=0, zero_copy_recv=True) as dealer:
        replies = send_and_drain(dealer, frames)
        dealer.send(P.WeightFetch(version=777, fmt="barrier"))
        drain_until(dealer, replies, lambda m: isinstance(m, P.Error) and "'barrier'" in m.message)
    client = WeightClient(addrs["announce"], addrs["fetch"])
    try:
        ann, buffers = client.fetch(1, timeout_s=10.0)
        assert ann.version == 1 and bytes(buffers[0]) == WEIGHTS
    finally:
        client.close()
        xsub.close()
    assert proc.poll() is None
    proc.terminate()
    assert proc.wait(timeout=30) == 0
    for s in raw:
        s.close()

    final = json.loads(out.read_text())
    rejects, valid = predict(frames + [f for fs in raw_frames for f in fs])
    assert sum(rejects.values()) > 1500
    assert rejected_counts(final, "transport/weights/rejected") == dict(rejects)
    unexpected = sum(not isinstance(m, P.WeightFetch) for m in valid)
    assert final.get("transport/weights/rejected/unexpected", 0) == unexpected > 0
    assert final["transport/weights/rejected"] == sum(rejects.values()) + unexpected
    served = sum(isinstance(m, P.WeightFetch) and (m.version < 0 or m.version == 1) and m.fmt in ("", "int8")
                 for m in valid)
    assert final["fetches_served"] == served + 1
    assert math.isclose(final["transport/weights/received"], len(valid) + 2)


# ------------------------------------------------------------------------------- below ZeroMQ
def test_raw_tcp_garbage_that_libzmq_frames_as_zmtp1_is_rejected_and_counted(procs, tmp_path, tiny_model):
    """Random bytes with no ZMTP signature: libzmq falls back to ZMTP/1.0 and turns them into messages
    (how many depends on libzmq's parser, so this test checks survival and counting, not exact numbers)."""
    from asyncrl.transport import WeightClient
    from tests.integration.curve_peer import WEIGHTS

    rng = np.random.default_rng(13)
    proc, run, addrs, stderr = start_controller(procs, tmp_path, tiny_model)
    weights = procs.python(PEER, "weights", str(tmp_path / "weights.json"), stdout=subprocess.PIPE)
    waddrs = json.loads(weights.stdout.readline().decode())
    for address in [*addrs.values(), *waddrs.values()]:
        tcp_garbage(address, rng, 150, signature=False)
    with ZmqChannel.connect(zmq.DEALER, addrs["control"]) as dealer:
        dealer.send(hello("after-garbage"))
        assert answered(drain_until(dealer, [], answered, timeout_s=10.0))
    client = WeightClient(waddrs["announce"], waddrs["fetch"])
    try:
        assert bytes(client.fetch(1, timeout_s=10.0)[1][0]) == WEIGHTS
    finally:
        client.close()
    for p in (proc, weights):
        assert p.poll() is None
        p.terminate()
        assert p.wait(timeout=30) == 0
    assert b"Traceback" not in stderr.read_bytes()
    final = json.loads((run / "controller_final.json").read_text())
    wfinal = json.loads((tmp_path / "weights.json").read_text())
    assert final["transport/control/rejected"] > 0 and final["transport/samples/rejected"] > 0
    assert wfinal["transport/weights/rejected"] > 0 and wfinal["fetches_served"] == 1
    assert final["controller/samples_logged"] == 0 and final["controller/cursor"] == 0
