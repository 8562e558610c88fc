"""End-to-end runs of ``asyncrl train`` / ``replay`` / ``resume`` with real processes (marker ``slow``).

One short asynchronous run (controller, FSDP learner, two int8 workers) is shared by the tests of
this module; each test then checks one promise of the system against its run folder.
"""

from __future__ import annotations

import json
import re
import signal
import subprocess
import sys
from collections import Counter
from pathlib import Path

import numpy as np
import psutil
import pytest

from asyncrl.log import BatchRecord, SampleRecord, read_log
from asyncrl.metrics import read_metrics
from tests.integration.runs import asyncrl, wait_for_step

pytestmark = [pytest.mark.slow, pytest.mark.integration, pytest.mark.timeout(1200)]

ETA = 1
STEPS = 12
COMMON = ["learner.ckpt_every=4", "learner.eval_every=0", f"rollout.eta={ETA}", "rollout.groups_per_step=4",
          "rollout.dead_after_s=60"]
SHORT = [f"learner.total_steps={STEPS}", *COMMON]
INTERRUPTED_STEPS = 40
"""A run the test stops at step 6: far past it, so the stop always lands mid-run (see ``tests.integration.runs``)."""
INTERRUPTED = [f"learner.total_steps={INTERRUPTED_STEPS}", *COMMON]


@pytest.fixture(scope="module")
def short_run(tmp_path_factory):
    from tests.conftest import ProcessTracker

    runs = tmp_path_factory.mktemp("runs")
    tracker = ProcessTracker()
    try:
        res = asyncrl(tracker, "train", f"runs_dir={runs}", "run_name=short", *SHORT)
    finally:
        tracker.stop_all()
    assert res.returncode == 0, res.stdout[-4000:]
    return runs / "short", res.stdout


def _log(run_dir: Path):
    scan = read_log(run_dir / "trajectories")
    assert not scan.corruptions
    samples = [r for r in scan.records if isinstance(r, SampleRecord)]
    batches = [r for r in scan.records if isinstance(r, BatchRecord)]
    return samples, batches


def test_run_folder_holds_every_artifact(short_run):
    run_dir, out = short_run
    for name in ("config.json", "metrics.jsonl", "summary.json", "controller.json", "learner_final.json"):
        assert (run_dir / name).is_file(), name
    assert list((run_dir / "tb").glob("events.out.tfevents.*"))
    assert (run_dir / "model" / "config.json").is_file() and (run_dir / "model" / "model.safetensors").is_file()
    assert (run_dir / "checkpoints" / "latest").is_file()
    for png in (run_dir / "plots").glob("*.png"):
        assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert (run_dir / "plots" / "reward.png").is_file()
    summary = json.loads((run_dir / "summary.json").read_text())
    for key in ("final_train_reward", "eval_accuracy", "learner_steps", "wall_seconds", "max_consumed_staleness",
                "samples_logged", "state_dict_sha256"):
        assert key in summary
    assert summary["learner_steps"] == STEPS and summary["state_dict_sha256"] in out


def test_workers_take_each_version_as_a_delta_from_the_one_they_hold_and_the_run_logs_what_changed(short_run):
    run_dir, _ = short_run
    rows = read_metrics(run_dir)
    changed = [r["weights/int8/changed_frac"] for r in rows if "weights/int8/changed_frac" in r]
    assert changed and all(0.0 < c <= 1.0 for c in changed)
    assert all(r["weights/int8/delta_bytes"] < r["quant/int8/published_bytes"] for r in rows
               if "weights/int8/delta_bytes" in r)
    codes = [r["quant/int8/code_change_frac"] for r in rows if "weights/int8/delta_bytes" in r]  # from the delta
    assert codes and all(0.0 <= c < 1.0 for c in codes) and max(codes) > 0
    assert max(r.get("transport/weights/deltas_served", 0.0) for r in rows) > 0
    left = [line for w in ("worker-0.log", "worker-1.log") for line in (run_dir / "logs" / w).read_text().splitlines()
            if " left: " in line]
    assert left and any(re.search(r"\((\d+) as deltas\)", line) and int(re.search(
        r"\((\d+) as deltas\)", line).group(1)) > 0 for line in left)
    assert "could not apply the delta" not in "".join((run_dir / "logs" / w).read_text()
                                                     for w in ("worker-0.log", "worker-1.log"))


