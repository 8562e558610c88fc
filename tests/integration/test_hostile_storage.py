"""The run folder under attack, with real runs (marker ``slow``): a disk that fills under the trajectory log and
under the checkpoints, a read-only run folder, a learner killed (SIGKILL) in the middle of a checkpoint write,
a truncated newest checkpoint, a log whose last record was torn, a run name outside ASCII, and ``asyncrl log
show --step`` with steps it does not have. Every one ends with a clear message that names the fix, no
traceback, nothing logged lost, and a resume that finishes the run.

A full disk is a real one: a small tmpfs mounted over the log or checkpoint folder (writes past its size fail
with ENOSPC, as on a full device), grown with ``mount -o remount`` to "free space". Mounting needs root
(CAP_SYS_ADMIN), which this project's machines and CI have; elsewhere those tests are skipped, saying so.
``ulimit -f`` was not used: it fails a write with EFBIG (a file size limit), not the full device asked about.
A read-only folder is a read-only bind mount when the tests run as root (root ignores a folder's mode bits),
else ``chmod a-w``.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from asyncrl.log import read_log
from asyncrl.log.inspect import summarize
from asyncrl.rundir import RunDir
from asyncrl.rundir.checkpoints import verify_manifest
from tests.integration.runs import asyncrl, wait_for_step
from tests.integration.test_resume_rules import RUN, STEPS

pytestmark = [pytest.mark.slow, pytest.mark.integration, pytest.mark.timeout(1500)]


def _mount(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(["mount", *args], capture_output=True, text=True)


@contextlib.contextmanager
def small_disk(folder: Path, size_kib: int) -> Iterator[Path]:
    """``folder`` on a tmpfs of ``size_kib`` KiB holding what ``folder`` held; afterwards ``folder`` holds
    what the tmpfs held, on the real disk again."""
    keep = folder.with_name(folder.name + ".before-mount")
    folder.rename(keep)
    folder.mkdir()
    done = _mount("-t", "tmpfs", "-o", f"size={size_kib}k", "tmpfs", str(folder))
    if done.returncode != 0:
        folder.rmdir()
        keep.rename(folder)
        pytest.skip(f"a small tmpfs could not be mounted (needs root, CAP_SYS_ADMIN): {done.stderr.strip()}")
    try:
        shutil.copytree(keep, folder, dirs_exist_ok=True)
        shutil.rmtree(keep)
        yield folder
    finally:
        back = folder.with_name(folder.name + ".after-mount")
        shutil.copytree(folder, back)
        subprocess.run(["umount", "-l", str(folder)], check=True)
        folder.rmdir()
        back.rename(folder)


def grow(folder: Path, size_kib: int) -> None:
    """Free space: the tmpfs at ``folder`` grows to ``size_kib`` KiB."""
    done = _mount("-o", f"remount,size={size_kib}k", str(folder))
    assert done.returncode == 0, done.stderr


def used_kib(folder: Path) -> int:
    return sum(p.stat().st_size for p in folder.rglob("*") if p.is_file()) // 1024


def interrupted_run(procs, tmp_path: Path, name: str = "r", *extra: str) -> Path:
    """A run stopped with Ctrl-C at step 3 of ``STEPS``, resumable (its learner checkpointed)."""
    proc = procs.python("-m", "asyncrl", "train", f"runs_dir={tmp_path / 'runs'}", f"run_name={name}",
                        f"model.cache_dir={tmp_path / 'cache'}", *RUN, *extra,
                        stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    run = tmp_path / "runs" / name
    wait_for_step(run, 3, proc)
    proc.send_signal(signal.SIGINT)
    out, _ = proc.communicate(timeout=300)
    assert proc.returncode == 130, out.decode(errors="replace")[-3000:]
    return run


def check_finished(run: Path) -> None:
    """The run trained every step, and its log holds every sample and batch exactly once."""
    assert json.loads(RunDir(run).summary.read_text())["learner_steps"] == STEPS
    assert summarize(run)["exactly_once_problems"] == []
    assert not list(RunDir(run).checkpoints.glob("*.tmp"))  # no half-written checkpoint left behind


def test_a_disk_that_fills_under_the_log_stops_the_run_naming_it_and_a_resume_after_freeing_space_finishes(
        procs, tmp_path):
    run = interrupted_run(procs, tmp_path)
    log_dir = RunDir(run).trajectories
    with small_disk(log_dir, used_kib(log_dir) + 24):  # about two more steps of samples fit
        full = asyncrl(procs, "train", f"resume={run}")
        assert full.returncode not in (0, 130), full.stdout[-4000:]
        assert f"disk full at {log_dir / 'traj-000000.log'}" in full.stdout, full.stdout[-4000:]
        assert "free space" in full.stdout and f"asyncrl train resume={run}" in full.stdout, full.stdout[-4000:]
        assert "Traceback" not in full.stdout, full.stdout[-4000:]
        assert not RunDir(run).summary.exists()
        assert read_log(run).interior == []  # every record written before the disk filled is intact
        grow(log_dir, 8192)
        resumed = asyncrl(procs, "train", f"resume={run}")
        assert resumed.returncode == 0, resumed.stdout[-4000:]
        check_finished(run)


def test_a_disk_that_fills_under_the_checkpoints_stops_the_run_naming_it_and_keeps_the_last_checkpoint(
        procs, tmp_path):
    run = interrupted_run(procs, tmp_path)
    ckpts = RunDir(run).checkpoints
    before = ckpts / RunDir(run).latest.read_text().strip()
    with small_disk(ckpts, used_kib(ckpts) + 1024):  # room for the controller's states, not for a learner checkpoint
        full = asyncrl(procs, "train", f"resume={run}")
        assert full.returncode not in (0, 130), full.stdout[-4000:]
        assert f"disk full at {ckpts}" in full.stdout, full.stdout[-4000:]
        assert "Traceback" not in full.stdout, full.stdout[-4000:]
        assert not list(ckpts.glob("*.tmp"))  # the failed save is removed, the previous checkpoint stays
        assert RunDir(run).latest.read_text().strip() == before.name and verify_manifest(before) is None
        grow(ckpts, 256 * 1024)
        resumed = asyncrl(procs, "train", f"resume={run}")
        assert resumed.returncode == 0, resumed.stdout[-4000:]
        check_finished(run)


@contextlib.contextmanager
def read_only(folder: Path) -> Iterator[None]:
    """``folder`` read-only for this user: a read-only bind mount for root, else its write bits removed."""
    if os.geteuid() == 0:
        done = _mount("--bind", str(folder), str(folder))
        if done.returncode != 0:
            pytest.skip(f"root ignores mode bits and a read-only bind mount failed: {done.stderr.strip()}")
        try:
            ro = _mount("-o", "remount,bind,ro", str(folder))
            assert ro.returncode == 0, ro.stderr
            yield
        finally:
            subprocess.run(["umount", str(folder)], check=True)
    else:
        modes = {p: p.stat().st_mode for p in [folder, *folder.rglob("*")]}
        for p, m in modes.items():
            p.chmod(m & ~0o222)
        try:
            yield
        finally:
            for p, m in modes.items():
                p.chmod(m)


def test_a_read_only_run_folder_is_refused_before_anything_starts_and_read_by_the_log_tools(procs, tmp_path):
    run = interrupted_run(procs, tmp_path)
    before = {p: p.stat().st_mtime_ns for p in run.rglob("*") if p.is_file()}
    with read_only(run):
        refused = asyncrl(procs, "train", f"resume={run}", timeout=300)
        assert refused.returncode == 2, refused.stdout[-3000:]
        assert f"run folder {run} is not writable" in refused.stdout, refused.stdout[-3000:]
        assert "Traceback" not in refused.stdout, refused.stdout[-3000:]
        shown = asyncrl(procs, "log", "show", str(run), "--last", "2", timeout=300)
        assert shown.returncode == 0 and "--- g" in shown.stdout, shown.stdout[-3000:]
        inspected = asyncrl(procs, "log", "inspect", str(run), timeout=300)
        assert inspected.returncode == 0 and "exactly-once  ok" in inspected.stdout, inspected.stdout[-3000:]
    assert {p: p.stat().st_mtime_ns for p in run.rglob("*") if p.is_file()} == before
    with read_only(tmp_path / "runs"):  # a new run where nothing can be written
        new = asyncrl(procs, "train", f"runs_dir={tmp_path / 'runs'}", "run_name=new", *RUN, timeout=300)
        assert new.returncode == 2, new.stdout[-3000:]
        assert f"runs_dir {tmp_path / 'runs'} is not writable" in new.stdout, new.stdout[-3000:]
        assert "Traceback" not in new.stdout, new.stdout[-3000:]


def test_a_learner_killed_mid_checkpoint_and_a_truncated_newest_checkpoint_resume_from_the_last_complete_one(
        procs, tmp_path):
    """Once two checkpoints are complete, the learner is frozen (SIGSTOP) the moment a checkpoint folder
    ``step_N.tmp`` appears; if the save is still under way (``latest`` does not name step N yet) it is killed
    there (SIGKILL), else it goes on (SIGCONT) and the next checkpoint is tried: the kill lands mid-write, and
    the test checks that it did."""
    proc = procs.python("-m", "asyncrl", "train", f"runs_dir={tmp_path / 'runs'}", "run_name=k",
                        f"model.cache_dir={tmp_path / 'cache'}", *RUN, "learner.ckpt_every=1",
                        stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    run = tmp_path / "runs" / "k"
    wait_for_step(run, 2, proc)
    learner = json.loads(RunDir(run).pids.read_text())["learner"]
    killed = None
    while killed is None and proc.poll() is None:
        writing = [p for p in RunDir(run).checkpoints.glob("step_*.tmp")]
        if not writing or len(list(RunDir(run).checkpoints.glob("step_????????"))) < 2:
            time.sleep(0.001)
            continue
        os.kill(learner, signal.SIGSTOP)
        name = writing[0].name.removesuffix(".tmp")
        if writing[0].exists() and RunDir(run).latest.read_text().strip() != name:
            os.kill(learner, signal.SIGKILL)
            killed = name
        else:
            os.kill(learner, signal.SIGCONT)
    out, _ = proc.communicate(timeout=300)
    text = out.decode(errors="replace")
    assert killed is not None, "no checkpoint write was caught before the run ended:\n" + text[-3000:]
    assert proc.returncode not in (0, 130) and "killed by SIGKILL" in text, text[-3000:]
    ckpts = RunDir(run).checkpoints
    assert (ckpts / f"{killed}.tmp").exists() and not (ckpts / killed).exists()  # the kill landed mid-write

    newest = ckpts / RunDir(run).latest.read_text().strip()
    shard = max((p for p in (newest / "dcp").iterdir() if p.suffix == ".distcp"), key=lambda p: p.stat().st_size)
    with open(shard, "r+b") as f:  # and the newest complete checkpoint loses the end of its largest shard
        f.truncate(shard.stat().st_size // 2)
    previous = int(newest.name.rsplit("_", 1)[1]) - 1
    resumed = asyncrl(procs, "train", f"resume={run}")
    assert resumed.returncode == 0, resumed.stdout[-4000:]
    assert "Traceback" not in resumed.stdout
    learner_log = RunDir(run).log_of("learner").read_text(errors="replace")
    assert f"checkpoint at version {previous + 1} is not usable" in learner_log, learner_log[-3000:]
    assert f"resumed learner at version {previous}" in learner_log, learner_log[-3000:]
    check_finished(run)


def test_a_run_named_outside_ascii_trains_and_its_log_answers_bad_steps_and_a_torn_tail_replays_saying_so(
        procs, tmp_path):
    name = "試験-ü"  # quoted, as the refusal of the unquoted name says (test_hostile_config.py)
    done = asyncrl(procs, "train", f"runs_dir={tmp_path / 'runs'}", f"run_name='{name}'",
                   f"model.cache_dir={tmp_path / 'cache'}", "learner.total_steps=3", "learner.ckpt_every=0",
                   "learner.eval_every=0", "rollout.num_workers=1", "rollout.groups_per_step=2")
    assert done.returncode == 0, done.stdout[-4000:]
    run = tmp_path / "runs" / name
    assert json.loads(RunDir(run).summary.read_text())["learner_steps"] == 3

    for step, says in (("-1", "no batch for learner step -1"), ("3", "no batch for learner step 3"),
                       ("x", "invalid int value: 'x'")):
        shown = asyncrl(procs, "log", "show", str(run), "--step", step, timeout=300)
        assert shown.returncode == 2 and says in shown.stdout, shown.stdout[-2000:]
        assert "steps logged: 0..2" in shown.stdout or step == "x"
        assert "Traceback" not in shown.stdout
    shown = asyncrl(procs, "log", "show", str(run), "--step", "2", timeout=300)
    assert shown.returncode == 0 and "step 2" in shown.stdout, shown.stdout[-2000:]

    segment = RunDir(run).trajectories / "traj-000000.log"
    scan = read_log(segment)
    assert not scan.corruptions
    last_batch = max(i for i, r in enumerate(scan.records) if type(r).__name__ == "BatchRecord")
    from asyncrl.log.framing import scan_segment

    _, framed, _, _ = scan_segment(segment.read_bytes(), str(segment))
    start = framed[last_batch][0]
    end = framed[last_batch + 1][0] if last_batch + 1 < len(framed) else segment.stat().st_size
    with open(segment, "r+b") as f:  # the write of step 2's batch record cut short: a torn tail
        f.truncate(start + (end - start) // 2)
    replay = asyncrl(procs, "replay", f"run={run}")
    assert replay.returncode == 0, replay.stdout[-4000:]
    assert "torn tail" in replay.stdout and "the run trained 3 steps" in replay.stdout, replay.stdout[-4000:]
    assert "This replay trains 2 steps" in replay.stdout and "Traceback" not in replay.stdout
    assert json.loads(RunDir(run.with_name(f"{name}-replay")).summary.read_text())["learner_steps"] == 2


def test_a_mistral_shaped_folder_trained_with_lora_survives_a_killed_learner_and_resumes_to_the_end(procs, tmp_path):
    """A random-weight Mistral folder (``make_family_model``) trained with LoRA adapters; the learner is killed
    (SIGKILL) mid-run, the launcher stops the run naming that, and the resume loads the adapters' checkpoint."""
    from asyncrl.models.families import make_family_model

    folder = make_family_model(tmp_path / "mistral", "mistral", seed=0)
    model = ("model.name=path", f"model.path={folder}", "learner.lora.rank=4")
    proc = procs.python("-m", "asyncrl", "train", f"runs_dir={tmp_path / 'runs'}", "run_name=m", *RUN, *model,
                        stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    run = tmp_path / "runs" / "m"
    wait_for_step(run, 3, proc)
    os.kill(json.loads(RunDir(run).pids.read_text())["learner"], signal.SIGKILL)
    out, _ = proc.communicate(timeout=300)
    text = out.decode(errors="replace")
    assert proc.returncode not in (0, 130) and "learner failed" in text and "killed by SIGKILL" in text, text[-3000:]
    assert f"resume with: asyncrl train resume={run}" in text
    kept = int(RunDir(run).latest.read_text().strip().rsplit("_", 1)[1])
    resumed = asyncrl(procs, "train", f"resume={run}")
    assert resumed.returncode == 0, resumed.stdout[-4000:]
    assert f"resumed learner at version {kept}" in RunDir(run).log_of("learner").read_text(errors="replace")
    check_finished(run)
    assert json.loads((RunDir(run).model / "config.json").read_text())["model_type"] == "mistral"
