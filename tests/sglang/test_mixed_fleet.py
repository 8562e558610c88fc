"""A mixed fleet on one controller (marker ``sglang``): a native int8 worker started by ``asyncrl train``
and an SGLang worker joined at run time with ``asyncrl worker controller=ADDR engine=sglang sglang.url=...``
(attached to the session's real SGLang 0.5.23 server).

The run publishes int8 (primary) and fp32 (``quant.extra_formats``); each worker fetches its own format.
Batches must hold samples of both engines, and the log's promises hold for all of them.
"""

from __future__ import annotations

import re
import subprocess
import time

import pytest

from tests.sglang.runs import check_trajectory_log

pytestmark = [pytest.mark.sglang, pytest.mark.integration, pytest.mark.timeout(1800)]

ETA, STEPS = 1, 16
RUN = [f"learner.total_steps={STEPS}", "learner.eval_every=0", "learner.ckpt_every=0", f"rollout.eta={ETA}",
       "rollout.groups_per_step=4", "rollout.worker_slots=8", "rollout.dead_after_s=300"]


def test_native_and_sglang_workers_feed_one_run(procs, tmp_path, sglang_url):
    runs = tmp_path / "runs"
    train = procs.python("-m", "asyncrl", "train", f"runs_dir={runs}", "run_name=mixed", "rollout.num_workers=1",
                         "rollout.device=cpu", "quant.fmt=int8", "quant.extra_formats=[fp32]", *RUN,
                         stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    lines, address = [], None
    deadline = time.monotonic() + 900
    while address is None and time.monotonic() < deadline:
        line = train.stdout.readline().decode(errors="replace")
        if not line:
            break
        lines.append(line)
        m = re.search(r"asyncrl worker controller=(tcp://\S+?)\)", line)
        address = m.group(1) if m else None
    assert address, "".join(lines[-30:])
    worker = procs.python("-m", "asyncrl", "worker", f"controller={address}", "engine=sglang", "quant.fmt=fp32",
                          f"sglang.url={sglang_url}", "worker_id=sglang-0", "slots=8",
                          stdout=open(tmp_path / "sglang-worker.log", "wb"), stderr=subprocess.STDOUT)  # noqa: SIM115
    out, _ = train.communicate(timeout=1500)
    assert train.returncode == 0, "".join(lines) + out.decode(errors="replace")[-4000:]
    assert worker.wait(timeout=120) == 0, (tmp_path / "sglang-worker.log").read_text()[-4000:]
    by_id = check_trajectory_log(runs / "mixed", eta=ETA, steps=STEPS)
    made_by = {(r.sample.engine, r.sample.quant_format, r.sample.worker_id) for r in by_id.values()}
    assert {e for e, _, _ in made_by} == {"native", "sglang"}, made_by
    assert ("sglang", "fp32", "sglang-0") in made_by and any(e == "native" and f == "int8" for e, f, _ in made_by)
