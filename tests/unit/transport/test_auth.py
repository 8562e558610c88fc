"""CURVE keys, the ZAP allow-list and its counters, over real tcp loopback sockets in one process."""

from __future__ import annotations

import os
import socket
import stat
import time

import numpy as np
import pytest
import zmq
import zmq.auth

import protocols as P
from asyncrl.transport import (
    ChannelTimeout,
    CurveConfig,
    WeightClient,
    WeightFetchError,
    WeightServer,
    ZmqChannel,
    auth_metrics,
    check_bind_security,
    client_curve,
    end_context,
    generate_keys,
    load_client_keys,
    load_server_keys,
    private_context,
    server_curve,
)
from asyncrl.transport.keys import CLIENTS_DIR
from workers.keys import keys_main

HB = P.Heartbeat(peer_id="w0", time=1.0)


@pytest.fixture
def keys(tmp_path):
    """A keys folder with an allow-listed ``client`` and a ``stranger`` whose key is not allow-listed."""
    generate_keys(tmp_path, ["server", "client", "stranger"])
    (tmp_path / CLIENTS_DIR / "stranger.key").unlink()
    return tmp_path


WAIT_S = 60.0
"""Bounds a wait for a handshake or message that takes milliseconds: a hang guard, never a speed claim (a
loaded machine may take seconds). Waits that must see nothing stay short: their silence is the check."""


def wait_for(pred, timeout_s: float = WAIT_S) -> bool:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if pred():
            return True
        time.sleep(0.01)
    return pred()


def try_send(ch: ZmqChannel, msg=HB, frames: list[bytes] | None = None) -> None:
    """Queue a send on a connection that may already be refused (then zmq has no pipe to queue on)."""
    try:
        ch.send_frames(frames, timeout_s=0.0) if frames is not None else ch.send(msg, timeout_s=0.0)
    except ChannelTimeout:
        pass


def plain_denials(ch) -> int:
    """A plain client at a CURVE socket: ``no_curve``, or ``aborted`` when it noticed the mismatch first."""
    return ch.stats.auth["no_curve"] + ch.stats.auth["aborted"]


# ------------------------------------------------------------------------------------- key files
def test_generate_keys_round_trips_pairs_and_allow_lists_every_client(tmp_path):
    written = generate_keys(tmp_path, ["server", "client", "client-1"])
    assert set(written) == {"server", "client", "client-1"}
    for name, secret in written.items():
        assert stat.S_IMODE(os.stat(secret).st_mode) == 0o600
        public, secret_key = zmq.auth.load_certificate(secret)
        assert (public, None) == zmq.auth.load_certificate(tmp_path / f"{name}.key")
        assert secret_key is not None and len(secret_key) == 40
    assert sorted(p.name for p in (tmp_path / CLIENTS_DIR).iterdir()) == ["client-1.key", "client.key"]
    server = load_server_keys(tmp_path)
    client = load_client_keys(tmp_path)  # "client" is the default among several pairs
    assert server.is_server and not client.is_server
    assert client.server_key == server.public_key
    assert client.public_key == zmq.auth.load_certificate(tmp_path / "client.key")[0]
    assert server.allowed() == {client.public_key, load_client_keys(tmp_path, "client-1").public_key}


def test_generate_keys_refuses_to_replace_existing_keys_unless_forced(tmp_path):
    generate_keys(tmp_path)
    old = zmq.auth.load_certificate(tmp_path / "server.key")[0]
    with pytest.raises(ValueError, match="exists"):
        generate_keys(tmp_path)
    generate_keys(tmp_path, overwrite=True)
    assert zmq.auth.load_certificate(tmp_path / "server.key")[0] != old


def test_load_client_keys_takes_the_only_pair_and_refuses_to_guess_among_several(tmp_path):
    generate_keys(tmp_path, ["server", "worker-a"])
    assert load_client_keys(tmp_path).public_key == zmq.auth.load_certificate(tmp_path / "worker-a.key")[0]
    generate_keys(tmp_path, ["worker-b"])
    with pytest.raises(ValueError, match="several client key pairs"):
        load_client_keys(tmp_path)