def test_no_consumed_token_is_staler_than_eta_and_every_sample_is_logged_once(short_run):
    run_dir, _ = short_run
    samples, batches = _log(run_dir)
    ids = Counter(r.sample.sample_id for r in samples)
    assert ids and max(ids.values()) == 1, [k for k, v in ids.items() if v > 1][:5]
    assert [b.step for b in batches] == list(range(STEPS))
    consumed = Counter(sid for b in batches for sid in b.sample_ids)
    assert max(consumed.values()) == 1 and set(consumed) <= set(ids)
    by_id = {r.sample.sample_id: r for r in samples}
    worst = 0
    for b in batches:
        for sid in b.sample_ids:
            v = by_id[sid].sample.versions.to_numpy()
            if v.size:
                worst = max(worst, b.step - int(v.min()))
                assert b.step - int(v.min()) <= ETA and b.step - int(v.max()) >= 0
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["max_consumed_staleness"] == worst


def test_replay_reproduces_the_final_weights_bit_for_bit(short_run, procs):
    """The learner consumed exactly the logged batches: retraining from the log alone gives the same hash."""
    run_dir, _ = short_run
    res = asyncrl(procs, "replay", f"run={run_dir}", "run_name=short-replay")
    assert res.returncode == 0, res.stdout[-4000:]
    original = json.loads((run_dir / "summary.json").read_text())["state_dict_sha256"]
    replayed = json.loads((run_dir.parent / "short-replay" / "summary.json").read_text())["state_dict_sha256"]
    assert replayed == original


def test_replay_at_world_size_two_gives_the_same_loss_curve(short_run, procs):
    run_dir, _ = short_run
    curves = {}
    for ws in (1, 2):
        name = f"short-ws{ws}"
        res = asyncrl(procs, "replay", f"run={run_dir}", f"run_name={name}", f"learner.world_size={ws}")
        assert res.returncode == 0, res.stdout[-4000:]
        lines = [json.loads(x) for x in (run_dir.parent / name / "metrics.jsonl").read_text().splitlines()]
        curves[ws] = [(r["step"], r["actor/pg_loss"]) for r in lines if r.get("actor/pg_loss") is not None]
    assert len(curves[1]) == STEPS
    assert [s for s, _ in curves[1]] == [s for s, _ in curves[2]]
    for (_, a), (_, b) in zip(curves[1], curves[2], strict=True):
        assert a == pytest.approx(b, abs=1e-6)


def test_counterfactual_replay_with_another_objective_writes_its_own_run(short_run, procs):
    run_dir, _ = short_run
    res = asyncrl(procs, "replay", f"run={run_dir}", "run_name=short-tbpo", "algo=tbpo")
    assert res.returncode == 0, res.stdout[-4000:]
    cfg = json.loads((run_dir.parent / "short-tbpo" / "config.json").read_text())
    assert cfg["algo"]["objective"] == "tbpo"
    lines = (run_dir.parent / "short-tbpo" / "metrics.jsonl").read_text().splitlines()
    assert any("tbpo/seq_masked_frac" in json.loads(x) for x in lines)


def test_replay_refuses_a_log_of_another_model(short_run, procs):
    run_dir, _ = short_run
    res = asyncrl(procs, "replay", f"run={run_dir}", "run_name=short-other", "model.warmstart_steps=151")
    assert res.returncode != 0
    assert res.returncode == 2 and "was written for model" in res.stdout


