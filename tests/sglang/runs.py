"""Checks on a finished run folder shared by the SGLang end-to-end tests (not a test module)."""

from __future__ import annotations

import json
from collections import Counter
from pathlib import Path

import numpy as np

from asyncrl.log import BatchRecord, SampleRecord, read_log


def check_trajectory_log(run_dir: Path, *, eta: int, steps: int) -> dict[str, SampleRecord]:
    """Each sample logged once and consumed at most once; no consumed token older than ``eta`` versions;
    per-token versions never go backwards. Returns the logged samples by id."""
    scan = read_log(run_dir / "trajectories")
    assert not scan.corruptions
    samples = [r for r in scan.records if isinstance(r, SampleRecord)]
    batches = [r for r in scan.records if isinstance(r, BatchRecord)]
    ids = Counter(r.sample.sample_id for r in samples)
    assert ids and max(ids.values()) == 1, [k for k, v in ids.items() if v > 1][:5]
    assert [b.step for b in batches] == list(range(steps))
    consumed = Counter(sid for b in batches for sid in b.sample_ids)
    assert max(consumed.values()) == 1 and set(consumed) <= set(ids)
    by_id = {r.sample.sample_id: r for r in samples}
    for b in batches:
        for sid in b.sample_ids:
            v = by_id[sid].sample.versions.to_numpy()
            lp = by_id[sid].sample.behav_logp.to_numpy()
            assert v.shape == lp.shape and np.isfinite(lp).all() and (lp <= 0).all()
            assert np.all(np.diff(v) >= 0), sid
            if v.size:
                assert b.step - int(v.min()) <= eta and b.step - int(v.max()) >= 0, (sid, b.step, v)
    return by_id


def rewards(run_dir: Path) -> list[float]:
    rows = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return [r["train/reward_mean"] for r in rows if r.get("train/reward_mean") is not None]