def test_missing_keys_are_explained_with_the_command_that_makes_them(tmp_path):
    with pytest.raises(ValueError, match="asyncrl keys generate"):
        load_server_keys(tmp_path)
    with pytest.raises(ValueError, match="asyncrl keys generate"):
        load_client_keys(tmp_path)


def test_transport_config_without_keys_dir_means_plain_sockets(keys):
    class T:
        keys_dir = ""

    assert server_curve(T) is None and client_curve(T) is None
    T.keys_dir = str(keys)
    assert server_curve(T).is_server and not client_curve(T).is_server


def test_keys_cli_generates_n_clients_and_adds_one_later(tmp_path, capsys):
    assert keys_main(["generate", str(tmp_path), "--clients", "3"]) == 0
    assert sorted(p.name for p in (tmp_path / CLIENTS_DIR).iterdir()) == [f"client-{i}.key" for i in range(3)]
    assert keys_main(["generate", str(tmp_path)]) == 2  # would replace the server pair
    assert keys_main(["add", str(tmp_path), "late-worker"]) == 0
    assert (tmp_path / CLIENTS_DIR / "late-worker.key").is_file()
    assert keys_main(["add", str(tmp_path / "nowhere"), "x"]) == 2
    assert "transport.keys_dir=" in capsys.readouterr().out


# ------------------------------------------------------------------------------- bind policy
@pytest.mark.parametrize("address", ["tcp://127.0.0.1:0", "tcp://localhost:5555", "tcp://127.0.1.1:9",
                                     "tcp://[::1]:5555", "ipc:///tmp/asyncrl.sock"])
def test_loopback_and_ipc_binds_are_always_allowed(address):
    check_bind_security(address, keys=False, insecure=False)


@pytest.mark.parametrize("address", ["tcp://0.0.0.0:5555", "tcp://*:5555", "tcp://10.1.2.3:0", "tcp://eth0:7"])
def test_non_loopback_bind_without_keys_refuses_and_says_how_to_fix(address):
    with pytest.raises(ValueError) as e:
        check_bind_security(address, keys=False, insecure=False)
    assert "asyncrl keys generate DIR" in str(e.value)
    assert "transport.keys_dir=DIR" in str(e.value) and "transport.insecure=true" in str(e.value)
    check_bind_security(address, keys=True, insecure=False)
    check_bind_security(address, keys=False, insecure=True)


def test_channel_refuses_client_keys_on_bind_and_server_keys_on_connect(keys):
    with pytest.raises(ValueError, match="server keys"):
        ZmqChannel.bind(zmq.ROUTER, "tcp://127.0.0.1:0", curve=load_client_keys(keys, "client"))
    with pytest.raises(ValueError, match="client keys"):
        ZmqChannel.connect(zmq.DEALER, "tcp://127.0.0.1:1", curve=load_server_keys(keys))


def test_curve_config_rejects_keys_of_the_wrong_length():
    with pytest.raises(ValueError, match="40-character"):
        CurveConfig(public_key=b"short", secret_key=b"x" * 40)


# ------------------------------------------------------------------------------ over sockets
def test_authorised_client_exchanges_messages_with_a_curve_router(keys):
    with ZmqChannel.bind(zmq.ROUTER, "tcp://127.0.0.1:0", curve=load_server_keys(keys)) as srv, \
            ZmqChannel.connect(zmq.DEALER, srv.address, curve=load_client_keys(keys, "client")) as cli:
        cli.send(HB)
        env = srv.recv(WAIT_S)
        assert env is not None and env.msg == HB
        srv.send(P.Shutdown(reason="bye"), to=env.peer)
        assert cli.recv(WAIT_S).msg == P.Shutdown(reason="bye")
        # the handshake outcome is counted from zmq's monitor events, which may trail the first messages
        deadline = time.monotonic() + WAIT_S
        while not srv.stats.auth_counts() and time.monotonic() < deadline:
            time.sleep(0.01)
        assert srv.stats.auth_counts() == {"accepted": 1}
        metrics = srv.stats.as_metrics("transport/control")
        assert metrics["transport/control/auth/accepted"] == 1.0 and metrics["transport/control/auth/denied"] == 0.0