def test_replay_of_a_run_still_training_is_refused_unless_a_prefix_is_asked_for(short_run, procs):
    """While a live job holds the run folder (here: this test, as ``asyncrl train`` holds it), replay refuses;
    ``replay.allow_prefix=true`` replays the steps logged so far and says it is a prefix."""
    import os

    from asyncrl.rundir.lock import acquire_run_lock

    run_dir, _ = short_run
    fd = acquire_run_lock(run_dir)
    try:
        refused = asyncrl(procs, "replay", f"run={run_dir}", "run_name=short-live")
        prefix = asyncrl(procs, "replay", f"run={run_dir}", "run_name=short-prefix", "replay.allow_prefix=true")
    finally:
        os.close(fd)
    assert refused.returncode == 2, refused.stdout[-4000:]
    assert f"{run_dir} is still training (its run folder is held by PID {os.getpid()})" in refused.stdout
    assert "replay.allow_prefix=true" in refused.stdout and "Traceback" not in refused.stdout
    assert not (run_dir.parent / "short-live").exists()
    assert prefix.returncode == 0, prefix.stdout[-4000:]
    assert (f"replaying a prefix of {STEPS} steps of a run still training ({run_dir}, PID {os.getpid()})"
            in prefix.stdout), prefix.stdout[-4000:]
    summary = json.loads((run_dir.parent / "short-prefix" / "summary.json").read_text())
    assert summary["learner_steps"] == STEPS
    assert summary["state_dict_sha256"] == json.loads((run_dir / "summary.json").read_text())["state_dict_sha256"]


def _learner_rank_pids(root_pid: int) -> list[int]:
    pids = []
    for p in psutil.Process(root_pid).children(recursive=True):
        try:  # a child that has just exited (a zombie until reaped, or gone) has no command line to read
            cmd = " ".join(p.cmdline())
        except (psutil.ZombieProcess, psutil.NoSuchProcess):
            continue
        if "-m workers.learner" in cmd and "torchrun" not in cmd:
            pids.append(p.pid)
    return pids


