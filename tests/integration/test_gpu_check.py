"""``scripts/gpu_check.py --device cpu --quick``: the CPU smoke of the GPU check writes one JSON document in
which every section that runs on a CPU ran and passed, and the GPU-only ones say why they were skipped.

No figure is asserted (throughput on a shared CPU means nothing); the structure, the one table (a row per
format and batch of the default model, a random-weight SmolLM2-135M shape), the per-format checks of the
``quant`` section (codes, checksums, storage, logits against the reference) and the exit status are.
"""

from __future__ import annotations

import json
import os

import pytest

from protocols.values import FORMATS
from tests.integration.runs import run_script

pytestmark = [pytest.mark.slow, pytest.mark.integration]
ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


@pytest.mark.timeout(900)
def test_gpu_check_cpu_smoke_runs_every_cpu_section_and_writes_one_json(procs, tmp_path):
    out, log = tmp_path / "gpu_check.json", tmp_path / "gpu_check.log"
    rc = run_script(procs, os.path.join(ROOT, "scripts", "gpu_check.py"), "--device", "cpu", "--quick", "--json",
                    str(out), log=log, timeout=840)
    assert rc == 0, log.read_text()[-4000:]
    report = json.loads(out.read_text())
    assert report["env"]["device"] == "cpu" and report["quick"] is True
    sections = report["sections"]
    assert set(sections) == {"native", "quant", "bench_engine", "sglang", "gpu_tests", "train", "train_2gpu",
                             "train_sglang", "bench_learner"}
    assert sections["train_2gpu"]["skipped"] and "two visible GPUs" in sections["train_2gpu"]["reason"]
    for name in ("sglang", "train_sglang"):
        assert sections[name]["skipped"] and "GPU" in sections[name]["reason"]
    for name in ("native", "quant", "bench_engine", "gpu_tests", "train"):
        assert sections[name]["passed"] is True, (name, sections[name])
    assert sections["bench_learner"]["skipped"] and "smoke test" in sections["bench_learner"]["reason"]

    assert report["models"] == {"decode": ["smollm2-135m"], "layers": 1, "train": ["model=tiny"]}
    native = sections["native"]["models"]["smollm2-135m"]
    assert "random weights" in native["origin"] and set(native["formats"]) == set(FORMATS)
    assert native["formats"]["fp32"]["logp_max_abs_diff"] < 1e-2
    # the one table: a row per format and batch, every column filled, nothing built in a warm run
    table = report["table"]
    assert [(r["format"], r["batch"]) for r in table] == [(f, 2) for f in FORMATS]
    for r in table:
        assert r["model"] == "smollm2-135m" and r["cold_tok_per_s"] > 0 and r["warm_tok_per_s"] > 0, r
        assert r["vs_bf16"] > 0 and r["vs_hf_bf16"] > 0 and r["roofline_frac"] > 0 and r["kernels_per_step"] > 0
        assert r["builds_warm"] == 0 and r["graphs_captured"] == 0, "no CUDA graphs on a CPU"
    assert sections["native"]["builds_in_warm_runs"] == 0
    quant = sections["quant"]["formats"]
    assert set(quant) == set(FORMATS)
    for fmt, row in quant.items():
        assert row["codes_equal"] and row["publication_checksum_equal"] and row["storage_stable"], (fmt, row)
        assert 0.0 <= row["logits_rel_diff"] < 5e-2, (fmt, row)
    # on CPU the "device" side runs the kernels an sm_90 GPU would select
    assert quant["fp8"]["kernels"].startswith("scaled_mm") and quant["fp8"]["reference_kernels"].startswith("fp8_emul")
    assert quant["nvfp4"]["kernels"].startswith("wo_triton")  # its torch fallback on CPU tensors
    assert quant["int8"]["kernels"].startswith("int_mm_compiled") and quant["int8"]["logits_rel_diff"] == 0.0

    bench = sections["bench_engine"]["result"]
    rows = bench["tables"]["shapes"]
    paths = {r["path"] for r in rows}
    assert {"hf-bf16", "native-bf16", "native-fp32", "native-int8", "native-fp8", "native-nvfp4"} <= paths
    for r in rows:
        assert r["shape"] == "smollm2-135m" and r["tok_per_s"] > 0
        assert 0 < r["roofline_frac"] and r["step_MB"] > 0 and r["vs_hf_bf16"] > 0 and r["vs_native_bf16"] > 0
    assert bench["copy_bandwidth_Bps"] > 0 and bench["builds_in_timed_rounds"] == 0
    assert sections["train"]["summary"]["learner_steps"] >= 1
