"""asyncrl/bench/runs.py: a run's roles by command line, memory from /proc, and the process-tree memory
sampler (scripts/bench_real.py, memory_timeline.py)."""

from __future__ import annotations

import subprocess
import sys

from asyncrl.bench.runs import TreeMemory, proc_status_bytes, run_role


def test_run_role_names_each_process_of_a_run_from_its_command_line():
    py = "/usr/bin/python3"
    assert run_role(f"{py} -m workers.controller --run-dir /r --model-dir /m") == "controller"
    assert run_role(f"{py} -u -m workers.learner --run-dir /r") == "learner"
    assert run_role(f"{py} -m workers.torchrun --standalone -m workers.learner") is None  # torchrun
    assert run_role(f"{py} -m workers.generator controller=tcp://x:1 worker_id=w3") == "w3"
    assert run_role(f"{py} -m workers.generator controller=tcp://x:1") == "worker"
    assert run_role(f"{py} -m asyncrl train runs_dir=/t run_name=timeline") == "launcher"
    assert run_role(f"{py} -c pass") is None


def test_proc_status_bytes_reads_resident_memory_and_gives_0_for_a_process_that_is_gone():
    rss, peak = proc_status_bytes("self", "VmRSS"), proc_status_bytes("self", "VmHWM")
    assert 0 < rss <= peak
    child = subprocess.Popen([sys.executable, "-c", "pass"])
    child.wait(timeout=60)  # reaped: its /proc entry is gone
    assert proc_status_bytes(child.pid, "VmRSS") == 0


def test_tree_memory_sees_a_grandchild_and_its_peak(procs):
    # parent -> child that holds 200 MB, then frees it and waits: the child's kernel-recorded peak stays.
    # The child (it shares its parent's stdin) holds and then frees the memory each until the test has
    # sampled and writes a line, so a sample lands in each phase however slowly this machine runs.
    code = ("import subprocess, sys; subprocess.run([sys.executable, '-c', "
            "\"import sys; b = bytearray(200 * 2**20); b[::4096] = b'x' * len(b[::4096]); print('held', flush=True); "
            "sys.stdin.readline(); del b; print('freed', flush=True); sys.stdin.readline()\"])")
    proc = procs.python("-c", code, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    mem = TreeMemory(proc.pid, label=lambda cmd: "child" if "bytearray" in cmd else None, interval_s=0.05)
    with mem:
        assert proc.stdout.readline().strip() == "held"
        mem.sample()  # the 200 MB are resident now
        proc.stdin.write("\n")
        proc.stdin.flush()
        assert proc.stdout.readline().strip() == "freed"
        mem.peak_by_label.clear()
        mem.sample()  # freed, still running: its kernel-recorded peak (VmHWM) is what this sample reads
        assert mem.peak_by_label["child"] >= 200 * 2**20
        proc.stdin.close()
        proc.wait(timeout=60)
    assert mem.peak_by_label["child"] >= 200 * 2**20
    assert mem.peak_total_bytes >= 200 * 2**20


def test_tree_memory_of_a_finished_process_is_empty():
    proc = subprocess.Popen([sys.executable, "-c", "pass"])
    proc.wait()  # reaped: its pid names no process now
    mem = TreeMemory(proc.pid)
    mem.sample()
    assert mem.peak_total_bytes == 0 and mem.peak_by_label == {}
