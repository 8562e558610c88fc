"""The one-machine launcher's cluster pieces: GPU placement, published formats, worker command lines."""

from __future__ import annotations

from pathlib import Path

import pytest

from asyncrl.config.loader import load_train_config
from workers.gpus import gpu_plan
from workers.launcher import Launcher
from workers.prepare import publish_formats


def _cfg(*overrides: str):
    return load_train_config(list(overrides))


def test_learner_takes_the_first_gpus_and_each_worker_gets_its_own_from_the_rest():
    cfg = _cfg("learner.world_size=2", "rollout.num_workers=3")
    learner, workers = gpu_plan(["0", "1", "2", "3", "4"], cfg)
    assert learner == "0,1" and workers == ["2", "3", "4"]
    learner, workers = gpu_plan(["4", "5", "6"], _cfg("learner.world_size=2", "rollout.num_workers=3"))
    assert learner == "4,5" and workers == ["6", "6", "6"]  # one GPU left: the workers share it


def test_with_no_gpu_to_spare_everyone_shares_and_without_gpus_nothing_is_set():
    cfg = _cfg("learner.world_size=2", "rollout.num_workers=3")
    assert gpu_plan(["0", "1"], cfg) == (None, ["0", "1", "0"])
    assert gpu_plan([], cfg) == (None, [None, None, None])


def test_cpu_or_pinned_workers_get_no_cuda_visible_devices():
    assert gpu_plan(["0", "1", "2"], _cfg("rollout.device=cpu"))[1] == [None, None]
    assert gpu_plan(["0", "1", "2"], _cfg("rollout.device=cuda:1"))[1] == [None, None]
    assert gpu_plan(["0", "1", "2"], _cfg("learner.device=cpu"))[0] is None


def test_sglang_runs_publish_the_full_precision_format_its_workers_fetch():
    assert publish_formats(_cfg("quant.fmt=int8", "quant.extra_formats=[fp32]")) == ["int8", "fp32"]
    assert publish_formats(_cfg("rollout.engine=sglang", "quant.fmt=fp32")) == ["fp32"]
    assert publish_formats(_cfg("rollout.engine=sglang", "quant.fmt=fp8")) == ["fp8", "bf16"]


def test_worker_command_carries_the_runs_engine_device_and_sglang_settings(tmp_path: Path):
    cfg = _cfg("rollout.engine=sglang", "quant.fmt=bf16", "sglang.python=/opt/sgl/bin/python",
               "sglang.extra_args=[--attention-backend,triton]", "rollout.num_workers=1", "sglang.url=http://h:1")
    launcher = Launcher(cfg, tmp_path, tmp_path)
    launcher.address = "tcp://127.0.0.1:5555"
    argv = launcher.worker_args("worker-0")
    assert argv[1:3] == ["-m", "workers.generator"]
    for item in ("controller=tcp://127.0.0.1:5555", "rollout.engine=sglang", "quant.fmt=", "sglang.url=http://h:1",
                 "sglang.python=/opt/sgl/bin/python", "sglang.extra_args=--attention-backend,triton"):
        assert item in argv
    native = Launcher(_cfg("rollout.device=cpu"), tmp_path, tmp_path)
    native.address = "tcp://127.0.0.1:5555"
    assert {"rollout.engine=native", "rollout.device=cpu"} <= set(native.worker_args("w"))


def test_cluster_settings_are_checked_before_any_process_starts():
    with pytest.raises(ValueError, match="cuda:N"):
        _cfg("rollout.device=gpu1")
    with pytest.raises(ValueError, match="quant.fmt=fp32"):
        _cfg("rollout.engine=sglang", "quant.fmt=int8")
    with pytest.raises(ValueError, match="rollout.num_workers=1"):
        _cfg("rollout.engine=sglang", "quant.fmt=fp32", "sglang.url=http://h:1", "rollout.num_workers=2")
    with pytest.raises(ValueError, match="learner.device"):
        _cfg("learner.device=tpu")


@pytest.mark.parametrize("command, phrases", [
    ("controller", ("docs/cluster.md", "asyncrl learner controller=", "asyncrl worker controller=", "filesystem")),
    ("learner", ("torchrun", "--rdzv-backend=c10d", "--nnodes=N", "controller=tcp://HOST:PORT", "run_dir=DIR")),
    ("worker", ("rollout.engine=native|sglang", "rollout.device=auto|cpu|cuda[:N]", "sglang.url=", "exits with status 1")),
])
def test_role_commands_document_the_cluster_path_in_their_help(command, phrases, capsys):
    from workers.cli import main

    with pytest.raises(SystemExit) as exit_:
        main([command, "--help"])
    assert exit_.value.code == 0
    text = " ".join(capsys.readouterr().out.split())
    for phrase in phrases:
        assert phrase in text, (command, phrase)


def test_slurm_example_is_valid_bash_and_uses_only_settings_the_role_commands_know():
    import re
    import subprocess

    from asyncrl.config.roles import LearnerRoleConfig, WorkerRoleConfig, role_keys

    path = Path(__file__).resolve().parents[3] / "examples" / "slurm" / "asyncrl.sbatch"
    assert subprocess.run(["bash", "-n", str(path)], capture_output=True).returncode == 0
    text = path.read_text()
    known = {"worker": set(role_keys(WorkerRoleConfig)), "learner": set(role_keys(LearnerRoleConfig))}
    for role, keys in known.items():
        m = re.search(rf"asyncrl {role} (.*?)(?:&&|&$|\n\s*\n)", text, re.S | re.M)
        assert m, role
        used = set(re.findall(r"(?<![\w-])([a-z_]+(?:\.[a-z_]+)?)=", m.group(1)))
        assert used and used <= keys, (role, used - keys)
    assert "asyncrl controller" in text and "--rdzv-backend=c10d" in text and "-m asyncrl learner" in text
