"""A resume keeps the run's configuration but applies the overrides it must accept: ``log.salvage`` (what
a damaged log's error recommends) and the ones that only say where the run's files are now
(``task.path``, ``task.eval_path``, ``model.path``); every other override is ignored as before. A
finished run is not resumed and its folder is left as it is. Every stored path is absolute."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from asyncrl.config.loader import load_train_config, save_config
from asyncrl.config.paths import resolve_paths
from workers.cli import main as cli
from workers.run_config import RunFinished, read_run_config, resume_config


def _jsonl(path: Path, n: int = 8) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(json.dumps({"prompt": f"{i}+1=", "answer": str(i + 1)}) + "\n" for i in range(n)))
    return path


def _run(tmp_path: Path, *overrides: str) -> Path:
    cfg = load_train_config(list(overrides))
    resolve_paths(cfg, tmp_path)
    run = tmp_path / "runs" / "r"
    run.mkdir(parents=True)
    save_config(cfg, run / "config.json")
    return run


def test_the_salvage_a_damaged_log_asks_for_is_applied_and_other_overrides_are_ignored(tmp_path):
    run = _run(tmp_path)
    said: list[str] = []
    cfg = resume_config(run, [f"resume={run}", "log.salvage=true", "learner.lr=0.5"], say=said.append)
    assert cfg.log.salvage and cfg.learner.lr == read_run_config(run).learner.lr
    assert cfg.resume == str(run.resolve())
    assert "resume keeps the run's configuration; ignoring ['learner.lr=0.5']" in said[0]
    assert any("resume with log.salvage=True" in s for s in said)


def test_a_moved_dataset_file_is_accepted_and_other_data_refused(tmp_path):
    train, held = _jsonl(tmp_path / "data" / "train.jsonl"), _jsonl(tmp_path / "data" / "eval.jsonl", 4)
    run = _run(tmp_path, "task.name=jsonl_math", "task.path=data/train.jsonl", "task.eval_path=data/eval.jsonl")
    stored = read_run_config(run).task
    assert stored.path == str(train) and stored.eval_path == str(held)  # both stored absolute
    moved = tmp_path / "elsewhere"
    moved.mkdir()
    shutil.move(train, moved / "train.jsonl")
    shutil.copy(held, moved / "eval.jsonl")  # a byte-identical copy while the original is still there
    cfg = resume_config(run, [f"task.path={moved / 'train.jsonl'}", f"task.eval_path={moved / 'eval.jsonl'}"],
                        say=lambda m: None)
    assert (cfg.task.path, cfg.task.eval_path) == (str(moved / "train.jsonl"), str(moved / "eval.jsonl"))
    _jsonl(moved / "other.jsonl", 5)
    with pytest.raises(ValueError, match="is still there and holds other data"):
        resume_config(run, [f"task.eval_path={moved / 'other.jsonl'}"], say=lambda m: None)
    with pytest.raises(ValueError, match="does not exist; point it at the run's moved file"):
        resume_config(run, [f"task.path={tmp_path / 'nowhere.jsonl'}"], say=lambda m: None)


def test_a_relative_override_is_stored_absolute(tmp_path, monkeypatch):
    _jsonl(tmp_path / "data" / "train.jsonl")
    run = _run(tmp_path, "task.name=jsonl_math", "task.path=data/train.jsonl")
    monkeypatch.chdir(tmp_path)
    shutil.move("data", "moved")
    cfg = resume_config(run, ["task.path=moved/train.jsonl"], say=lambda m: None)
    assert cfg.task.path == str(tmp_path / "moved" / "train.jsonl")


def _model(folder: Path) -> Path:
    folder.mkdir(parents=True)
    (folder / "config.json").write_text(json.dumps({"model_type": "qwen2"}))
    return folder


def test_a_moved_model_folder_is_accepted_only_when_it_moved(tmp_path):
    old = _model(tmp_path / "models" / "m")
    run = _run(tmp_path, "model.name=path", f"model.path={old}")
    other = _model(tmp_path / "copy" / "m")
    with pytest.raises(ValueError, match="the run's model folder .* is still there"):
        resume_config(run, [f"model.path={other}"], say=lambda m: None)
    shutil.rmtree(old)
    cfg = resume_config(run, [f"model.path={other}"], say=lambda m: None)
    assert cfg.model.path == str(other)
    renamed = _model(tmp_path / "copy" / "n")
    with pytest.raises(ValueError, match="keep the folder name 'm'"):
        resume_config(run, [f"model.path={renamed}"], say=lambda m: None)
    with pytest.raises(ValueError, match="holds no model"):
        resume_config(run, [f"model.path={tmp_path}"], say=lambda m: None)


def test_a_finished_run_is_not_resumed_and_its_folder_is_untouched(tmp_path, capsys):
    run = _run(tmp_path)
    (run / "learner_final.json").write_text(json.dumps({"version": 12}))
    before = {p.name: p.read_bytes() for p in run.iterdir()}
    with pytest.raises(RunFinished):
        resume_config(run, [])
    for command in ("train", "controller"):
        assert cli([command, f"resume={run}", "log.salvage=true"]) == 0
        out = capsys.readouterr().out
        assert f"{run.resolve()} already finished (learner version 12" in out and "nothing was changed" in out
    assert {p.name: p.read_bytes() for p in run.iterdir()} == before  # not even a lock file


def test_a_resume_of_a_folder_that_is_not_a_run_says_so(tmp_path, capsys):
    assert cli(["train", f"resume={tmp_path / 'missing'}"]) == 2
    assert "is not an asyncrl run folder (no config.json); pass resume=runs/<name>" in capsys.readouterr().err


def test_a_replay_names_a_moved_evaluation_file_before_anything_starts(tmp_path, capsys):
    _jsonl(tmp_path / "data" / "train.jsonl")
    held = _jsonl(tmp_path / "data" / "eval.jsonl", 4)
    run = _run(tmp_path, "task.name=jsonl_math", "task.path=data/train.jsonl", "task.eval_path=data/eval.jsonl",
               "model.warmstart_steps=0", f"model.cache_dir={tmp_path / 'cache'}")
    held.rename(tmp_path / "eval-moved.jsonl")
    assert cli(["replay", f"run={run}"]) == 2
    err = capsys.readouterr().err
    assert f"dataset file {str(held)!r} does not exist" in err and "task.eval_path=" in err, err
    assert sorted(p.name for p in run.parent.iterdir()) == ["r"]  # no replay folder
