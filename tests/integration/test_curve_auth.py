"""CURVE across real processes: an allow-listed client is served on every socket kind; a client with
an unknown key and a plain client get nothing and are counted; a non-loopback bind without keys
refuses to start (the peer script and the real controller)."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from asyncrl.transport import generate_keys
from asyncrl.transport.keys import CLIENTS_DIR

pytestmark = pytest.mark.integration
PEER = os.path.join(os.path.dirname(__file__), "curve_peer.py")


@pytest.fixture
def keys(tmp_path):
    d = tmp_path / "keys"
    generate_keys(d, ["server", "worker", "stranger"])
    (d / CLIENTS_DIR / "stranger.key").unlink()  # a well-formed key pair the server does not know
    return d


def test_only_the_allow_listed_process_is_served_and_the_others_are_counted(procs, keys, tmp_path):
    out = tmp_path / "server.json"
    server = procs.python(PEER, "server", str(keys), str(out), stdout=subprocess.PIPE)
    addrs = tmp_path / "addrs.json"
    addrs.write_text(server.stdout.readline().decode())
    clients = {
        "worker": procs.python(PEER, "client", str(addrs), str(keys), "worker", stdout=subprocess.PIPE),
        "stranger": procs.python(PEER, "client", str(addrs), str(keys), "stranger", stdout=subprocess.PIPE),
        "plain": procs.python(PEER, "client", str(addrs), stdout=subprocess.PIPE),
    }
    results = {}
    for who, proc in clients.items():
        stdout, _ = proc.communicate(timeout=200)  # a hang guard above the client's own (curve_peer.WAIT_S)
        assert proc.returncode == 0, who
        results[who] = json.loads(stdout.decode().strip().splitlines()[-1])
    assert results["worker"]["hello_echoed"] and results["worker"]["weights"]
    for who in ("stranger", "plain"):
        assert not results[who]["hello_echoed"] and not results[who]["weights"], results[who]
    assert results["stranger"]["refused"] >= 1  # the client side learns why it got nothing
    assert "refused this client's CURVE key" in results["stranger"]["fetch_error"]

    server.terminate()
    assert server.wait(timeout=30) == 0
    final = json.loads(out.read_text())
    assert final["samples_from"] == ["worker"] and final["fetches_served"] == 1
    for sock in ("control", "samples", "weights"):
        assert final[f"transport/{sock}/auth/denied/unknown_key"] >= 1, sock
        denied = f"transport/{sock}/auth/denied"
        plain = final.get(f"{denied}/no_curve", 0) + final.get(f"{denied}/aborted", 0)
        assert plain >= 1, sock  # which side notices the mechanism mismatch first is a race
        assert final[f"transport/{sock}/rejected"] == 0  # no stranger's byte reached a decoder
    assert final["transport/control/auth/accepted"] == 1 and final["transport/samples/auth/accepted"] == 1
    assert final["transport/auth/denied"] >= 6


def test_non_loopback_bind_refuses_without_keys_and_binds_with_them(procs, keys):
    refused = procs.python(PEER, "bind", "0.0.0.0", stderr=subprocess.PIPE)
    _, err = refused.communicate(timeout=60)
    assert refused.returncode == 2
    assert b"asyncrl keys generate DIR" in err and b"transport.insecure=true" in err
    bound = procs.python(PEER, "bind", "0.0.0.0", str(keys), stdout=subprocess.PIPE)
    stdout, _ = bound.communicate(timeout=60)
    assert bound.returncode == 0 and stdout.startswith(b"tcp://0.0.0.0:")


def test_controller_refuses_a_non_loopback_host_without_keys(procs, tmp_path):
    from asyncrl.config.loader import load_train_config, save_config

    run = tmp_path / "run"
    run.mkdir()
    save_config(load_train_config(["transport.host=0.0.0.0", f"runs_dir={tmp_path}"]), run / "config.json")
    ctl = procs.spawn([sys.executable, "-m", "workers.controller", "--run-dir", str(run), "--model-dir",
                       str(tmp_path / "no-model")], stderr=subprocess.PIPE)
    _, err = ctl.communicate(timeout=120)
    assert ctl.returncode != 0
    assert b"transport.insecure=true" in err and b"asyncrl keys generate" in err
    assert not (run / "controller.json").exists()
