"""The interleaving and ratio summary every ratio-headline benchmark uses, and the process helpers of
scripts/benchlib.py (roles by command line, memory from /proc)."""

from __future__ import annotations

import itertools
import subprocess
import sys

import pytest

from scripts.benchlib import interleaved, load_average_stats, proc_status_bytes, ratio_stats, run_role


def test_interleaved_runs_every_path_once_per_round_in_shuffled_order_and_drops_warmup():
    calls: list[str] = []
    counters = {"a": itertools.count(), "b": itertools.count(100)}

    def path(name: str):
        def run() -> float:
            calls.append(name)
            return float(next(counters[name]))
        return run

    out = interleaved({"a": path("a"), "b": path("b")}, rounds=6, warmup=1)
    assert len(calls) == 14 and calls.count("a") == calls.count("b") == 7
    assert out["values"]["a"] == [1.0, 2.0, 3.0, 4.0, 5.0, 6.0]  # round 0 was the warm-up
    assert out["values"]["b"] == [101.0, 102.0, 103.0, 104.0, 105.0, 106.0]
    assert len(out["load"]) == 6 and all(load >= 0 for load in out["load"])
    assert {tuple(o) for o in out["order"]} == {("a", "b"), ("b", "a")}  # both orders occur (seeded)
    with pytest.raises(ValueError, match="rounds"):
        interleaved({"a": path("a")}, rounds=0)


def test_ratio_stats_takes_the_ratio_per_round_before_summarising():
    # path a is exactly half as fast as b in every round, although both drift by 10x across rounds
    num = [1.0, 2.0, 4.0, 8.0, 10.0]
    den = [2.0, 4.0, 8.0, 16.0, 20.0]
    s = ratio_stats(num, den)
    assert s["ratio_median"] == s["ratio_min"] == s["ratio_max"] == 0.5
    assert s["spread"] == 0.0 and s["rounds"] == 5
    s = ratio_stats([1.0, 1.0, 1.0, 1.0, 3.0], [1.0, 1.0, 1.0, 1.0, 1.0])
    assert s["ratio_median"] == 1.0 and s["ratio_max"] == 3.0
    with pytest.raises(ValueError, match="same"):
        ratio_stats([1.0], [1.0, 2.0])
    assert load_average_stats([1.0, 3.0, 2.0])["load_median"] == 2.0


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


def test_the_machine_block_names_the_cpu_and_the_flags_the_numerics_choose_by(monkeypatch):
    from asyncrl import machine as cpu
    from scripts.benchlib import machine

    monkeypatch.setenv(cpu.FLAGS_ENV, "avx2 fma")
    block = machine()
    assert block["processor"] == cpu.cpu_model() != "" and block["cpu_count"] >= 1
    assert block["cpu_flags"] == ["avx2"] and block["cpu_flags_forced"] is True
    assert block["int8_dot_native"] is False and block["bf16_native"] is False
    monkeypatch.delenv(cpu.FLAGS_ENV)
    block = machine()
    assert block["cpu_flags_forced"] is False and block["int8_dot_native"] == cpu.int8_dot_native()
