"""Every file under scripts/ is a script: ``python scripts/X.py --help`` exits 0 with a usage text.

The scripts run side by side (each imports what its --help needs, torch for most: about 2 s alone). The
benchmarks name the shared options of ``asyncrl.bench.report.parser``; those with a smoke mode, ``--smoke``.
"""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest

pytestmark = pytest.mark.integration
ROOT = Path(__file__).resolve().parents[2]
SCRIPTS = sorted((ROOT / "scripts").glob("*.py"))
SMOKE = ("bench_algos", "bench_aligned", "bench_async", "bench_buckets", "bench_controller", "bench_delta",
         "bench_kernels", "bench_real", "bench_recipes", "bench_weightsync")


@pytest.mark.timeout(600)
def test_every_script_answers_help_with_its_usage(procs):
    assert SCRIPTS, "no scripts found"
    running = {p.stem: procs.python(str(p), "--help", stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                    text=True) for p in SCRIPTS}
    failed = {}
    for name, proc in running.items():
        out, _ = proc.communicate(timeout=300)
        if proc.returncode != 0 or not out.startswith("usage:"):
            failed[name] = f"exit {proc.returncode}:\n{out[-2000:]}"
        elif name.startswith("bench_") and not all(flag in out for flag in ("--quick", "--json")):
            failed[name] = "no --quick or --json (asyncrl.bench.report.parser)"
        elif name in SMOKE and "--smoke" not in out:
            failed[name] = "no --smoke"
    assert not failed, "\n\n".join(f"scripts/{n}.py --help: {why}" for n, why in failed.items())
