"""The measuring parts of scripts/bench_real.py: the Wilson interval (scripts/benchlib.py) and the process-tree memory sampler."""

from __future__ import annotations

import subprocess
import sys

import pytest

from scripts.benchlib import TreeMemory, wilson


def test_wilson_interval_matches_the_closed_form_values():
    lo, hi = wilson(5, 10)
    assert lo == pytest.approx(0.2366, abs=1e-4) and hi == pytest.approx(0.7634, abs=1e-4)
    lo, hi = wilson(0, 10)  # never below 0, and not degenerate at p = 0 (the normal approximation is)
    assert lo == 0.0 and hi == pytest.approx(0.2775, abs=1e-4)
    lo, hi = wilson(200, 200)
    assert hi == pytest.approx(1.0) and lo == pytest.approx(0.9812, abs=1e-4)
    assert all(x != x for x in wilson(0, 0))  # no data: NaN, not a made-up interval


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
