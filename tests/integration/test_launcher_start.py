"""A controller that refuses to start (here: a resume whose log has no controller state to be cut back
to) ends ``asyncrl train`` with one line, its reason and log file: no traceback, no "resume with" hint
that would fail the same way. Real processes: the launcher starts the real controller."""

from __future__ import annotations

import os

import pytest

from asyncrl.config.loader import load_train_config, save_config
from asyncrl.config.paths import resolve_paths
from asyncrl.rundir import RunDir
from asyncrl.rundir.lock import acquire_run_lock
from workers.launcher import _train

pytestmark = pytest.mark.integration


def test_a_controller_that_refuses_a_resume_ends_the_launcher_in_one_line(tmp_path, capsys):
    run = tmp_path / "run"
    paths = RunDir(run)
    paths.trajectories.mkdir(parents=True)
    (paths.trajectories / "traj-000000.log").write_bytes(b"not a log")  # a log, and no controller state
    cfg = load_train_config(["rollout.num_workers=0"])
    resolve_paths(cfg, tmp_path)
    cfg.resume = str(run)
    save_config(cfg, paths.config)
    fd = acquire_run_lock(run)
    try:
        rc = _train(cfg, run, tmp_path, fd)
    finally:
        os.close(fd)
    out = capsys.readouterr().out
    assert rc == 1
    assert "controller did not start: controller failed (exit 1): controller: resume:" in out, out
    assert "no usable controller state to cut it back to" in out and f"[log: {paths.log_of('controller')}]" in out
    assert "Traceback" not in out and "resume with" not in out, out
