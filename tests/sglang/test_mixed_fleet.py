"""A mixed fleet on one controller (marker ``sglang``): an SGLang worker joined at run time with
``asyncrl worker controller=ADDR rollout.engine=sglang sglang.url=...`` (attached to the session's real SGLang 0.5.23
server) and a native int8 worker joined the same way.

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


def _wait_for(path, text: str, proc, timeout_s: float) -> None:
    """Until ``text`` appears in the file at ``path`` (a worker's log), or fail with its tail."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if path.exists() and text in path.read_text(errors="replace"):
            return
        assert proc.poll() is None, path.read_text(errors="replace")[-4000:] if path.exists() else "exited"
        time.sleep(1.0)
    raise AssertionError(f"no {text!r} in {path} within {timeout_s}s")


def test_native_and_sglang_workers_feed_one_run(procs, tmp_path, sglang_url):
    """The run starts with no worker; the (slow) SGLang worker joins first and is ready before the (fast)
    native worker joins, so both feed the run whatever the machine's load (an ordering, not a timing)."""
    runs = tmp_path / "runs"
    train = procs.python("-m", "asyncrl", "train", f"runs_dir={runs}", "run_name=mixed", "rollout.num_workers=0",
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
    sglang_log = tmp_path / "sglang-worker.log"
    worker = procs.python("-m", "asyncrl", "worker", f"controller={address}", "rollout.engine=sglang", "quant.fmt=fp32",
                          f"sglang.url={sglang_url}", "worker_id=sglang-0", "rollout.worker_slots=8",
                          stdout=open(sglang_log, "wb"), stderr=subprocess.STDOUT)  # noqa: SIM115
    _wait_for(sglang_log, "worker sglang-0 ready", worker, 900)
    native = procs.python("-m", "asyncrl", "worker", f"controller={address}", "quant.fmt=int8", "rollout.device=cpu",
                          "worker_id=native-0", "rollout.worker_slots=8",
                          stdout=open(tmp_path / "native-worker.log", "wb"), stderr=subprocess.STDOUT)  # noqa: SIM115
    out, _ = train.communicate(timeout=1500)
    assert train.returncode == 0, "".join(lines) + out.decode(errors="replace")[-4000:]
    assert worker.wait(timeout=120) == 0, sglang_log.read_text()[-4000:]
    assert native.wait(timeout=120) == 0, (tmp_path / "native-worker.log").read_text()[-4000:]
    by_id = check_trajectory_log(runs / "mixed", eta=ETA, steps=STEPS)
    made_by = {(r.sample.engine, r.sample.quant_format, r.sample.worker_id) for r in by_id.values()}
    assert {e for e, _, _ in made_by} == {"native", "sglang"}, made_by
    assert ("sglang", "fp32", "sglang-0") in made_by and any(e == "native" and f == "int8" for e, f, _ in made_by)
