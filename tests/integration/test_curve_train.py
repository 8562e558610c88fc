"""CURVE end to end: an authorised worker trains; an unknown key and a plain client get nothing."""

from __future__ import annotations

import json
import subprocess
import time

import pytest

from asyncrl.transport import generate_keys

pytestmark = [pytest.mark.slow, pytest.mark.integration, pytest.mark.timeout(1200)]
STEPS = 40


def test_authorised_workers_train_while_unknown_and_plain_clients_are_refused_and_counted(tmp_path, procs):
    keys, stranger = tmp_path / "keys", tmp_path / "stranger"
    generate_keys(keys, names=("server", "client"))
    generate_keys(stranger, names=("server", "client"))  # a key pair the job never allow-listed
    # Enough steps that both intruders, started as soon as the controller listens (before the learner's
    # first step), are refused while the run goes on, on a machine that trains 5 steps a second too.
    proc = procs.python("-m", "asyncrl", "train", f"runs_dir={tmp_path}", "run_name=curve",
                        f"learner.total_steps={STEPS}", "learner.ckpt_every=0", "learner.eval_every=0",
                        "rollout.groups_per_step=4", f"transport.keys_dir={keys}",
                        stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    run_dir = tmp_path / "curve"
    while not (run_dir / "controller.json").exists():
        assert proc.poll() is None, proc.stdout.read().decode(errors="replace")[-3000:]
        time.sleep(0.1)
    address = json.loads((run_dir / "controller.json").read_text())["control"]
    # The stranger holds the real server public key (it is public) but its own client key pair.
    (stranger / "server.key").write_bytes((keys / "server.key").read_bytes())
    intruders = [
        procs.python("-m", "asyncrl", "worker", f"controller={address}", "worker_id=plain"),
        procs.python("-m", "asyncrl", "worker", f"controller={address}", "worker_id=unknown",
                     f"transport.keys_dir={stranger}"),
    ]
    out, _ = proc.communicate(timeout=600)
    assert proc.returncode == 0, out.decode(errors="replace")[-3000:]
    final = json.loads((run_dir / "controller_final.json").read_text())
    assert final["transport/control/auth/accepted"] >= 3  # two workers and the learner
    assert final["transport/control/auth/denied"] >= 2  # both intruders, at every retry
    joined = (run_dir / "logs" / "controller.log").read_text()
    assert "worker-0 joined" in joined and "plain joined" not in joined and "unknown joined" not in joined
    assert all(p.poll() is None or p.returncode != 0 for p in intruders)  # none got a Welcome
    assert json.loads((run_dir / "summary.json").read_text())["learner_steps"] == STEPS
