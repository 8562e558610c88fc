"""What the launcher checks before any process starts, what it prints when a child dies, and where
relative paths point (the caller's folder, not the repository)."""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest

from asyncrl.config import load_train_config
from asyncrl.config.schema import config_warnings
from workers.launcher import Launcher, resolve_paths, run_train


@pytest.mark.parametrize("override,message", [
    ("learner.micro_batch_size=0", "learner.micro_batch_size=0 must be >= 1"),
    ("log.rotate_mb=0", "log.rotate_mb=0 must be >= 1"),
])
def test_settings_that_would_crash_a_child_are_refused_by_validate(override, message):
    with pytest.raises(ValueError, match=message):
        load_train_config([override])


def test_kl_coef_is_not_refused():
    assert load_train_config(["algo.kl_coef=0.01"]).algo.kl_coef == 0.01


def test_a_gpt2_model_folder_is_refused_before_any_process_starts(tmp_path):
    from transformers import GPT2Config

    folder = tmp_path / "gpt2"
    GPT2Config(n_layer=1, n_embd=8, n_head=2).save_pretrained(folder)
    (folder / "model.safetensors").write_bytes(b"")
    with pytest.raises(ValueError, match="'gpt2' model; asyncrl trains Llama- and Qwen2-family"):
        run_train([f"runs_dir={tmp_path}/runs", "model.name=path", f"model.path={folder}"])
    assert not (tmp_path / "runs").exists()


def test_an_eta_far_beyond_what_the_run_can_use_warns():
    assert config_warnings(load_train_config(["rollout.eta=2"])) == []
    (w,) = config_warnings(load_train_config(["rollout.eta=1000"]))
    assert "rollout.eta=1000 is far beyond" in w


def test_relative_paths_resolve_against_the_callers_folder(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    cfg = load_train_config(["runs_dir=runs", "task.name=jsonl_math", "task.path=data/x.jsonl",
                             "model.cache_dir=cache"])
    resolve_paths(cfg)
    assert cfg.runs_dir == str(tmp_path / "runs") and cfg.task.path == str(tmp_path / "data/x.jsonl")
    assert cfg.model.cache_dir == str(tmp_path / "cache") and cfg.transport.keys_dir == ""


def test_a_child_that_dies_is_reported_in_one_line_naming_the_cause_and_its_log(tmp_path, monkeypatch):
    script = tmp_path / "rank.py"
    script.write_text("import sys\nprint('loading', flush=True)\n"
                      "raise ValueError('learner.micro_batch_size must be >= 1')\n")
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    monkeypatch.chdir(tmp_path)
    launcher = Launcher(load_train_config([]), run_dir, tmp_path)
    child = launcher.spawn("learner", [sys.executable, "-m", "torch.distributed.run", "--standalone",
                                       "--nproc_per_node=1", str(script)])
    assert child.proc.wait(timeout=300) != 0
    line = child.fatal_line()
    assert line.startswith("learner failed (exit 1): ValueError: learner.micro_batch_size must be >= 1")
    assert f"[log: {run_dir / 'logs' / 'learner.log'}]" in line and "\n" not in line
    launcher.stop()
    launcher.close()
    assert Path(os.getcwd()) == tmp_path
