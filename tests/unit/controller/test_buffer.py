"""GroupBuffer: out-of-order assembly, exactly-once results, reissue, deadlines, checkpoints."""

from __future__ import annotations

import pytest

from asyncrl.controller import (
    GroupBuffer,
    GroupState,
    ManualVersion,
    ResultStatus,
    StalenessGate,
    make_sample_id,
    parse_sample_id,
)
from asyncrl.controller.scores import Scores


def admit(buf, *metas):
    """Admit groups for ``metas`` (as many as the gate allows); returns the new group ids."""
    it = iter(metas)
    return buf.admit(lambda: next(it), len(metas))


class FakeClock:
    def __init__(self) -> None:
        self.t = 100.0

    def __call__(self) -> float:
        return self.t


def _setup(eta: int = 3, B: int = 2, G: int = 3, timeout: float = 10.0):
    version = ManualVersion()
    gate = StalenessGate(version, eta=eta, groups_per_step=B)
    clock = FakeClock()
    buf = GroupBuffer(gate, group_size=G, clock=clock, assignment_timeout_s=timeout)
    return buf, gate, version, clock


def _send(buf, sid, worker, min_version=0, payload=None):
    return buf.on_result(sid, worker_id=worker, payload=payload or {"sid": sid}, min_version=min_version)


def _assert_gate_mirrors_buffer(buf, gate):
    c, b = gate.counts(), buf.counts()
    assert (c.issued, c.running, c.finished) == (b["pending"], b["assigned"], b["complete"])


def test_sample_ids_are_group_id_slash_index_and_parse_back():
    assert make_sample_id("g12", 3) == "g12/3"
    assert parse_sample_id("g12/3") == (12, 3)
    for bad in ["g12", "x1/2", "g01/2", "g1/02", "g/1", "g1/-1", "g1/2/3", "g١/2"]:
        assert parse_sample_id(bad) is None


def test_admission_numbers_groups_in_order_and_draws_metas_only_for_admitted_groups():
    buf, gate, _, _ = _setup(eta=0, B=2)
    drawn = []

    def next_problem():
        drawn.append(f"p{len(drawn)}")
        return drawn[-1]

    assert buf.admit(next_problem, 3) == ["g0", "g1"]
    assert buf.admit(next_problem, 1) == []
    assert drawn == ["p0", "p1"]  # a dataset cursor advances exactly as far as admission
    assert buf.state_dict()["next_seq"] == 2 and gate.counts().issued == 2
    assert [a.meta for a in buf.assign("w", worker_version=0, max_groups=2)] == ["p0", "p1"]


def test_out_of_order_results_from_several_workers_complete_each_group_once():
    buf, gate, _, _ = _setup(G=3)
    admit(buf, "a", "b")
    (a,) = buf.assign("w1", worker_version=0)
    (b,) = buf.assign("w2", worker_version=0)
    assert a.sample_ids == ("g0/0", "g0/1", "g0/2") and a.meta == "a"
    assert b.group_id == "g1"
    order = [("g1/2", "w2"), ("g0/1", "w1"), ("g1/0", "w2"), ("g0/0", "w1"), ("g1/1", "w2")]
    statuses = [_send(buf, sid, w) for sid, w in order]
    assert statuses == [ResultStatus.ACCEPTED] * 4 + [ResultStatus.COMPLETED]
    assert [g.group_id for g in buf.complete_groups()] == ["g1"]
    assert _send(buf, "g0/2", "w1") is ResultStatus.COMPLETED
    done = buf.complete_groups()
    assert [g.group_id for g in done] == ["g1", "g0"]  # completion order
    assert done[1].sample_ids == ("g0/0", "g0/1", "g0/2")  # members sorted by index
    _assert_gate_mirrors_buffer(buf, gate)


def test_duplicate_result_is_dropped_and_counted():
    buf, _, _, _ = _setup(G=2)
    admit(buf, "a")
    buf.assign("w1", worker_version=0)
    assert _send(buf, "g0/0", "w1", payload="first") is ResultStatus.ACCEPTED
    assert _send(buf, "g0/0", "w1", payload="second") is ResultStatus.DUPLICATE
    _send(buf, "g0/1", "w1")
    assert _send(buf, "g0/1", "w1") is ResultStatus.DUPLICATE
    assert buf.get("g0").samples[0].payload == "first"
    assert buf.stats["duplicate"] == 2 and buf.stats["completed"] == 1 and buf.stats["accepted"] == 1


def test_late_result_from_a_worker_whose_group_was_reissued_is_dropped():
    buf, gate, _, _ = _setup(G=3)
    admit(buf, "a")
    buf.assign("dead", worker_version=0)
    _send(buf, "g0/0", "dead")
    assert buf.reassign_from("dead") == ["g0/1", "g0/2"]  # finished member is kept
    assert buf.live() == [("g0", 0, GroupState.PENDING)]
    assert _send(buf, "g0/1", "dead") is ResultStatus.LATE  # pending: nobody may answer
    (again,) = buf.assign("alive", worker_version=0)
    assert again.sample_ids == ("g0/1", "g0/2")
    assert _send(buf, "g0/2", "dead") is ResultStatus.LATE
    assert _send(buf, "g0/1", "alive") is ResultStatus.ACCEPTED
    assert _send(buf, "g0/2", "alive") is ResultStatus.COMPLETED
    workers = [s.worker_id for s in buf.get("g0").samples]
    assert workers == ["dead", "alive", "alive"]
    assert gate.counts().reissued == 1 and buf.stats["late"] == 2
    _assert_gate_mirrors_buffer(buf, gate)


