"""A worker whose samples keep failing validation is backed off, then quarantined (``rollout.quarantine_after``):
no group goes straight back to the worker that just returned it rejected, and a quarantined worker gets no
more work, is told why, and its groups go to the others (ControllerCore without sockets, real log files)."""

from __future__ import annotations

import logging

import numpy as np
import pytest

import protocols as P
from asyncrl.models import ensure_tiny_model
from protocols.values import QUARANTINED
from tests.unit.controller.test_core import FakeClock, G, answer, hello, make_core, register

BAD = "w"  # register() joins it
GOOD = "v"


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return ensure_tiny_model(tmp_path_factory.mktemp("m") / "tiny")


def _assignments(out):
    return [m for _, m in out if isinstance(m, P.RolloutAssignment)]


def _nan_sample(a: P.RolloutAssignment, worker: str = BAD) -> P.FinishedSample:
    ids = np.array([5, 6, 2], np.int32)
    return P.FinishedSample(sample_id=a.sample_ids[0], group_id=a.group_id, prompt_ids=a.prompt_ids,
                            response_ids=P.Array.from_numpy(ids),
                            behav_logp=P.Array.from_numpy(np.full(3, np.nan, np.float32)),
                            versions=P.Array.from_numpy(np.zeros(3, np.int32)), finish_reason="stop",
                            worker_id=worker)


def _core(tmp_path, model_dir, clock, k=3):
    core = make_core(tmp_path, model_dir, eta=3, clock=clock,
                     extra=[f"rollout.quarantine_after={k}", "rollout.dead_after_s=1000"])
    register(core)
    assert isinstance(core.handle(b"V", hello("generator", GOOD))[0][1], P.Welcome)
    core.handle(b"V", P.Heartbeat(peer_id=GOOD, time=0.0, version=0))
    return core


def _ask(core, worker=BAD, peer=b"W"):
    return core.handle(peer, P.WorkRequest(worker_id=worker, credits=G, version=0))


def test_quarantine_after_defaults_to_eight(tmp_path, model_dir):
    core = make_core(tmp_path, model_dir)
    assert core.cfg.rollout.quarantine_after == 8
    core.close()


def test_a_rejected_group_never_goes_straight_back_to_the_worker_that_returned_it(tmp_path, model_dir):
    clock = FakeClock()
    core = _core(tmp_path, model_dir, clock)
    (a,) = _assignments(_ask(core))
    assert core.on_sample(_nan_sample(a)) == []
    for _ in range(1000):  # a bad worker asking and answering as fast as it can, at one instant
        out = _ask(core)
        for again in _assignments(out):
            core.on_sample(_nan_sample(again))
        (_, reply), = out
        assert isinstance(reply, P.NoWork) and reply.retry_after_s > 0  # backed off, told how long
    assert core.counters["samples/rejected_invalid"] == 1 and core.counters["samples/invalid/behav_logp"] == 1
    (taken,) = _assignments(_ask(core, GOOD, b"V"))  # the healthy worker gets it first
    assert taken.group_id == a.group_id and taken.sample_ids == a.sample_ids
    answer(core, taken, worker=GOOD)
    assert core.samples_logged == G
    core.close()


def test_a_worker_rejected_k_times_in_a_row_is_quarantined_once_and_its_group_goes_to_a_healthy_worker(
        tmp_path, model_dir, caplog):
    clock = FakeClock()
    core = _core(tmp_path, model_dir, clock, k=3)
    caplog.set_level(logging.INFO, logger="asyncrl.controller")
    replies = []
    for _ in range(3):
        clock.t += 60  # past every back-off: the bad worker is handed its group again
        (a,) = _assignments(_ask(core))
        replies = core.on_sample(_nan_sample(a))
    (peer, shutdown), = replies  # told at once, and why
    assert peer == b"W" and isinstance(shutdown, P.Shutdown) and shutdown.reason.startswith(QUARANTINED)
    assert "3 invalid samples in a row" in shutdown.reason and "behaviour log-probs" in shutdown.reason
    assert BAD not in core.members.workers and core.counters["workers/quarantined"] == 1
    assert core.metrics()["controller/workers/quarantined"] == 1.0
    # whatever it sends now, it gets no work: Shutdown again, or a refusal to join again
    for msg in (P.WorkRequest(worker_id=BAD, credits=G, version=0), P.Heartbeat(peer_id=BAD, time=0.0, version=0)):
        (_, r), = core.handle(b"W", msg)
        assert isinstance(r, P.Shutdown) and r.reason == shutdown.reason
    (_, r), = core.handle(b"W", hello("generator", BAD))
    assert isinstance(r, P.Reject) and "quarantined" in r.reason and "worker_id" in r.reason
    assert core.handle(b"W", P.Goodbye(peer_id=BAD, reason="quarantined")) == []
    (taken,) = _assignments(_ask(core, GOOD, b"V"))
    assert taken.group_id == a.group_id
    answer(core, taken, worker=GOOD)
    assert core.samples_logged == G and core.counters["workers/quarantined"] == 1
    errors = [r.getMessage() for r in caplog.records if r.levelno >= logging.ERROR and "quarantined" in r.getMessage()]
    assert len(errors) == 1 and f"worker {BAD} quarantined" in errors[0], errors
    core.close()


