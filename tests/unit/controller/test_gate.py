"""StalenessGate: AReaL's admission rule, counted in groups, with injected versions."""

from __future__ import annotations

import pytest

from asyncrl.controller import ManualVersion, StalenessGate


def _gate(eta: int = 1, B: int = 2, **kw) -> tuple[StalenessGate, ManualVersion]:
    v = ManualVersion()
    return StalenessGate(v, eta=eta, groups_per_step=B, **kw), v


def test_worked_example_from_the_docstring():
    gate, v = _gate(eta=1, B=2)
    assert gate.limit() == 4
    assert gate.admit(4)[0] == 4  # g0..g3
    assert gate.admit()[0] == 0  # a fifth request waits
    gate.on_started(4)
    gate.on_group_finished(2)  # g1, g3
    gate.on_consumed(2)  # batch 0
    c = gate.counts()
    assert (c.issued, c.running, c.finished, c.consumed) == (0, 2, 0, 2)
    assert gate.capacity() == 0  # taking a batch frees no slot
    v.set(1)
    assert gate.capacity() == 2
    granted, version = gate.admit(5)
    assert (granted, version) == (2, 1)  # g4, g5 at version 1
    gate.on_started(2)
    gate.on_reissued()  # the worker holding g2 dies
    assert gate.capacity() == 0 and gate.counts().issued == 1
    gate.on_started()
    gate.on_group_finished()  # g5 completes ...
    gate.on_filtered()  # ... and dynamic sampling drops it
    assert gate.capacity() == 1
    assert gate.counts().filtered == 1 and gate.counts().reissued == 1


def test_eta_zero_admits_exactly_one_batch_per_version():
    gate, v = _gate(eta=0, B=3)
    for version in range(4):
        assert gate.admit(10)[0] == 3
        assert gate.admit()[0] == 0
        gate.on_started(3)
        gate.on_group_finished(3)
        gate.on_consumed(3)
        assert gate.admit()[0] == 0  # workers idle while the learner trains
        v.set(version + 1)


def test_each_version_opens_groups_per_step_slots():
    gate, v = _gate(eta=2, B=4)
    assert gate.admit(100)[0] == 12
    for version in range(1, 5):
        gate.on_started(4)
        gate.on_group_finished(4)
        gate.on_consumed(4)
        v.set(version)
        assert gate.admit(100)[0] == 4
    assert gate.counts().admitted == 12 + 4 * 4


def test_consumption_alone_frees_no_slot():
    gate, _ = _gate(eta=1, B=1)
    assert gate.admit(5)[0] == 2
    gate.on_started(2)
    gate.on_group_finished(2)
    gate.on_consumed(1)
    assert gate.capacity() == 0


def test_max_inflight_groups_caps_issued_plus_running():
    gate, _ = _gate(eta=3, B=4, max_inflight_groups=3)
    assert gate.admit(10)[0] == 3
    gate.on_started(3)
    gate.on_group_finished(2)
    assert gate.admit(10)[0] == 2


def test_callable_version_source_is_accepted():
    box = {"v": 0}
    gate = StalenessGate(lambda: box["v"], eta=0, groups_per_step=1)
    assert gate.admit(3)[0] == 1
    gate.on_started()
    gate.on_group_finished()
    gate.on_consumed(1)
    box["v"] = 1
    assert gate.version == 1 and gate.admit(3)[0] == 1


@pytest.mark.parametrize("eta", [-1, 1.5, True, "2"])
def test_invalid_eta_raises_value_error_that_names_the_setting(eta):
    with pytest.raises(ValueError, match="rollout.eta"):
        StalenessGate(ManualVersion(), eta=eta, groups_per_step=1)


def test_invalid_groups_per_step_raises_value_error():
    with pytest.raises(ValueError, match="groups_per_step"):
        StalenessGate(ManualVersion(), eta=0, groups_per_step=0)


def test_version_ahead_of_consumed_batches_is_an_internal_error():
    gate, v = _gate(eta=1, B=2)
    v.set(1)  # no batch consumed yet
    with pytest.raises(AssertionError, match="same checkpoint"):
        gate.capacity()


def test_version_source_going_back_is_rejected():
    v = ManualVersion(3)
    with pytest.raises(ValueError, match="only increases"):
        v.set(2)


def test_transition_out_of_an_empty_state_is_an_internal_error():
    gate, _ = _gate()
    with pytest.raises(AssertionError, match="running"):
        gate.on_group_finished()


def test_state_round_trip_returns_running_groups_to_issued():
    gate, v = _gate(eta=1, B=2)
    gate.admit(4)[0]
    gate.on_started(3)
    gate.on_group_finished(2)
    gate.on_consumed(2)
    v.set(1)
    gate.admit(1)[0]
    state = gate.state_dict()
    fresh = StalenessGate(ManualVersion(1), eta=1, groups_per_step=2)
    fresh.load_state_dict(state)
    c = fresh.counts()
    assert (c.issued, c.running, c.finished, c.consumed, c.admitted) == (3, 0, 0, 2, 5)
    assert fresh.capacity() == gate.capacity() == 1


def test_resume_with_smaller_eta_or_other_batch_is_refused():
    gate, _ = _gate(eta=2, B=2)
    with pytest.raises(ValueError, match="smaller eta"):
        StalenessGate(ManualVersion(), eta=1, groups_per_step=2).load_state_dict(gate.state_dict())
    with pytest.raises(ValueError, match="groups_per_step"):
        StalenessGate(ManualVersion(), eta=2, groups_per_step=3).load_state_dict(gate.state_dict())