def test_results_for_retired_or_never_issued_groups_are_dropped():
    buf, gate, _, _ = _setup(G=1)
    admit(buf, "a")
    buf.assign("w", worker_version=0)
    _send(buf, "g0/0", "w")
    buf.retire(["g0"])
    gate.on_consumed(1)
    assert _send(buf, "g0/0", "w") is ResultStatus.RETIRED
    assert _send(buf, "g7/0", "w") is ResultStatus.UNKNOWN
    assert _send(buf, "nonsense", "w") is ResultStatus.UNKNOWN
    admit(buf, "b")
    assert _send(buf, "g1/5", "w") is ResultStatus.UNKNOWN  # index beyond group size


def test_assign_skips_groups_admitted_after_the_worker_weights():
    buf, gate, version, _ = _setup(eta=2, B=1, G=1)
    admit(buf, "old")
    buf.assign("w", worker_version=0)
    _send(buf, "g0/0", "w")
    buf.retire(["g0"])
    gate.on_consumed(1)
    version.set(1)
    admit(buf, "new")  # admitted at version 1
    assert buf.assign("lagging", worker_version=0) == []
    (a,) = buf.assign("fresh", worker_version=1)
    assert a.admit_version == 1


def test_oldest_pending_group_is_assigned_first_after_a_reissue():
    buf, _, _, _ = _setup(G=1)
    admit(buf, "a", "b", "c")
    buf.assign("w1", worker_version=0)
    buf.reassign_group("g0")
    got = [a.group_id for a in buf.assign("w2", worker_version=0, max_groups=3)]
    assert got == ["g0", "g1", "g2"]


def test_tokens_older_than_admission_raise_value_error():
    buf, gate, version, _ = _setup(eta=2, B=1, G=1)
    admit(buf, "a")
    buf.assign("w", worker_version=0)
    _send(buf, "g0/0", "w")
    buf.retire(["g0"])
    gate.on_consumed(1)
    version.set(1)
    admit(buf, "b")
    buf.assign("w", worker_version=1)
    with pytest.raises(ValueError, match="admitted at version 1"):
        _send(buf, "g1/0", "w", min_version=0)


def test_deadlines_run_from_the_assignment_and_partial_results_do_not_extend_them():
    buf, _, _, clock = _setup(G=2, timeout=10.0)
    admit(buf, "a", "b")
    buf.assign("w1", worker_version=0)
    clock.t += 5
    buf.assign("w2", worker_version=0)
    clock.t += 4
    _send(buf, "g0/0", "w1")  # progress from w1 does not buy it more time
    assert buf.overdue() == []
    clock.t += 2
    assert [a.worker_id for a in buf.overdue()] == ["w1"]
    assert buf.assignments("w1")[0].sample_ids == ("g0/1",)
    clock.t += 5
    assert sorted(a.group_id for a in buf.overdue()) == ["g0", "g1"]


def test_reissuing_a_group_that_is_not_assigned_is_refused():
    buf, _, _, _ = _setup()
    admit(buf, "a")
    with pytest.raises(ValueError, match="only an assigned group"):
        buf.reassign_group("g0")


def test_state_round_trip_keeps_results_and_reissues_in_flight_groups():
    buf, gate, _, _ = _setup(G=2)
    admit(buf, "a", "b", "c")
    buf.assign("w1", worker_version=0, max_groups=2)
    _send(buf, "g0/0", "w1", payload={"r": 1.0})
    _send(buf, "g0/1", "w1", payload={"r": 0.0})
    _send(buf, "g1/1", "w1", payload={"r": 0.5})
    buf.score("g0", Scores((1.0, 0.0), (0.7, -0.7), zero_variance=False))
    _send(buf, "g1/1", "w1")  # a duplicate, counted
    state, gstate = buf.state_dict(), gate.state_dict()

    gate2 = StalenessGate(ManualVersion(), eta=3, groups_per_step=2)
    gate2.load_state_dict(gstate)
    buf2 = GroupBuffer(gate2, group_size=2)
    buf2.load_state_dict(state)
    assert buf2.live() == [
        ("g0", 0, GroupState.COMPLETE),
        ("g1", 0, GroupState.PENDING),
        ("g2", 0, GroupState.PENDING),
    ]
    assert buf2.get("g0").scored() == Scores((1.0, 0.0), (0.7, -0.7), zero_variance=False)
    assert [s.payload for s in buf2.get("g0").samples] == [{"r": 1.0}, {"r": 0.0}]
    _assert_gate_mirrors_buffer(buf2, gate2)
    (a,) = buf2.assign("w9", worker_version=0)
    assert a.sample_ids == ("g1/0",)  # only the missing member is regenerated
    assert _send(buf2, "g1/1", "w9") is ResultStatus.DUPLICATE
    assert _send(buf2, "g1/0", "w9") is ResultStatus.COMPLETED
    assert buf2.get("g1").scores is None  # not scored yet
    assert admit(buf2, "d") == ["g3"]  # numbering continues
    assert buf2.stats["duplicate"] == 2


def test_load_rejects_a_different_group_size():
    buf, _, _, _ = _setup(G=2)
    other = GroupBuffer(StalenessGate(ManualVersion(), eta=0, groups_per_step=1), group_size=3)
    with pytest.raises(ValueError, match="group_size"):
        other.load_state_dict(buf.state_dict())
