"""admit_and_assign: the one admission step the controller and the scale simulator share."""

from __future__ import annotations

import itertools

from asyncrl.controller import GroupBuffer, ManualVersion, StalenessGate
from asyncrl.controller.admission import admit_and_assign

G, B = 4, 2


def _buffer(eta: int = 1) -> tuple[GroupBuffer, ManualVersion, itertools.count]:
    version = ManualVersion(0)
    gate = StalenessGate(version, eta=eta, groups_per_step=B)
    return GroupBuffer(gate, group_size=G, clock=lambda: 0.0), version, itertools.count()


def test_fewer_credits_than_a_group_admit_and_assign_nothing():
    buf, _, cursor = _buffer()
    assert admit_and_assign(buf, "w", credits=G - 1, worker_version=0, make_meta=cursor.__next__) == []
    assert buf.gate.counts().admitted == 0 and next(cursor) == 0  # the dataset cursor did not move


def test_a_request_takes_whole_groups_up_to_the_gate_capacity():
    buf, _, cursor = _buffer(eta=1)  # limit (eta + 0 + 1) * B = 4 groups at version 0
    got = admit_and_assign(buf, "w", credits=3 * G + 1, worker_version=0, make_meta=cursor.__next__)
    assert [a.meta for a in got] == [0, 1, 2] and all(len(a.sample_ids) == G for a in got)
    got = admit_and_assign(buf, "v", credits=3 * G, worker_version=0, make_meta=cursor.__next__)
    assert [a.meta for a in got] == [3]  # the gate had room for one more
    assert admit_and_assign(buf, "u", credits=G, worker_version=0, make_meta=cursor.__next__) == []


def test_pending_groups_count_towards_a_request_and_go_only_to_fresh_enough_weights():
    buf, version, cursor = _buffer(eta=2)
    admit_and_assign(buf, "w", credits=2 * G, worker_version=0, make_meta=cursor.__next__)
    for a in buf.assignments("w"):  # w returns both groups; the learner moves to version 1
        for sid in a.sample_ids:
            buf.on_result(sid, worker_id="w", payload=None, min_version=0)
    buf.gate.on_consumed(B)
    buf.retire([g.group_id for g in buf.complete_groups()])
    version.set(1)
    buf.admit(cursor.__next__, 1)  # a group admitted at version 1 is pending, waiting for a worker
    assert admit_and_assign(buf, "old", credits=G, worker_version=0, make_meta=cursor.__next__) == []
    assert buf.gate.counts().issued == 1  # the pending group covered the request: nothing more admitted
    (a,) = admit_and_assign(buf, "new", credits=G, worker_version=1, make_meta=cursor.__next__)
    assert (a.meta, a.admit_version, a.worker_id) == (2, 1, "new")
