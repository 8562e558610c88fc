"""What the launcher checks before any process starts, what it prints when a child dies, and where
relative paths point (the caller's folder, not the repository)."""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest

from asyncrl.config.loader import load_train_config
from asyncrl.config.paths import resolve_paths
from asyncrl.config.schema import config_warnings
from workers.launcher import Launcher, run_train


@pytest.mark.parametrize("override,message", [
    ("learner.micro_batch_size=0", "learner.micro_batch_size=0 must be an int >= 1"),
    ("log.rotate_mb=0", "log.rotate_mb=0 must be >= 1"),
])
def test_settings_that_would_crash_a_child_are_refused_by_validate(override, message):
    with pytest.raises(ValueError, match=message):
        load_train_config([override])


def test_kl_coef_is_not_refused():
    assert load_train_config(["algo.kl_coef=0.01"]).algo.kl_coef == 0.01


def test_an_encoder_model_folder_is_refused_before_any_process_starts(tmp_path):
    from transformers import BertConfig

    folder = tmp_path / "bert"
    BertConfig(num_hidden_layers=1, hidden_size=8, num_attention_heads=2, intermediate_size=16).save_pretrained(folder)
    (folder / "model.safetensors").write_bytes(b"")
    with pytest.raises(ValueError, match="'bert'"):
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


def test_a_controller_that_fails_as_the_learner_finishes_fails_the_run_and_is_reported(tmp_path, monkeypatch, capsys):
    """The learner exits 0, the controller 1 (its log lost after the last batch): no summary of that run."""
    from workers.launcher import _run_ended

    run_dir = tmp_path / "run"
    run_dir.mkdir()
    monkeypatch.chdir(tmp_path)
    launcher = Launcher(load_train_config([]), run_dir, tmp_path)
    launcher.learner = launcher.spawn("learner", [sys.executable, "-c", "pass"])
    launcher.controller = launcher.spawn("controller", [sys.executable, "-c", (
        "raise SystemExit('controller: trajectory log /r/trajectories/traj-000000.log was deleted or moved')")])
    assert launcher.learner.proc.wait(timeout=60) == 0
    assert _run_ended(launcher) == 1
    out = capsys.readouterr().out
    assert "controller failed (exit 1): controller: trajectory log /r/trajectories/traj-000000.log was deleted" in out
    launcher.close()


def _jsonl(path, answers):
    import json

    path.write_text("".join(json.dumps({"prompt": f"q{i}", "answer": a}) + "\n" for i, a in enumerate(answers)))
    return path


def test_the_warm_start_cache_is_keyed_by_the_dataset_file(tmp_path):
    from asyncrl.models.prepare import task_fingerprint

    a, b = _jsonl(tmp_path / "a.jsonl", ["1", "2", "3"]), _jsonl(tmp_path / "b.jsonl", ["4", "5", "6"])
    fa = task_fingerprint(load_train_config(["task.name=jsonl_math", f"task.path={a}"]))
    fb = task_fingerprint(load_train_config(["task.name=jsonl_math", f"task.path={b}"]))
    assert fa != fb and fa == task_fingerprint(load_train_config(["task.name=jsonl_math", f"task.path={a}"]))
    _jsonl(a, ["1", "2", "7"])  # the same path, edited
    assert task_fingerprint(load_train_config(["task.name=jsonl_math", f"task.path={a}"])) != fa


def test_reference_answers_the_verifier_cannot_parse_are_warned_about_and_counted(tmp_path):
    from asyncrl.models.prepare import check_task

    path = _jsonl(tmp_path / "d.jsonl", ["4", "\\frac{", "12", "7", "}}{{"])
    said = []
    n = check_task(load_train_config(["task.name=jsonl_math", f"task.path={path}", "task.eval_size=1"]),
                   log=said.append)
    assert n == 2 and "2 reference answers cannot be parsed" in said[0]


def test_a_non_utf8_line_is_reported_by_its_line_number(tmp_path):
    from asyncrl.tasks.jsonl_math import load_jsonl_problems

    path = tmp_path / "bad.jsonl"
    path.write_bytes(b'{"prompt": "a", "answer": "1"}\n{"prompt": "b", "answer": "2"}\n{"prompt": "\xff\xfe", "answer": "3"}\n')
    with pytest.raises(ValueError, match=r"bad.jsonl:3 is not UTF-8"):
        load_jsonl_problems(path)
