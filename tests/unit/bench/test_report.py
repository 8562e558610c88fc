"""asyncrl/bench/report.py: the machine block every benchmark's JSON carries."""

from __future__ import annotations

from asyncrl import machine as cpu
from asyncrl.bench.report import machine


def test_the_machine_block_names_the_cpu_and_the_flags_the_numerics_choose_by(monkeypatch):
    monkeypatch.setenv(cpu.FLAGS_ENV, "avx2 fma")
    block = machine()
    assert block["processor"] == cpu.cpu_model() != "" and block["cpu_count"] >= 1
    assert block["cpu_flags"] == ["avx2"] and block["cpu_flags_forced"] is True
    assert block["int8_dot_native"] is False and block["bf16_native"] is False
    monkeypatch.delenv(cpu.FLAGS_ENV)
    block = machine()
    assert block["cpu_flags_forced"] is False and block["int8_dot_native"] == cpu.int8_dot_native()
