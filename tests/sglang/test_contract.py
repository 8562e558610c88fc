"""The engine contract suite (tests/unit/engine/test_engine_contract.py) against a real SGLang server.

Every contract test runs unchanged, except three that compare two runs token for token and so need
seeded sampling: SGLang 0.5.23 honours ``sampling_seed`` only with ``--enable-deterministic-inference``,
which needs a GPU attention backend. On a server without it (every CPU server) those three skip and the
SGLang-specific versions below check everything that does not depend on the random stream (no sample
finishes while paused; late joiners come back; log-probs equal the HF forward of the tokens drawn).
"""

from __future__ import annotations

import importlib.util
from pathlib import Path

import numpy as np
import pytest

pytestmark = pytest.mark.sglang

_path = Path(__file__).resolve().parents[1] / "unit" / "engine" / "test_engine_contract.py"
_spec = importlib.util.spec_from_file_location("asyncrl_engine_contract", _path)
contract = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(contract)

SEEDED_ONLY = (
    "test_same_seed_gives_same_samples_and_other_seed_differs",
    "test_pause_holds_generation_and_resume_continues_unchanged",
    "test_requests_joining_mid_batch_match_their_solo_runs",
)
for _name in dir(contract):
    if _name.startswith("test_") and _name not in SEEDED_ONLY:
        globals()[_name] = getattr(contract, _name)
req = contract.req


def _needs_seed(engine) -> None:
    if not engine.capabilities()["seeded"]:
        pytest.skip(
            "server samples unseeded (no --enable-deterministic-inference: GPU attention backends only)"
        )


def test_same_seed_gives_same_samples_and_other_seed_differs(make_engine):
    _needs_seed(make_engine())
    contract.test_same_seed_gives_same_samples_and_other_seed_differs(make_engine)


def test_pause_holds_generation_and_resume_continues_unchanged(make_engine):
    _needs_seed(make_engine())
    contract.test_pause_holds_generation_and_resume_continues_unchanged(make_engine)


def test_requests_joining_mid_batch_match_their_solo_runs(make_engine, ref_v0, reference, logp_atol):
    _needs_seed(make_engine())
    contract.test_requests_joining_mid_batch_match_their_solo_runs(make_engine, ref_v0, reference, logp_atol)


def test_pause_holds_generation_and_keeps_logps_exact(make_engine, ref_v0, reference, logp_atol):
    reqs = [req(0, n=2, seed=9), req(1, n=24, seed=9), req(2, n=24, seed=9)]
    got, during_pause = contract.generate_pausing_after_s0(make_engine(), reqs, pause_s=0.3)
    assert during_pause == [1], "no sample may finish while paused"
    assert set(got) == {"s0", "s1", "s2", "s3"} and got["s3"].finish_reason == "length"
    for res in got.values():
        ref = reference.plain(ref_v0, res.prompt_ids, res.response_ids, 1.0).numpy()
        np.testing.assert_allclose(res.behav_logp, ref, atol=logp_atol, rtol=0)


def test_requests_joining_mid_batch_come_back_with_exact_logps(make_engine, ref_v0, reference, logp_atol):
    got = contract.generate_with_joiners(make_engine(max_batch_size=8))
    assert set(got) == {"s0", "s1", "s2", "from-thread"}
    for res in got.values():
        ref = reference.plain(ref_v0, res.prompt_ids, res.response_ids, 1.0).numpy()
        np.testing.assert_allclose(res.behav_logp, ref, atol=logp_atol, rtol=0)