def test_killed_learner_resumes_with_the_next_version_and_loses_no_group(tmp_path, procs):
    proc = procs.python("-m", "asyncrl", "train", f"runs_dir={tmp_path}", "run_name=crash", *INTERRUPTED,
                        stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    run_dir = tmp_path / "crash"
    wait_for_step(run_dir, 6, proc)
    for pid in _learner_rank_pids(proc.pid):  # fault injection: the learner dies without warning
        psutil.Process(pid).send_signal(signal.SIGKILL)
    out, _ = proc.communicate(timeout=120)
    assert proc.returncode != 0 and b"learner failed" in out
    ckpt = json.loads((run_dir / "checkpoints" / (run_dir / "checkpoints" / "latest").read_text() /
                       "learner.json").read_text())["version"]
    assert ckpt % 4 == 0 and 4 <= ckpt < INTERRUPTED_STEPS  # the newest checkpoint before the kill
    res = asyncrl(procs, "train", f"resume={run_dir}")
    assert res.returncode == 0, res.stdout[-4000:]
    samples, batches = _log(run_dir)
    assert [b.step for b in batches] == list(range(INTERRUPTED_STEPS))  # continued at the next version, nothing twice
    ids = Counter(r.sample.sample_id for r in samples)
    assert max(ids.values()) == 1
    consumed = Counter(sid for b in batches for sid in b.sample_ids)
    assert max(consumed.values()) == 1
    groups = Counter(sid.split("/")[0] for sid in consumed)
    assert set(groups.values()) == {8}  # every consumed group is whole
    events = [r for r in read_log(run_dir / "trajectories").records if getattr(r, "event", "") == "resume"]
    assert events and events[0].data["version"] == str(ckpt)
    assert json.loads((run_dir / "summary.json").read_text())["learner_steps"] == INTERRUPTED_STEPS


def test_aqn_resampled_at_every_forward_trains_end_to_end(tmp_path, procs):
    """quant=nvfp4_aqn_forward: clean gains published with (seed, sigma); workers redraw per forward."""
    from asyncrl.metrics import read_metrics

    res = asyncrl(procs, "train", f"runs_dir={tmp_path}", "run_name=aqn-forward", "quant=nvfp4_aqn_forward",
                  "learner.total_steps=4", "learner.ckpt_every=0", "learner.eval_every=0", "rollout.eta=1",
                  "rollout.groups_per_step=2", "rollout.dead_after_s=60")
    assert res.returncode == 0, res.stdout[-4000:]
    run_dir = tmp_path / "aqn-forward"
    cfg = json.loads((run_dir / "config.json").read_text())
    assert cfg["quant"]["aqn_resample"] == "forward" and cfg["quant"]["aqn"]
    sigmas = [r["aqn/sigma"] for r in read_metrics(run_dir) if r.get("aqn/sigma") is not None]
    assert sigmas and max(sigmas) > 0  # stage 0 is noise-free, later versions are noisy
    samples, _ = _log(run_dir)
    noisy = [s for s in samples if max(s.sample.versions.to_numpy()) >= 1]
    assert noisy, "no sample was generated under a noisy version"
    assert all(np.isfinite(s.sample.behav_logp.to_numpy()).all() for s in noisy)


def test_quantized_output_head_trains_end_to_end_and_publishes_the_head_in_int8(tmp_path, procs):
    """quant.lm_head=true: the learner publishes lm_head in int8 beside the fp32 embedding, the workers
    convert their head to load it, and the run trains."""
    import torch
    from transformers import AutoModelForCausalLM

    from asyncrl.metrics import read_metrics
    from asyncrl.quant import publish

    res = asyncrl(procs, "train", f"runs_dir={tmp_path}", "run_name=head", "quant=int8", "quant.lm_head=true",
                  "learner.total_steps=4", "learner.ckpt_every=0", "learner.eval_every=0", "rollout.eta=1",
                  "rollout.groups_per_step=2", "rollout.dead_after_s=60")
    assert res.returncode == 0, res.stdout[-4000:]
    run_dir = tmp_path / "head"
    sd = AutoModelForCausalLM.from_pretrained(run_dir / "model", dtype=torch.float32).state_dict()
    sizes = {h: publish(sd, "int8", version=1, head=h).total_bytes() for h in (True, False)}
    published = {r["quant/int8/published_bytes"] for r in read_metrics(run_dir) if "quant/int8/published_bytes" in r}
    assert published == {sizes[True]} and sizes[True] != sizes[False]
    samples, _ = _log(run_dir)
    assert any(max(s.sample.versions.to_numpy()) >= 1 for s in samples)  # sampled from fetched versions
    assert all(np.isfinite(s.sample.behav_logp.to_numpy()).all() for s in samples)


def test_int8_embedding_trains_end_to_end_and_its_deltas_carry_a_few_codes(tmp_path, procs):
    """quant.embedding=true with an int8 head and a rollout-aligned learner: the learner publishes the token
    embedding as int8 row codes, the workers convert theirs to load it, the deltas after version 1 carry a small
    part of the version, and the run trains (the learner's forward looks up the same codes)."""
    import torch
    from transformers import AutoModelForCausalLM

    from asyncrl.metrics import read_metrics
    from asyncrl.quant import publish

    res = asyncrl(procs, "train", f"runs_dir={tmp_path}", "run_name=emb", "quant=int8", "quant.lm_head=true",
                  "quant.embedding=true", "learner.rollout_aligned=true", "learner.total_steps=4",
                  "learner.ckpt_every=0", "learner.eval_every=0", "rollout.eta=1", "rollout.groups_per_step=2",
                  "rollout.dead_after_s=60")
    assert res.returncode == 0, res.stdout[-4000:]
    run_dir = tmp_path / "emb"
    assert "and the int8 token embedding" in (run_dir / "logs" / "learner.log").read_text()
    sd = AutoModelForCausalLM.from_pretrained(run_dir / "model", dtype=torch.float32).state_dict()
    pub = publish(sd, "int8", version=1, head=True, embedding=True)
    assert "model.embed_tokens.qweight" in pub.tensors and "model.embed_tokens.weight" not in pub.tensors
    recs = read_metrics(run_dir)
    assert {r["quant/int8/published_bytes"] for r in recs if "quant/int8/published_bytes" in r} == {pub.total_bytes()}
    deltas = [r["weights/int8/delta_bytes"] for r in recs if "weights/int8/delta_bytes" in r]
    assert deltas and max(deltas) < pub.total_bytes() / 2
    assert any(r.get("learner/updates", 0) > 0 for r in recs)
    samples, _ = _log(run_dir)
    assert any(max(s.sample.versions.to_numpy()) >= 1 for s in samples)  # sampled from fetched versions
    assert all(np.isfinite(s.sample.behav_logp.to_numpy()).all() for s in samples)


def test_bad_configuration_fails_before_any_process_starts(tmp_path):
    cases = {
        "quant=fp32 quant.lm_head=true": "quant.lm_head=true quantizes the output head",
        "quant=fp32 quant.embedding=true": "quant.embedding=true holds the workers' token embedding as int8 codes",
        "quant.aqn=true quant.aqn_resample=forward quant.uaq=true": "quant.aqn_resample=publication",
        "algo.tbpo_w_mode=cut": "choose one of: clamp, drop",
        "algo.objective=foo": "choose one of",
        "rollout.eta=-1": "rollout.eta=-1 must be >= 0",
        "quant.uaq=maybe": "quant.uaq=maybe is not a bool; allowed: true or false",
        "rollout.compile=maybe": "rollout.compile='maybe' is not valid; choose one of: auto, true, false",
        "rollout.groups_per_step=1e9": "rollout.groups_per_step=1e9 is not an int; it must be a whole number",
        f"task.name=jsonl_math task.path={tmp_path}/missing.jsonl": "missing.jsonl",
        f"model.name=path model.path={tmp_path}": "no config.json",
    }
    for override, message in cases.items():
        res = subprocess.run([sys.executable, "-m", "asyncrl", "train", f"runs_dir={tmp_path}/runs",
                              *override.split()], capture_output=True, text=True, timeout=120)
        assert res.returncode == 2, (override, res.stdout, res.stderr)
        assert message in res.stderr, (override, res.stderr)
        assert "Traceback" not in res.stderr and len(res.stderr.strip().splitlines()) == 1, (override, res.stderr)
        assert not (tmp_path / "runs").exists(), "a run folder was created"


def test_ctrl_c_stops_everything_and_leaves_a_resumable_checkpoint(tmp_path, procs):
    proc = procs.python("-m", "asyncrl", "train", f"runs_dir={tmp_path}", "run_name=ctrlc", *INTERRUPTED,
                        stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    run_dir = tmp_path / "ctrlc"
    wait_for_step(run_dir, 6, proc)
    proc.send_signal(signal.SIGINT)
    out, _ = proc.communicate(timeout=180)
    assert proc.returncode == 130, out.decode(errors="replace")[-2000:]
    pids = json.loads((run_dir / "pids.json").read_text())
    assert set(pids) >= {"controller", "learner", "worker-0", "worker-1"}
    alive = [n for n, pid in pids.items() if psutil.pid_exists(pid) and psutil.Process(pid).status() != "zombie"]
    assert not alive, f"still running after Ctrl-C: {alive}"
    latest = (run_dir / "checkpoints" / "latest").read_text().strip()
    version = json.loads((run_dir / "checkpoints" / latest / "learner.json").read_text())["version"]
    assert 6 <= version < INTERRUPTED_STEPS  # the learner checkpointed where it stopped, with the controller's state
    from asyncrl.controller.state import read_state  # checksummed: verified as it is read

    state = read_state(run_dir / "checkpoints" / f"controller-{version:08d}.json")
    res = asyncrl(procs, "train", f"resume={run_dir}")
    assert res.returncode == 0, res.stdout[-4000:]
    events = [r for r in read_log(run_dir / "trajectories").records if getattr(r, "event", "") == "resume"]
    assert events[0].data == {"version": str(version), "cursor": str(state["cursor"])}  # same dataset position
    samples, batches = _log(run_dir)
    assert [b.step for b in batches] == list(range(INTERRUPTED_STEPS))
    assert max(Counter(r.sample.sample_id for r in samples).values()) == 1