def test_unknown_key_and_plain_client_get_nothing_and_the_server_counts_both(keys):
    with ZmqChannel.bind(zmq.ROUTER, "tcp://127.0.0.1:0", curve=load_server_keys(keys), reply_errors=True) as srv, \
            ZmqChannel.connect(zmq.DEALER, srv.address, curve=load_client_keys(keys, "stranger")) as stranger, \
            ZmqChannel.connect(zmq.DEALER, srv.address) as plain:
        before = auth_metrics().get("transport/auth/denied", 0.0)
        for ch in (stranger, plain):
            try_send(ch)  # queued on their side: the handshake never completes
            try_send(ch, frames=[b"\xc1garbage"])
        assert wait_for(lambda: srv.stats.auth["unknown_key"] >= 1 and plain_denials(srv) >= 1)
        assert stranger.recv(0.15) is None and plain.recv(0.15) is None
        assert srv.recv(0.1) is None
        assert srv.stats.received == 0 and srv.stats.rejected_total == 0  # nothing reached the decoder
        assert wait_for(lambda: stranger.stats.auth["refused"] >= 1)
        assert not plain.stats.secured and "auth" not in str(plain.stats.as_metrics("p"))
        metrics = srv.stats.as_metrics("transport/control")
        assert metrics["transport/control/auth/denied"] >= 2 and metrics["transport/control/auth/accepted"] == 0
        assert auth_metrics()["transport/auth/denied"] >= before + 3  # two server-side, one client-side


def test_client_holding_the_wrong_server_key_is_counted_as_bad_key(keys, tmp_path_factory):
    other = tmp_path_factory.mktemp("other-keys")
    generate_keys(other)
    impostor = CurveConfig(public_key=load_client_keys(keys, "client").public_key,
                           secret_key=load_client_keys(keys, "client").secret_key,
                           server_key=load_server_keys(other).public_key)
    with ZmqChannel.bind(zmq.ROUTER, "tcp://127.0.0.1:0", curve=load_server_keys(keys)) as srv, \
            ZmqChannel.connect(zmq.DEALER, srv.address, curve=impostor) as cli:
        try_send(cli)
        assert wait_for(lambda: srv.stats.auth["bad_key"] >= 1)
        assert srv.recv(0.2) is None


def test_curve_applies_to_push_pull_and_pub_sub(keys):
    server, client = load_server_keys(keys), load_client_keys(keys, "client")
    with ZmqChannel.bind(zmq.PULL, "tcp://127.0.0.1:0", curve=server) as pull, \
            ZmqChannel.connect(zmq.PUSH, pull.address, curve=client) as push, \
            ZmqChannel.connect(zmq.PUSH, pull.address, curve=load_client_keys(keys, "stranger")) as bad_push:
        try_send(bad_push, P.Shutdown(reason="stranger"))
        push.send(HB)
        assert pull.recv(WAIT_S).msg == HB
        assert wait_for(lambda: pull.stats.auth["unknown_key"] >= 1)
        assert pull.recv(0.2) is None
    with ZmqChannel.bind(zmq.PUB, "tcp://127.0.0.1:0", curve=server) as pub, \
            ZmqChannel.connect(zmq.SUB, pub.address, curve=client) as sub, \
            ZmqChannel.connect(zmq.SUB, pub.address) as plain_sub:
        got = None
        deadline = time.monotonic() + WAIT_S
        while got is None and time.monotonic() < deadline:  # PUB drops until the subscription arrives
            pub.send(HB, timeout_s=0.0)
            got = sub.recv(0.02)
        assert got is not None and got.msg == HB
        assert plain_sub.recv(0.1) is None
        assert wait_for(lambda: plain_denials(pub) >= 1)


