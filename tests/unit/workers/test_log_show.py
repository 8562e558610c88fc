"""``asyncrl log show``: decoded prompts and completions, rewards, versions, by step or the last N."""

from __future__ import annotations

import numpy as np
import pytest

from asyncrl.log import BatchRecord, SampleRecord, TrajectoryLogWriter
from asyncrl.models.tiny import build_tiny_tokenizer
from protocols import Array, FinishedSample
from workers.cli import main as cli


@pytest.fixture(scope="module")
def tok_dir(tmp_path_factory):
    folder = tmp_path_factory.mktemp("tok")
    build_tiny_tokenizer().save_pretrained(folder)
    return folder


def write_run(run, tok):
    def rec(gid, k, prompt, response, reward, version):
        ids = tok(response, add_special_tokens=False)["input_ids"] + [tok.eos_token_id]
        fs = FinishedSample(sample_id=f"{gid}/{k}", group_id=gid,
                            prompt_ids=Array.from_numpy(np.asarray(tok(prompt)["input_ids"], np.int32)),
                            response_ids=Array.from_numpy(np.asarray(ids, np.int32)),
                            behav_logp=Array.from_numpy(np.full(len(ids), -0.5, np.float32)),
                            versions=Array.from_numpy(np.asarray([version] * (len(ids) - 1) + [version + 1],
                                                                 np.int32)),
                            finish_reason="stop", worker_id="w0")
        return SampleRecord(sample=fs, reward=reward, advantage=reward - 0.5, admitted_version=version)

    with TrajectoryLogWriter(run / "trajectories", config={}, run_name="t", fsync="never") as w:
        w.append(rec("g0", 0, "3+5=", "8", 1.0, 0))
        w.append(rec("g0", 1, "3+5=", "9", 0.0, 0))
        w.append(BatchRecord(step=0, sample_ids=["g0/0", "g0/1"]))
        w.append(rec("g1", 0, "2+2=", "4", 1.0, 1))


def test_log_show_prints_decoded_prompts_completions_rewards_and_versions(tmp_path, tok_dir, capsys):
    from transformers import AutoTokenizer

    write_run(tmp_path, AutoTokenizer.from_pretrained(str(tok_dir)))
    assert cli(["log", "show", str(tmp_path), "--step", "0", "--tokenizer", str(tok_dir)]) == 0
    out = capsys.readouterr().out
    assert "=== group g0" in out and "  | <bos>3+5=" in out
    assert "--- g0/0  reward 1.000  advantage +0.500  stop  2 tokens  v0..v1  step 0" in out
    assert "  > 8<eos>" in out and "  > 9<eos>" in out and "2+2=" not in out
    assert cli(["log", "show", str(tmp_path), "--last", "1", "--tokenizer", str(tok_dir)]) == 0
    out = capsys.readouterr().out
    assert "2+2=" in out and "not consumed yet" in out and "3+5=" not in out


def test_log_show_names_the_steps_there_are(tmp_path, tok_dir, capsys):
    from transformers import AutoTokenizer

    write_run(tmp_path, AutoTokenizer.from_pretrained(str(tok_dir)))
    assert cli(["log", "show", str(tmp_path), "--step", "7", "--tokenizer", str(tok_dir)]) == 2
    assert "no batch for learner step 7 in this log (steps logged: 0..0)" in capsys.readouterr().err


@pytest.mark.parametrize("last", ["0", "-3"])
def test_log_show_refuses_a_last_that_is_not_a_positive_count(tmp_path, tok_dir, capsys, last):
    from transformers import AutoTokenizer

    write_run(tmp_path, AutoTokenizer.from_pretrained(str(tok_dir)))
    assert cli(["log", "show", str(tmp_path), "--last", last, "--tokenizer", str(tok_dir)]) == 2
    assert f"--last {last}: N is how many samples to show and must be >= 1" in capsys.readouterr().err


def test_log_show_finds_the_model_folder_of_a_default_tiny_run(tmp_path, capsys):
    """A run with the warm-started tiny model: ``log show`` finds its tokenizer through the run's config
    alone, in the folder ``prepare_model`` built (one function names it for both)."""
    from transformers import AutoTokenizer

    from asyncrl.config.loader import load_train_config, save_config
    from asyncrl.config.paths import resolve_paths
    from asyncrl.models.prepare import model_folder, prepare_model

    cfg = load_train_config([f"model.cache_dir={tmp_path / 'cache'}", "model.warmstart_steps=1"])
    resolve_paths(cfg)
    built = prepare_model(cfg, log=lambda m: None)
    assert model_folder(cfg) == built
    run = tmp_path / "run"
    run.mkdir()
    save_config(cfg, run / "config.json")
    write_run(run, AutoTokenizer.from_pretrained(str(built)))
    assert cli(["log", "show", str(run), "--last", "1"]) == 0
    assert "2+2=" in capsys.readouterr().out
