"""``rollout.decode_step`` / ``cuda_graphs`` / ``compile`` / ``prewarm`` from the config to a worker's engine.

The run's config checks them, the launcher hands them to each native worker's command line, and a real
worker process (``python -m workers.generator``, driven by the controller stand-in over loopback ZeroMQ)
builds its engine with them: one serves a group on the eager step, one with ``cuda_graphs=true`` on a CPU
leaves at once naming the fix.
"""

from __future__ import annotations

import subprocess
import time
from pathlib import Path

import numpy as np
import pytest

import protocols as P
from asyncrl.config.loader import load_train_config
from tests.integration.standin import worker_standin
from workers.launcher import Launcher

GROUP = 4


def test_config_checks_the_decode_options_and_the_launcher_passes_them_on(tmp_path: Path):
    cfg = load_train_config(["rollout.device=cpu", "rollout.decode_step=eager", "rollout.cuda_graphs=false",
                             "rollout.compile=true"])
    assert (cfg.rollout.decode_step, cfg.rollout.cuda_graphs, cfg.rollout.compile) == ("eager", "false", "true")
    launcher = Launcher(cfg, tmp_path, tmp_path)
    launcher.address = "tcp://127.0.0.1:5555"
    args = launcher.worker_args("w")
    assert {"rollout.decode_step=eager", "rollout.cuda_graphs=false", "rollout.compile=true"} <= set(args)
    assert load_train_config([]).rollout.cuda_graphs == "auto"
    with pytest.raises(ValueError, match="rollout.cuda_graphs=auto"):
        load_train_config(["rollout.device=cpu", "rollout.cuda_graphs=true"])
    with pytest.raises(ValueError, match="rollout.decode_step"):
        load_train_config(["rollout.decode_step=fastest"])
    default = load_train_config([]).rollout
    assert default.prewarm == default.compile == default.overlap == "auto"
    with pytest.raises(ValueError, match="rollout.overlap"):
        load_train_config(["rollout.overlap=later"])
    with pytest.raises(ValueError, match="rollout.compile"):
        load_train_config(["rollout.compile=sometimes"])
    assert load_train_config(["rollout.prewarm=true"]).rollout.prewarm == "true"  # Hydra's bool, as the word
    with pytest.raises(ValueError, match="rollout.prewarm"):
        load_train_config(["rollout.prewarm=early"])


def _serve_one_group(procs, stand, err_path, *worker_args: str) -> subprocess.Popen:
    # stderr to a file, not a pipe nobody reads while the worker runs (a full pipe would block its logging)
    with open(err_path, "wb") as err:
        worker = procs.python("-m", "workers.generator", f"controller={stand.ctl.address}", "worker_id=w",
                              *worker_args, stderr=err)
    prompt = P.Array.from_numpy(np.array([1, 55, 47, 56, 65], np.int32))
    params = P.SamplingParams(temperature=1.0, max_new_tokens=8, seed=3)
    got: dict[str, P.FinishedSample] = {}
    assigned = False
    peer = None  # this worker's; a request still queued from an earlier worker (gone now) is not answered
    deadline = time.monotonic() + 120
    while worker.poll() is None and len(got) < GROUP and time.monotonic() < deadline:
        env = stand.ctl.recv(0.02)
        if env is not None and isinstance(env.msg, P.Hello):
            peer = env.peer
            stand.welcome(env)
        elif env is not None and isinstance(env.msg, P.WorkRequest) and env.peer == peer:
            if not assigned:
                stand.ctl.send(P.RolloutAssignment(group_id="g", sample_ids=[f"g/{i}" for i in range(GROUP)],
                                                   prompt_ids=prompt, params=params, n_samples=GROUP), to=env.peer)
                assigned = True
            else:
                stand.ctl.send(P.NoWork(retry_after_s=0.05), to=env.peer)
        while (s := stand.pull.recv(0.0)) is not None:
            got[s.msg.sample_id] = s.msg
    return worker, got


def test_a_worker_runs_the_decode_step_it_is_given_and_refuses_cuda_graphs_on_a_cpu(procs, tmp_path):
    with worker_standin(tmp_path, worker_slots=GROUP) as stand:
        worker, got = _serve_one_group(procs, stand, tmp_path / "ok.err", "rollout.device=cpu", "rollout.decode_step=eager",
                                       "rollout.cuda_graphs=false", "rollout.compile=false")
        assert sorted(got) == [f"g/{i}" for i in range(GROUP)]
        assert all(len(fs.behav_logp.to_numpy()) == 8 for fs in got.values())
        worker.send_signal(15)
        assert worker.wait(timeout=60) == 0
        bad, got = _serve_one_group(procs, stand, tmp_path / "bad.err", "rollout.device=cpu", "rollout.cuda_graphs=true")
        bad.wait(timeout=60)
        text = (tmp_path / "bad.err").read_text(errors="replace")
        assert bad.returncode == 1 and not got, text[-2000:]
        assert "cuda_graphs=true needs a CUDA device" in text, text[-2000:]
