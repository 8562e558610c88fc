"""The native engine's row helpers on their own: request checks, admission under the prefill budget, the
aborted part of the queue, and a row's finish rule and result."""

from __future__ import annotations

from collections import deque

import pytest

from asyncrl.engine.base import GenRequest, SamplingParams
from asyncrl.engine.native.rows import new_rows, split_aborted, take_admissible


def req(sid: str, n_prompt: int, max_new: int = 4, stop: tuple[int, ...] | None = None) -> GenRequest:
    return GenRequest(sid, list(range(1, n_prompt + 1)), SamplingParams(max_new_tokens=max_new, stop_token_ids=stop))


def rows(*reqs: GenRequest):
    return new_rows(reqs, max_seq_len=16, vocab_size=32, eos_ids=(2,), now=0.0)


def test_new_rows_set_stop_ids_and_limits_and_name_the_bad_request():
    a, b = rows(req("a", 3, max_new=20), req("b", 3, stop=()))
    assert a.stop_ids == {2} and a.limit == 13  # capped at max_seq_len - prompt
    assert b.stop_ids == frozenset() and b.limit == 4
    with pytest.raises(ValueError, match="'long'.*raise max_seq_len"):
        rows(req("ok", 2), req("long", 16))
    with pytest.raises(ValueError, match=r"'v'.*outside vocab \[0, 32\)"):
        rows(GenRequest("v", [1, 40], SamplingParams(max_new_tokens=1)))
    with pytest.raises(ValueError, match="'d' appears twice"):
        rows(req("d", 1), req("d", 1))


def test_admission_fills_free_slots_within_the_prefill_budget_but_always_takes_one():
    inbox = deque(rows(req("a", 6), req("b", 5), req("c", 1), req("d", 1)))
    got = take_admissible(inbox, active=0, max_batch_size=8, max_prefill_tokens=10)
    assert [s.req.sample_id for s in got] == ["a"] and len(inbox) == 3  # b (5 > 4 left) waits, FIFO
    got = take_admissible(inbox, active=0, max_batch_size=8, max_prefill_tokens=2)
    assert [s.req.sample_id for s in got] == ["b"]  # over the budget alone: still admitted
    got = take_admissible(inbox, active=7, max_batch_size=8, max_prefill_tokens=10)
    assert [s.req.sample_id for s in got] == ["c"] and [s.req.sample_id for s in inbox] == ["d"]


def test_split_aborted_keeps_queue_order_and_takes_everything_when_closed():
    inbox = deque(rows(req("a", 1), req("b", 1), req("c", 1)))
    keep, gone = split_aborted(inbox, {"b", "zz"}, closed=False)
    assert [s.req.sample_id for s in keep] == ["a", "c"] and [s.req.sample_id for s in gone] == ["b"]
    keep, gone = split_aborted(inbox, set(), closed=True)
    assert not keep and [s.req.sample_id for s in gone] == ["a", "b", "c"]


def test_a_row_finishes_on_a_stop_token_or_its_limit_and_reports_its_timings():
    (s,) = rows(req("a", 3, max_new=3))
    s.t_admit = 0.5
    assert s.record(7, -0.1, 1, now=1.0) is None and s.cache_len == 3
    assert s.record(2, -0.2, 2, now=2.0) == "stop"
    (t,) = rows(req("t", 3, max_new=2, stop=()))
    assert t.record(2, -0.1, 0, now=1.0) is None and t.record(2, -0.1, 0, now=1.0) == "length"
    res = s.result("stop", now=3.0)
    assert res.response_ids == [7, 2] and res.versions.tolist() == [1, 2]
    assert res.behav_logp.dtype.name == "float32" and res.finish_reason == "stop"
    assert res.timings == {"total_s": 3.0, "queue_s": 0.5, "ttft_s": 1.0}