def _publish_one(server: WeightServer) -> bytes:
    spec = P.TensorSpec(name="w", dtype="int8", shape=(4,), nbytes=4)
    ann = P.WeightAnnounce(version=1, fmt="int8", manifest=[spec], checksum="00", total_bytes=4)
    data = b"\x01\x02\x03\x04"
    server.publish(ann, [data])
    return data


def test_weight_fetch_over_curve_serves_an_allowed_key_and_not_an_unknown_one(keys):
    server = WeightServer(curve=load_server_keys(keys))
    try:
        data = _publish_one(server)
        good = WeightClient(server.announce_address, server.fetch_address, curve=load_client_keys(keys, "client"))
        bad = WeightClient(server.announce_address, server.fetch_address,
                           curve=load_client_keys(keys, "stranger"))
        plain = WeightClient(server.announce_address, server.fetch_address)
        try:
            ann, buffers = good.fetch(1, timeout_s=WAIT_S)
            assert ann.version == 1 and bytes(buffers[0]) == data
            for c in (bad, plain):
                with pytest.raises(WeightFetchError, match="timed out"):
                    c.fetch(1, timeout_s=0.15)
            assert server.fetches_served == 1
            assert wait_for(lambda: server.stats.auth["unknown_key"] >= 1 and plain_denials(server) >= 1)
            m = server.as_metrics()
            assert m["transport/weights/auth/denied"] >= 2 and m["transport/weights/fetches_served"] == 1.0
            assert "transport/weights/announce_auth/denied" in m
        finally:
            for c in (good, bad, plain):
                c.close()
    finally:
        server.close()


def test_a_key_added_or_revoked_at_run_time_takes_effect_on_the_next_connection(keys):
    with ZmqChannel.bind(zmq.ROUTER, "tcp://127.0.0.1:0", curve=load_server_keys(keys)) as srv:
        assert keys_main(["add", str(keys), "late"]) == 0
        with ZmqChannel.connect(zmq.DEALER, srv.address, curve=load_client_keys(keys, "late")) as late:
            late.send(HB)
            assert srv.recv(WAIT_S).msg == HB
        (keys / CLIENTS_DIR / "late.key").unlink()
        time.sleep(0.01)  # a distinct directory mtime on coarse-clock file systems
        with ZmqChannel.connect(zmq.DEALER, srv.address, curve=load_client_keys(keys, "late")) as revoked:
            try_send(revoked)
            assert wait_for(lambda: srv.stats.auth["unknown_key"] >= 1)
            assert srv.recv(0.2) is None


def test_raw_tcp_bytes_at_a_curve_socket_never_reach_the_decoder(keys):
    """On a plain socket libzmq frames signature-less bytes as ZMTP/1.0 messages; CURVE refuses them."""
    rng = np.random.default_rng(0)
    with ZmqChannel.bind(zmq.PULL, "tcp://127.0.0.1:0", curve=load_server_keys(keys)) as pull, \
            ZmqChannel.connect(zmq.PUSH, pull.address, curve=load_client_keys(keys, "client")) as push:
        host, port = pull.address[len("tcp://"):].rsplit(":", 1)
        for _ in range(20):
            with socket.create_connection((host, int(port)), timeout=2.0) as s:
                s.sendall(rng.bytes(int(rng.integers(1, 2048))))
        push.send(HB)  # after the garbage: once it arrives, the garbage had its chance
        assert pull.recv(WAIT_S).msg == HB
        assert pull.recv(0.1) is None
        assert pull.stats.received == 1 and pull.stats.rejected_total == 0


def test_a_private_context_with_a_secured_channel_ends_after_its_last_message_left(keys):
    # its ZAP thread and monitor sockets would keep the context alive: end_context stops them first
    with ZmqChannel.bind(zmq.ROUTER, "tcp://127.0.0.1:0", curve=load_server_keys(keys)) as srv:
        ctx = private_context()
        cli = ZmqChannel.connect(zmq.DEALER, srv.address, curve=load_client_keys(keys), context=ctx)
        cli.send(HB)
        cli.close(linger_s=60.0)
        end_context(ctx)
        env = srv.recv(30.0)
        assert env is not None and env.msg == HB