def test_an_accepted_sample_resets_the_count_of_rejections_in_a_row(tmp_path, model_dir):
    clock = FakeClock()
    core = _core(tmp_path, model_dir, clock, k=3)
    for round_ in range(3):
        for _ in range(2):  # k - 1 rejections, then a valid group
            clock.t += 60
            (a,) = _assignments(_ask(core))
            assert core.on_sample(_nan_sample(a)) == []
        clock.t += 60
        (a,) = _assignments(_ask(core))
        answer(core, a)
        assert core.samples_logged == G * (round_ + 1)
    assert BAD in core.members.workers and core.counters["workers/quarantined"] == 0
    core.close()


def test_the_soak_case_tokens_194_to_195_for_a_group_admitted_at_195_is_honest_late_not_invalid():
    from asyncrl.controller.validation import check_sample

    a = P.RolloutAssignment(group_id="g0", sample_ids=["g0/0"], n_samples=1, params=P.SamplingParams(),
                            prompt_ids=P.Array.from_numpy(np.array([5, 6], np.int32)))
    sample = P.FinishedSample(sample_id="g0/0", group_id="g0", prompt_ids=a.prompt_ids,
                              response_ids=P.Array.from_numpy(np.array([7, 8, 2], np.int32)),
                              behav_logp=P.Array.from_numpy(np.full(3, -0.5, np.float32)),
                              versions=P.Array.from_numpy(np.array([194, 194, 195], np.int32)),
                              finish_reason="stop", worker_id="w")
    bad = check_sample(sample, meta={"prompt_ids": [5, 6]}, admit_version=195, served_version=195, vocab_size=260,
                       max_new_tokens=8)
    assert bad is not None and bad.late and bad.counter == "samples/late_version"
    assert "194..195" in bad.reason and "admitted at version 195" in bad.reason
    # a version no learner has published yet is invalid input, not lateness
    future = check_sample(sample, meta={"prompt_ids": [5, 6]}, admit_version=190, served_version=192,
                          vocab_size=260, max_new_tokens=8)
    assert future is not None and not future.late and future.counter == "samples/invalid/versions"


def test_honest_late_samples_are_counted_apart_reissued_and_never_quarantine_their_worker(tmp_path, model_dir):
    clock = FakeClock()
    core = _core(tmp_path, model_dir, clock, k=2)
    for a in _assignments(core.handle(b"W", P.WorkRequest(worker_id=BAD, credits=64, version=0))):
        answer(core, a)
    first = core.samples_logged
    core.handle(b"L", P.BatchRequest(step=0))
    core.handle(b"L", P.VersionUpdate(version=1))  # the learner is at version 1: groups are admitted at 1 now
    for _ in range(5):  # the first tokens came from version 0, still applied when the group arrived
        clock.t += 60
        (a,) = _assignments(core.handle(b"W", P.WorkRequest(worker_id=BAD, credits=G, version=1)))
        assert core.buffer.admission_of(a.sample_ids[0])[2] == 1
        sample = _nan_sample(a)
        sample.behav_logp = P.Array.from_numpy(np.full(3, -0.5, np.float32))
        sample.versions = P.Array.from_numpy(np.array([0, 0, 1], np.int32))
        assert core.on_sample(sample) == []
    assert core.counters["samples/late_version"] == 5 and core.counters["samples/rejected_invalid"] == 0
    assert not [k for k in core.counters if k.startswith("samples/invalid/")]
    assert BAD in core.members.workers and core.counters["workers/quarantined"] == 0
    (taken,) = _assignments(core.handle(b"V", P.WorkRequest(worker_id=GOOD, credits=G, version=1)))
    assert taken.group_id == a.group_id  # its group went to the other worker first
    answer(core, taken, worker=GOOD, version=1)
    assert core.samples_logged == first + G
    core.close()
