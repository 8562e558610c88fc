"""How the launcher starts the learner and counts GPUs (no processes: the command lines and the count)."""

from __future__ import annotations

import sys

from workers.gpus import visible_gpus
from workers.launcher import learner_command


def test_one_rank_runs_alone_and_several_under_torchrun():
    one = learner_command(1, ["--run-dir", "R"])
    assert one == [sys.executable, "-u", "-m", "workers.learner", "--run-dir", "R"]
    two = learner_command(2, ["--run-dir", "R"])
    assert two[:4] == [sys.executable, "-m", "workers.torchrun", "--standalone"]  # torchrun with a clean stop
    assert "--nproc_per_node=2" in two and two[-4:] == ["-m", "workers.learner", "--run-dir", "R"]


def test_gpus_come_from_an_inherited_cuda_visible_devices(monkeypatch):
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "3, 5,")
    assert visible_gpus() == ["3", "5"]
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "")
    assert visible_gpus() == []


def test_without_the_variable_the_driver_counts_them_and_torch_is_never_imported(monkeypatch):
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    imported = "torch" in sys.modules
    gpus = visible_gpus()
    assert all(g.isdigit() for g in gpus)
    if not imported:
        assert "torch" not in sys.modules
