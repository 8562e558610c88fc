"""Run-folder safety: one live job per folder (lock naming the holder's PID), and a full disk that
leaves no half-written file and says "disk full at PATH" (a real full tmpfs, in a user namespace)."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import textwrap

import pytest

from asyncrl.rundir.lock import RunFolderInUse, acquire_run_lock, run_lock_holder

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))


def _holder(procs, run_dir):
    code = ("import sys, time; from asyncrl.rundir.lock import acquire_run_lock; "
            f"acquire_run_lock({str(run_dir)!r}); print('held', flush=True); time.sleep(600)")
    p = procs.python("-c", code, stdout=subprocess.PIPE, env={"PYTHONPATH": REPO})
    assert p.stdout.readline().strip() == b"held"
    return p


def test_a_second_job_on_a_run_folder_is_refused_with_the_holders_pid(tmp_path, procs):
    from asyncrl.config.loader import load_train_config, save_config
    from workers.launcher import run_train

    save_config(load_train_config([]), tmp_path / "config.json")
    holder = _holder(procs, tmp_path)
    with pytest.raises(RunFolderInUse, match=f"in use by PID {holder.pid}"):
        run_train([f"resume={tmp_path}"])
    # the controller refuses on its own too (a second `asyncrl controller` on the same folder)
    res = subprocess.run([sys.executable, "-m", "workers.controller", "--run-dir", str(tmp_path),
                          "--model-dir", str(tmp_path)], capture_output=True, text=True, cwd=REPO,
                         env={**os.environ, "PYTHONPATH": REPO})
    assert res.returncode != 0 and f"in use by PID {holder.pid}" in res.stderr
    assert not (tmp_path / "trajectories").exists()
    holder.kill()
    holder.wait()
    os.close(acquire_run_lock(tmp_path))  # released when its holder died, even by SIGKILL


def test_a_lock_handed_to_a_child_is_recognised_and_still_excludes_others(tmp_path, procs):
    from asyncrl.rundir.lock import INHERITED_ENV

    fd = acquire_run_lock(tmp_path)
    code = ("from asyncrl.rundir.lock import hold_run_lock; import sys; "
            f"print(hold_run_lock({str(tmp_path)!r}) == {fd})")
    p = procs.python("-c", code, stdout=subprocess.PIPE, pass_fds=(fd,),
                     env={"PYTHONPATH": REPO, INHERITED_ENV: str(fd)})
    assert p.communicate()[0].strip() == b"True"
    with pytest.raises(RunFolderInUse, match=f"PID {os.getpid()}"):
        acquire_run_lock(tmp_path)
    os.close(fd)


def test_a_reader_sees_a_held_run_folder_and_its_holders_pid_without_keeping_the_lock(tmp_path, procs):
    assert run_lock_holder(tmp_path) is None and not (tmp_path / ".lock").exists()  # never created by a reader
    holder = _holder(procs, tmp_path)
    assert run_lock_holder(tmp_path) == str(holder.pid)
    with pytest.raises(RunFolderInUse):  # the test kept nothing: the holder still excludes everyone else
        acquire_run_lock(tmp_path)
    holder.kill()
    holder.wait()
    assert run_lock_holder(tmp_path) is None
    os.close(acquire_run_lock(tmp_path))


FULL_DISK = textwrap.dedent("""
    import json, os, sys
    from pathlib import Path
    import numpy as np
    from asyncrl.log import EventRecord, TrajectoryLogWriter, read_log
    from asyncrl.rundir.files import DiskFullError, atomic_write_text
    d = Path(sys.argv[1])
    atomic_write_text(d / "controller_final.json", json.dumps({"old": 1}))
    try:
        atomic_write_text(d / "controller_final.json", "x" * 200_000)
    except DiskFullError as e:
        print("final:", e)
    print("final content:", (d / "controller_final.json").read_text(), sorted(p.name for p in d.iterdir()))
    w = TrajectoryLogWriter(d / "log", fsync="always", rotate_bytes=1 << 20)
    n = 0
    try:
        while True:
            w.append(EventRecord(event="e", data={"pad": "y" * 1000, "n": str(n)}))
            n += 1
    except DiskFullError as e:
        print("log:", e)
    w._f = open(os.devnull, "wb")  # the real file handle stays unflushable on a full disk
    scan = read_log(d / "log")
    ok = [int(r.data["n"]) for r in scan.records] == list(range(len(scan.records)))
    print("log intact prefix:", ok, len(scan.records) >= n - 8, [c.torn_tail for c in scan.corruptions])
""")


def test_a_full_disk_says_so_and_leaves_no_half_written_file(tmp_path):
    if not shutil.which("unshare") or subprocess.run(["unshare", "-Urm", "true"]).returncode != 0:
        pytest.skip("needs user namespaces (unshare -Urm) to mount a small tmpfs as a real full disk")
    script = tmp_path / "full.py"
    script.write_text(FULL_DISK)
    mnt = tmp_path / "mnt"
    mnt.mkdir()
    cmd = f"mount -t tmpfs -o size=96k tmpfs {mnt} && exec {sys.executable} {script} {mnt}"
    res = subprocess.run(["unshare", "-Urm", "sh", "-c", cmd], capture_output=True, text=True, cwd=REPO,
                         env={**os.environ, "PYTHONPATH": REPO})
    out = res.stdout
    assert res.returncode == 0, res.stderr[-3000:]
    assert f"final: disk full at {mnt}/controller_final.json" in out
    assert 'final content: {"old": 1} [\'controller_final.json\']' in out  # old file kept, no .part left
    assert f"log: disk full at {mnt}/log/traj-000000.log" in out
    assert "log intact prefix: True True" in out
