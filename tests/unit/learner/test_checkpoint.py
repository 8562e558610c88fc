"""DCP checkpoints, the weights hash and the Hugging Face export at world size 1."""

from __future__ import annotations

import json

import pytest
import torch

from asyncrl.learner import (
    LRSchedule,
    StepConfig,
    TrainState,
    build_optimizer,
    build_scheduler,
    export_hf,
    latest_checkpoint,
    load_checkpoint,
    save_checkpoint,
    sha256_of_state_dict,
    shard_model,
    state_dict_sha256,
    train_step,
)

SCHED = LRSchedule(kind="cosine", warmup_steps=1, total_steps=10, min_lr_ratio=0.1)


def _state(tiny, info, seed, tie=False):
    model = shard_model(tiny.model(seed=seed, tie=tie), info)
    opt = build_optimizer(model, lr=1e-2, weight_decay=0.01)
    return TrainState(model=model, optimizer=opt, scheduler=build_scheduler(opt, SCHED))


def test_checkpoint_round_trip_restores_weights_optimizer_schedule_version_and_extra(
    tiny, dist_info, tmp_path
):
    cfg = StepConfig()
    a = _state(tiny, dist_info, seed=0)
    a.version = 1  # as if resumed once already: the saved version is whatever the state holds
    train_step(a, tiny.batch(4, seed=0, version=1), tiny.objective, cfg, dist_info)
    extra = {"cursor": 17, "queued": [1, 2]}
    path = save_checkpoint(tmp_path, a, dist_info, extra=extra)
    assert path.name == "step_00000002" and latest_checkpoint(tmp_path) == path
    assert json.loads((path / "learner.json").read_text())["version"] == 2

    b = _state(tiny, dist_info, seed=99)
    assert state_dict_sha256(b.model, dist_info) != state_dict_sha256(a.model, dist_info)
    got_extra = load_checkpoint(tmp_path, b, dist_info)
    assert got_extra == extra and b.version == 2
    assert state_dict_sha256(b.model, dist_info) == state_dict_sha256(a.model, dist_info)
    assert b.optimizer.param_groups[0]["lr"] == a.optimizer.param_groups[0]["lr"]

    # Same optimiser moments and schedule position: the next step is identical and makes version 3.
    ma = train_step(a, tiny.batch(4, seed=7, version=2), tiny.objective, cfg, dist_info)
    mb = train_step(b, tiny.batch(4, seed=7, version=2), tiny.objective, cfg, dist_info)
    assert b.version == 3 and ma["learner/lr"] == mb["learner/lr"]
    assert state_dict_sha256(b.model, dist_info) == state_dict_sha256(a.model, dist_info)


def test_latest_ignores_unfinished_saves_and_keep_last_prunes_old_ones(tiny, dist_info, tmp_path):
    s = _state(tiny, dist_info, seed=0)
    for v in (2, 3):
        s.version = v
        save_checkpoint(tmp_path, s, dist_info, keep_last=1)
    (tmp_path / "step_00000009.tmp").mkdir()
    assert sorted(p.name for p in tmp_path.glob("step_*")) == ["step_00000003", "step_00000009.tmp"]
    assert latest_checkpoint(tmp_path).name == "step_00000003"
    assert latest_checkpoint(tmp_path / "nowhere") is None
    with pytest.raises(ValueError, match="latest"):
        load_checkpoint(tmp_path / "nowhere", s, dist_info)
    with pytest.raises(ValueError, match="JSON"):
        save_checkpoint(tmp_path, s, dist_info, extra={"bad": object()})


def test_state_dict_sha256_matches_the_plain_model_and_changes_with_any_weight(tiny, dist_info):
    plain = tiny.model(seed=4)
    want = sha256_of_state_dict(plain.state_dict())
    sharded = shard_model(tiny.model(seed=4), dist_info)
    assert state_dict_sha256(sharded, dist_info) == want
    sd = plain.state_dict()
    sd["model.norm.weight"] = sd["model.norm.weight"].clone()
    sd["model.norm.weight"][0] += 1e-7
    assert sha256_of_state_dict(sd) != want


