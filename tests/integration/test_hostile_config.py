"""Settings a hostile or careless user gets wrong, with real processes: CURVE key files missing or readable by
others, a worker whose CURVE use differs from its controller's (both ways), and a run name outside ASCII
given without quotes. Each is refused with one line that names the fix, no traceback; a controller that
refuses a client keeps serving the others.
"""

from __future__ import annotations

import json
import os
import subprocess
import time
from pathlib import Path

import pytest

from asyncrl.transport import generate_keys
from tests.integration.runs import POLL_S, asyncrl

pytestmark = [pytest.mark.integration, pytest.mark.timeout(600)]


@pytest.fixture
def keys(tmp_path) -> Path:
    d = tmp_path / "keys"
    generate_keys(d, ["server", "client"])
    return d


def test_missing_keys_are_refused_before_anything_starts_naming_the_command_that_makes_them(procs, tmp_path):
    missing = tmp_path / "no-keys"
    ctl = asyncrl(procs, "controller", f"runs_dir={tmp_path / 'runs'}", f"transport.keys_dir={missing}", timeout=300)
    assert ctl.returncode == 2, ctl.stdout[-2000:]
    assert f"{missing}/server.key_secret not found" in ctl.stdout and "asyncrl keys generate" in ctl.stdout
    assert not (tmp_path / "runs").exists() or not any((tmp_path / "runs").iterdir())  # no run folder made
    wrk = asyncrl(procs, "worker", "controller=tcp://127.0.0.1:9", f"transport.keys_dir={missing}", timeout=300)
    assert wrk.returncode == 2 and f"{missing}/client.key_secret not found" in wrk.stdout, wrk.stdout[-2000:]
    for res in (ctl, wrk):
        assert "Traceback" not in res.stdout


def test_a_secret_key_readable_by_others_is_refused_naming_the_chmod(procs, tmp_path, keys):
    for name in ("server", "client"):
        (keys / f"{name}.key_secret").chmod(0o644)
    ctl = asyncrl(procs, "controller", f"runs_dir={tmp_path / 'runs'}", f"transport.keys_dir={keys}", timeout=300)
    assert ctl.returncode == 2, ctl.stdout[-2000:]
    assert f"{keys}/server.key_secret is readable by other users (mode 0644)" in ctl.stdout, ctl.stdout[-2000:]
    assert f"chmod 600 {keys}/server.key_secret" in ctl.stdout
    wrk = asyncrl(procs, "worker", "controller=tcp://127.0.0.1:9", f"transport.keys_dir={keys}", timeout=300)
    assert wrk.returncode == 2 and f"chmod 600 {keys}/client.key_secret" in wrk.stdout, wrk.stdout[-2000:]
    for res in (ctl, wrk):
        assert "Traceback" not in res.stdout


@pytest.mark.skipif(os.geteuid() == 0, reason="root reads a file whatever its mode, so mode 000 cannot be tested")
def test_an_unreadable_secret_key_is_refused_naming_the_owner(procs, tmp_path, keys):
    (keys / "client.key_secret").chmod(0o000)
    wrk = asyncrl(procs, "worker", "controller=tcp://127.0.0.1:9", f"transport.keys_dir={keys}", timeout=300)
    assert wrk.returncode == 2 and "cannot be read by this user" in wrk.stdout, wrk.stdout[-2000:]


class Controller:
    """``asyncrl controller`` on loopback, its output in a file; ``address`` once it listens."""

    def __init__(self, procs, tmp_path: Path, name: str, *overrides: str) -> None:
        self.log = tmp_path / f"{name}.log"
        with open(self.log, "wb") as out:
            self.proc = procs.python("-m", "asyncrl", "controller", f"runs_dir={tmp_path / 'runs'}",
                                     f"run_name={name}", f"model.cache_dir={tmp_path / 'cache'}", *overrides,
                                     stdout=out, stderr=subprocess.STDOUT)
        deadline = time.monotonic() + 300
        while time.monotonic() < deadline:
            found = [ln for ln in self.text().splitlines() if ln.startswith('{"control"')]
            if found:
                self.address = json.loads(found[0])["control"]
                return
            assert self.proc.poll() is None, self.text()[-3000:]
            time.sleep(POLL_S)
        raise AssertionError("the controller never printed its address:\n" + self.text()[-3000:])

    def text(self) -> str:
        return self.log.read_text(errors="replace")


def worker(procs, address: str, worker_id: str, *extra: str) -> subprocess.CompletedProcess:
    """A worker run to its end; the hang guard is longer than its own Hello timeout (120 s), and the
    assertions tell a refusal said at once from that timeout by its message."""
    return asyncrl(procs, "worker", f"controller={address}", f"worker_id={worker_id}", "rollout.device=cpu", *extra,
                   timeout=300)


@pytest.mark.slow  # two controllers and four clients: 20-40 s on the 2-core machine
def test_a_curve_worker_at_a_plain_controller_and_a_plain_worker_at_a_curve_controller_stop_saying_why(
        procs, tmp_path, keys):
    plain = Controller(procs, tmp_path, "plain")
    res = worker(procs, plain.address, "keyed", f"transport.keys_dir={keys}")
    assert res.returncode == 1, res.stdout[-3000:]
    assert "does not use CURVE keys, but this worker has transport.keys_dir" in res.stdout, res.stdout[-3000:]
    assert "no Welcome" not in res.stdout and "Traceback" not in res.stdout

    curve = Controller(procs, tmp_path, "curve", f"transport.keys_dir={keys}")
    res = worker(procs, curve.address, "keyless")
    assert res.returncode == 1, res.stdout[-3000:]
    assert "requires CURVE keys and this worker has none: start it with transport.keys_dir=DIR" in res.stdout, \
        res.stdout[-3000:]
    assert "no Welcome" not in res.stdout and "Traceback" not in res.stdout
    assert "without CURVE keys" in curve.text()  # the controller's side, in its log (it may see a hang-up only)

    # both controllers still answer a client that matches them: where their run is (what `asyncrl learner` asks)
    from workers.run_setup import ask_run_setup

    for ctl, keys_dir in ((plain, ""), (curve, str(keys))):
        assert Path(ask_run_setup(ctl.address, keys_dir=keys_dir, timeout_s=120).run_dir).name == ctl.log.stem
        assert ctl.proc.poll() is None


def test_a_run_name_outside_ascii_without_quotes_is_refused_with_the_quoting_that_works(procs, tmp_path):
    name = "试验-ü"
    res = asyncrl(procs, "train", f"runs_dir={tmp_path / 'runs'}", f"run_name={name}", timeout=300)
    assert res.returncode == 2, res.stdout[-2000:]
    assert f"run_name='{name}'" in res.stdout and "must be quoted" in res.stdout and "Traceback" not in res.stdout
    assert not (tmp_path / "runs").exists()
