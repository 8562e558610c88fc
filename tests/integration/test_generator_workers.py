"""Two generation worker processes (fp32 and int8) driven by a controller stand-in on real sockets.

The stand-in speaks the real protocol (a typed ``Welcome.setup`` with the model architecture), assignments on
WorkRequest, samples on PULL, weights from a real WeightServer. A new version is published while the
workers are generating; every sample must arrive exactly once, with per-token versions that only go
forward, and the quantization format of the worker that made it.
"""

from __future__ import annotations

import subprocess
import threading
import time

import msgspec
import numpy as np
import pytest
import torch

import protocols as P
from asyncrl.quant import publish
from asyncrl.transport.publication import to_wire
from tests.integration.standin import worker_standin

pytestmark = pytest.mark.integration

GROUP, N_GROUPS, MAX_NEW = 4, 8, 48


def test_fp32_and_int8_workers_stream_every_sample_once_across_a_weight_update(procs, tmp_path):
    with worker_standin(tmp_path, worker_slots=16, formats=("fp32", "int8")) as stand:
        ctl, pull, server, model = stand.ctl, stand.pull, stand.server, stand.model
        for wid, fmt in (("w-fp32", "fp32"), ("w-int8", "int8")):
            procs.python("-m", "workers.generator", f"controller={ctl.address}", f"quant.fmt={fmt}",
                         f"worker_id={wid}")
        prompt = P.Array.from_numpy(np.array([1, 55, 47, 56, 65], np.int32))  # "<bos>3+4="
        todo = [f"g{i}" for i in range(N_GROUPS)]
        params = P.SamplingParams(temperature=1.0, max_new_tokens=MAX_NEW, seed=7)
        got: dict[str, P.FinishedSample] = {}
        duplicates, joined, published_v1, given = 0, {}, False, {}
        deadline = time.monotonic() + 180
        while len(got) < N_GROUPS * GROUP and time.monotonic() < deadline:
            env = ctl.recv(0.01)
            if env is not None:
                m = env.msg
                if isinstance(m, P.Hello):  # a native worker runs and fetches its own quant.fmt, as a controller says
                    joined[m.peer_id] = fmt = m.capabilities["quant_format"]
                    setup = msgspec.structs.replace(stand.setup, quant_format=fmt, actor_format=fmt)
                    ctl.send(P.Welcome(protocol_version=P.PROTOCOL_VERSION, server_id="stand-in",
                                       latest_version=server.latest_version, setup=setup), to=env.peer)
                elif isinstance(m, P.WorkRequest):
                    # half the groups for each worker, however late one of them starts
                    n = min(m.credits // GROUP, len(todo), N_GROUPS // 2 - given.get(m.worker_id, 0))
                    if n == 0:
                        ctl.send(P.NoWork(retry_after_s=0.05), to=env.peer)
                    for _ in range(n):
                        g = todo.pop(0)
                        given[m.worker_id] = given.get(m.worker_id, 0) + 1
                        ctl.send(P.RolloutAssignment(group_id=g, sample_ids=[f"{g}/{i}" for i in range(GROUP)],
                                                     prompt_ids=prompt, params=params, n_samples=GROUP), to=env.peer)
            while (s := pull.recv(0.0)) is not None:
                fs = s.msg
                duplicates += fs.sample_id in got
                got[fs.sample_id] = fs
                if not published_v1:  # new weights while the other samples are still being generated
                    with torch.no_grad():
                        model.lm_head.weight.mul_(1.05)
                    stand.publish(1)
                    published_v1 = True
        assert len(got) == N_GROUPS * GROUP, f"only {len(got)} samples arrived"
        assert duplicates == 0
        assert joined == {"w-fp32": "fp32", "w-int8": "int8"}
        spans = 0
        for fs in got.values():
            v = fs.versions.to_numpy()
            assert set(v.tolist()) <= {0, 1} and np.all(np.diff(v) >= 0), fs.sample_id
            assert fs.behav_logp.to_numpy().shape == v.shape and np.isfinite(fs.behav_logp.to_numpy()).all()
            assert fs.quant_format == {"w-fp32": "fp32", "w-int8": "int8"}[fs.worker_id]
            spans += (v.min() == 0) and (v.max() == 1)
        assert spans >= 1, "no sample straddled the weight update"
        assert {fs.worker_id for fs in got.values()} == {"w-fp32", "w-int8"}
        # Stop: workers hand back nothing (all done) and exit cleanly.
        byes = set()
        for p in procs.children:
            p.send_signal(15)
        deadline = time.monotonic() + 60
        while len(byes) < 2 and time.monotonic() < deadline:
            env = ctl.recv(0.1)
            if env is not None and isinstance(env.msg, P.Goodbye):
                assert env.msg.unfinished == []
                byes.add(env.msg.peer_id)
        assert byes == {"w-fp32", "w-int8"}
        assert [p.wait(timeout=60) for p in procs.children] == [0, 0]


def test_a_worker_asks_only_with_a_groups_worth_of_free_slots(procs, tmp_path):
    """WorkerSetup.group_size: a worker of 6 slots holding one group of 4 has 2 free, which can never be
    given a group; it waits for the group to finish instead of polling with them."""
    with worker_standin(tmp_path, worker_slots=6, group_size=GROUP) as stand:
        ctl, pull = stand.ctl, stand.pull
        procs.python("-m", "workers.generator", f"controller={ctl.address}", "worker_id=w")
        prompt = P.Array.from_numpy(np.array([1, 55, 47, 56, 65], np.int32))
        params = P.SamplingParams(temperature=1.0, max_new_tokens=MAX_NEW, seed=7)
        requests: list[int] = []  # the credits of each WorkRequest
        received, assigned, back_at, asked_at_back = 0, False, None, 0
        deadline = time.monotonic() + 240  # a hang guard: the test ends on events, not on this
        while time.monotonic() < deadline:
            env = ctl.recv(0.01)
            if env is not None and isinstance(env.msg, P.Hello):
                stand.welcome(env)
            elif env is not None and isinstance(env.msg, P.WorkRequest):
                requests.append(env.msg.credits)
                if not assigned:
                    ctl.send(P.RolloutAssignment(group_id="g", sample_ids=[f"g/{i}" for i in range(GROUP)],
                                                 prompt_ids=prompt, params=params, n_samples=GROUP), to=env.peer)
                    assigned = True
                else:  # a 10 ms back-off: dozens of requests while the group is out, had it asked with 2
                    ctl.send(P.NoWork(retry_after_s=0.01), to=env.peer)
            while pull.recv(0.0) is not None:
                received += 1
                if received == GROUP:
                    back_at, asked_at_back = time.monotonic(), len(requests)
            # Done once the group is back and the worker asked again after that, at least twice (it asks again
            # after each NoWork) and for at least 0.5 s: a while in which any request of 2 slots would show.
            if back_at is not None and len(requests) >= asked_at_back + 2 and time.monotonic() > back_at + 0.5:
                break
        assert received == GROUP, (received, requests)
        # all 6 slots; nothing while the group was out; all 6 again (and again) once it was back
        assert requests[0] == 6 and len(requests) >= asked_at_back + 2 and set(requests) == {6}, requests
        for p in procs.children:
            p.send_signal(15)
        assert [p.wait(timeout=60) for p in procs.children] == [0]


def test_a_worker_whose_format_is_not_published_yet_waits_for_it_then_works(procs, tmp_path):
    """The learner publishes a version's formats one after another (and a new format only from its next
    version): an int8 worker welcomed while only fp32 is served is refused, asks again, and starts on the
    int8 weights once they are out, instead of leaving."""
    with worker_standin(tmp_path, worker_slots=GROUP, group_size=GROUP) as stand:
        setup = msgspec.structs.replace(stand.setup, quant_format="int8", actor_format="int8")
        worker = procs.python("-m", "workers.generator", f"controller={stand.ctl.address}", "quant.fmt=int8",
                              "worker_id=w", stderr=subprocess.PIPE)
        lines: list[str] = []
        reader = threading.Thread(target=lambda: lines.extend(ln.decode(errors="replace") for ln in worker.stderr),
                                  daemon=True)
        reader.start()
        published, asked = False, False
        deadline = time.monotonic() + 120
        while worker.poll() is None and time.monotonic() < deadline and not asked:
            env = stand.ctl.recv(0.05)
            if env is not None and isinstance(env.msg, P.Hello):
                stand.ctl.send(P.Welcome(protocol_version=P.PROTOCOL_VERSION, server_id="stand-in",
                                         latest_version=0, setup=setup), to=env.peer)
            elif env is not None and isinstance(env.msg, P.WorkRequest):
                assert published, "the worker asked for work before its weights were served"
                asked = True
            if not published and any("asking again" in ln for ln in list(lines)):  # refused at least once
                stand.server.publish(*to_wire(publish(stand.model.state_dict(), "int8", version=0)))
                published = True
        assert asked and worker.poll() is None, "".join(lines)[-2000:]
        worker.send_signal(15)
        assert worker.wait(timeout=60) == 0, "".join(lines)[-2000:]
        reader.join(timeout=10)
    text = "".join(lines)
    assert "no weights in int8 yet" in text and "is not served" in text, text[-2000:]


def _welcomed_worker_leaves(procs, stand, welcome) -> str:
    """Start a worker, answer its Hello with ``welcome(env)``: it must leave with status 1 without asking for
    work. Returns what it wrote to stderr."""
    worker = procs.python("-m", "workers.generator", f"controller={stand.ctl.address}", "worker_id=w",
                          stderr=subprocess.PIPE)
    deadline = time.monotonic() + 60
    while worker.poll() is None and time.monotonic() < deadline:
        env = stand.ctl.recv(0.05)
        if env is not None and isinstance(env.msg, P.Hello):
            welcome(env)
        elif env is not None and isinstance(env.msg, P.WorkRequest):
            pytest.fail("a worker that cannot serve this run asked for work")
    _, err = worker.communicate(timeout=60)
    text = err.decode(errors="replace")
    assert worker.returncode == 1, text[-2000:]
    return text


def test_a_worker_too_small_for_a_group_leaves_at_once_naming_the_fix(procs, tmp_path):
    with worker_standin(tmp_path, worker_slots=6, group_size=8) as stand:
        text = _welcomed_worker_leaves(procs, stand, stand.welcome)
    assert "cannot hold a group of 8" in text and "slots=8 or more" in text, text[-2000:]


def test_a_worker_welcomed_by_a_controller_older_than_the_floor_leaves_naming_the_upgrade(procs, tmp_path):
    with worker_standin(tmp_path, worker_slots=6) as stand:
        text = _welcomed_worker_leaves(procs, stand, lambda env: stand.ctl.send(
            P.Welcome(protocol_version="1.3", server_id="stand-in", setup=stand.setup), to=env.peer))
    assert "speaks protocol 1.3, older than 1.4" in text and "upgrade asyncrl" in text, text[-2000:]


def test_a_quarantined_worker_leaves_at_once_naming_the_reason_and_exits_1(procs, tmp_path):
    """The controller's Shutdown with the quarantine reason (``protocols.values.QUARANTINED``): the worker
    asks for nothing more, says why as an error, and exits 1 (a launcher shows it and starts another)."""
    from protocols.values import QUARANTINED

    reason = f"{QUARANTINED}8 invalid samples in a row (rollout.quarantine_after=8), the last: behaviour log-probs"
    with worker_standin(tmp_path, worker_slots=GROUP, group_size=GROUP) as stand:
        worker = procs.python("-m", "workers.generator", f"controller={stand.ctl.address}", "worker_id=w",
                              stderr=subprocess.PIPE)
        prompt = P.Array.from_numpy(np.array([1, 55, 47, 56, 65], np.int32))
        params = P.SamplingParams(temperature=1.0, max_new_tokens=MAX_NEW, seed=7)
        peer, assigned, quarantined = None, False, False
        deadline = time.monotonic() + 120
        while worker.poll() is None and time.monotonic() < deadline:
            env = stand.ctl.recv(0.05)
            if env is not None and isinstance(env.msg, P.Hello):
                peer = env.peer
                stand.welcome(env)
            elif env is not None and isinstance(env.msg, (P.WorkRequest, P.Heartbeat)) and quarantined:
                stand.ctl.send(P.Shutdown(reason=reason), to=env.peer)  # as the controller answers it
            elif env is not None and isinstance(env.msg, P.WorkRequest) and not assigned:
                stand.ctl.send(P.RolloutAssignment(group_id="g", sample_ids=[f"g/{i}" for i in range(GROUP)],
                                                   prompt_ids=prompt, params=params, n_samples=GROUP), to=env.peer)
                assigned = True
            if not quarantined and peer is not None and stand.pull.recv(0.0) is not None:  # the last straw
                stand.ctl.send(P.Shutdown(reason=reason), to=peer)
                quarantined = True
        _, err = worker.communicate(timeout=60)
    text = err.decode(errors="replace")
    assert quarantined and worker.returncode == 1, text[-2000:]
    assert "the controller quarantined it: 8 invalid samples in a row" in text, text[-2000:]