@pytest.mark.parametrize("tie", [False, True])
def test_export_hf_loads_with_transformers_and_gives_the_same_logits(tiny, dist_info, tmp_path, tie):
    from tokenizers import Tokenizer, models
    from transformers import AutoModelForCausalLM, PreTrainedTokenizerFast

    tok_dir = tmp_path / "tok"
    tok_dir.mkdir()
    vocab = {f"c{i}": i for i in range(tiny.vocab)}
    PreTrainedTokenizerFast(
        tokenizer_object=Tokenizer(models.WordLevel(vocab, unk_token="c0"))
    ).save_pretrained(tok_dir)

    s = _state(tiny, dist_info, seed=1, tie=tie)
    train_step(s, tiny.batch(3), tiny.objective, StepConfig(), dist_info)
    out = export_hf(s.model, tok_dir, tmp_path / "export", dist_info)
    assert (out / "tokenizer.json").exists() and (out / "model.safetensors").exists()

    loaded = AutoModelForCausalLM.from_pretrained(out).eval()
    assert type(loaded).__name__ == "Qwen2ForCausalLM" and loaded.config.tie_word_embeddings == tie
    ids = torch.tensor([[1, 5, 9, 2, 7]])
    with torch.no_grad():
        want = s.model(input_ids=ids).logits
        got = loaded(input_ids=ids).logits
    torch.testing.assert_close(got, want, rtol=0, atol=1e-6)
    assert PreTrainedTokenizerFast.from_pretrained(out).convert_tokens_to_ids("c5") == 5


def _flip(path, at=None):
    data = bytearray(path.read_bytes())
    i = len(data) // 2 if at is None else at
    data[i] ^= 0xFF
    path.write_bytes(bytes(data))


def test_a_flipped_byte_in_a_shard_is_refused_and_resume_falls_back_to_the_previous_good_checkpoint(
    tiny, dist_info, tmp_path
):
    from asyncrl.rundir.checkpoints import choose_resume_point
    from asyncrl.rundir.files import ChecksumError

    a = _state(tiny, dist_info, seed=0)
    save_checkpoint(tmp_path, a, dist_info)  # version 0
    train_step(a, tiny.batch(4, seed=0, version=0), tiny.objective, StepConfig(), dist_info)
    good = state_dict_sha256(a.model, dist_info)
    save_checkpoint(tmp_path, a, dist_info)  # version 1
    train_step(a, tiny.batch(4, seed=1, version=1), tiny.objective, StepConfig(), dist_info)
    newest = save_checkpoint(tmp_path, a, dist_info)  # version 2
    shard = max((newest / "dcp").glob("*.distcp"), key=lambda p: p.stat().st_size)
    _flip(shard)
    b = _state(tiny, dist_info, seed=5)
    with pytest.raises(ChecksumError, match="does not match its checksum"):
        load_checkpoint(newest, b, dist_info)
    point = choose_resume_point(tmp_path, controller_state=False)
    assert point.version == 1 and point.learner_dir.name == "step_00000001"
    assert any("version 2 is not usable" in n and shard.name in n for n in point.notes)
    load_checkpoint(point.learner_dir, b, dist_info)
    assert b.version == 1 and state_dict_sha256(b.model, dist_info) == good


FULL_DISK_SAVE = """
import sys, torch
from pathlib import Path
from transformers import Qwen2Config, Qwen2ForCausalLM
from asyncrl.learner import LRSchedule, TrainState, build_optimizer, build_scheduler, init_distributed, shard_model
from asyncrl.learner import save_checkpoint
from asyncrl.rundir.files import DiskFullError
torch.set_num_threads(1)
info = init_distributed()
cfg = Qwen2Config(vocab_size=37, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=2, max_position_embeddings=64)
model = shard_model(Qwen2ForCausalLM(cfg), info)
opt = build_optimizer(model, lr=1e-2, weight_decay=0.0)
state = TrainState(model=model, optimizer=opt, scheduler=build_scheduler(opt, LRSchedule(kind="constant")))
root = Path(sys.argv[1])
try:
    save_checkpoint(root, state, info)
except DiskFullError as e:
    print("error:", e)
print("left:", sorted(p.name for p in root.iterdir()))
"""


def test_a_checkpoint_save_on_a_really_full_disk_says_so_and_leaves_nothing_half_written(tmp_path):
    import os
    import shutil
    import subprocess
    import sys

    if not shutil.which("unshare") or subprocess.run(["unshare", "-Urm", "true"]).returncode != 0:
        pytest.skip("needs user namespaces (unshare -Urm) to mount a small tmpfs as a real full disk")
    repo = str(__import__("pathlib").Path(__file__).resolve().parents[3])
    (tmp_path / "save.py").write_text(FULL_DISK_SAVE)
    mnt = tmp_path / "mnt"
    mnt.mkdir()
    cmd = f"mount -t tmpfs -o size=128k tmpfs {mnt} && exec {sys.executable} {tmp_path / 'save.py'} {mnt}"
    env = {**os.environ, "PYTHONPATH": repo, "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "29533", "WORLD_SIZE": "1",
           "RANK": "0", "LOCAL_RANK": "0"}
    res = subprocess.run(["unshare", "-Urm", "sh", "-c", cmd], capture_output=True, text=True, env=env, cwd=repo)
    assert res.returncode == 0, res.stderr[-3000:]
    assert f"error: disk full at {mnt}/step_00000000.tmp" in res.stdout
    assert "left: []" in res.stdout  # no step_*.tmp, no latest
