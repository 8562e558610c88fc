"""A fatal error in a worker thread ends the worker process with a non-zero status (it never hangs).

A real ``asyncrl worker`` joins a controller stand-in on real sockets (the real protocol: Welcome with the
model architecture and ``max_seq_len``, weights from a real WeightServer). The stand-in then assigns a
prompt longer than ``max_seq_len``: the engine refuses the request in the worker's comms thread. The
worker must hand the group's samples back in a ``Goodbye`` and exit with status 1, so that a launcher
restarts it, instead of living on with a dead thread.
"""

from __future__ import annotations

import subprocess
import time

import numpy as np
import pytest

import protocols as P
from tests.integration.standin import worker_standin

pytestmark = pytest.mark.integration

MAX_SEQ_LEN = 16


def test_worker_whose_engine_refuses_an_assignment_hands_it_back_and_exits_nonzero(procs, tmp_path):
    with worker_standin(tmp_path, worker_slots=4, max_seq_len=MAX_SEQ_LEN) as stand:
        ctl, pull = stand.ctl, stand.pull
        worker = procs.python("-m", "asyncrl", "worker", f"controller={ctl.address}", "worker_id=w0",
                              "rollout.device=cpu", stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
        too_long = P.Array.from_numpy(np.full(MAX_SEQ_LEN + 4, 53, np.int32))
        params = P.SamplingParams(temperature=1.0, max_new_tokens=4, seed=1)
        sample_ids = [f"g0/{i}" for i in range(4)]
        assigned, goodbye = False, None
        deadline = time.monotonic() + 180
        while goodbye is None and worker.poll() is None and time.monotonic() < deadline:
            env = ctl.recv(0.05)
            if env is None:
                continue
            m = env.msg
            if isinstance(m, P.Hello):
                assert m.capabilities["engine"] == "native"
                stand.welcome(env)
            elif isinstance(m, P.WorkRequest) and not assigned:
                ctl.send(P.RolloutAssignment(group_id="g0", sample_ids=sample_ids, prompt_ids=too_long,
                                             params=params, n_samples=4), to=env.peer)
                assigned = True
            elif isinstance(m, P.Goodbye):
                goodbye = m
        assert assigned, "the worker never asked for work"
        out, _ = worker.communicate(timeout=120)  # exits by itself: no signal is sent to it
        text = out.decode(errors="replace")
        assert worker.returncode == 1, text[-3000:]
        assert goodbye is not None and sorted(goodbye.unfinished) == sample_ids, text[-3000:]
        assert goodbye.reason.startswith("fatal") and "max_seq_len" in goodbye.reason
        assert "fatal error in the comms thread" in text and "shorten the prompt or raise max_seq_len" in text
        assert pull.recv(0.0) is None  # nothing half-generated was sent as a result
