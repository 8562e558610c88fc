"""``asyncrl log inspect``: what a trajectory log holds, in one screen.

Owns: the summary of a log (record counts, version range, staleness histogram of consumed tokens,
reward summary, corruption report) and the exactly-once check: no sample id logged twice, batch
steps contiguous from 0, no sample id consumed twice, every consumed id has a sample record.
Never: modifies the log.
"""

from __future__ import annotations

import collections
import json
import math
from pathlib import Path
from typing import Any

from asyncrl.log.framing import LogFormatError
from asyncrl.log.records import BatchRecord, EventRecord, SampleRecord
from asyncrl.log.trajectory import read_log


def summarize(path: str | Path) -> dict[str, Any]:
    scan = read_log(path)
    counts = collections.Counter(type(r).__name__ for r in scan.records)
    versions_by_id: dict[str, list[int]] = {}
    duplicate_samples: collections.Counter = collections.Counter()
    rewards: list[float] = []
    vmin, vmax = math.inf, -math.inf
    for rec in scan.records:
        if isinstance(rec, SampleRecord):
            v = rec.sample.versions.to_numpy()
            if rec.sample.sample_id in versions_by_id:
                duplicate_samples[rec.sample.sample_id] += 1
            versions_by_id[rec.sample.sample_id] = v.tolist()
            rewards.append(rec.reward)
            if v.size:
                vmin, vmax = min(vmin, int(v.min())), max(vmax, int(v.max()))
    staleness: collections.Counter = collections.Counter()
    consumed, missing = 0, 0
    steps: list[int] = []
    consumed_at: dict[str, int] = {}
    problems: list[str] = []
    for rec in scan.records:
        if isinstance(rec, BatchRecord):
            if rec.step != len(steps):
                problems.append(f"batch records jump from step {steps[-1]} to {rec.step}" if steps
                                else f"batch records start at step {rec.step}, not 0")
            steps.append(rec.step)
            for sid in rec.sample_ids:
                if sid in consumed_at:
                    problems.append(f"sample {sid} consumed twice (batches {consumed_at[sid]} and {rec.step})")
                consumed_at[sid] = rec.step
                vs = versions_by_id.get(sid)
                if vs is None:
                    missing += 1
                    continue
                consumed += 1
                for v in vs:
                    staleness[rec.step - v] += 1
    if duplicate_samples:
        first = next(iter(duplicate_samples))
        problems.append(f"{sum(duplicate_samples.values())} sample records repeat an id already logged (first: {first})")
    if missing:
        problems.append(f"{missing} consumed sample ids have no sample record")
    events = collections.Counter(r.event for r in scan.records if isinstance(r, EventRecord))
    n = len(rewards)
    mean = sum(rewards) / n if n else float("nan")
    return {
        "path": str(path),
        "segments": len(scan.headers),
        "schema_version": scan.header.schema_version,
        "run_name": scan.header.run_name,
        "model": scan.header.model,
        "records": dict(counts),
        "samples": counts.get("SampleRecord", 0),
        "batches": counts.get("BatchRecord", 0),
        "learner_steps": [min(steps), max(steps)] if steps else None,
        "version_range": [vmin, vmax] if n and vmin <= vmax else None,
        "consumed_samples": consumed,
        "batch_ids_without_sample": missing,
        "staleness_histogram": {str(k): v for k, v in sorted(staleness.items())},
        "reward": {
            "count": n,
            "mean": mean,
            "min": min(rewards) if n else None,
            "max": max(rewards) if n else None,
        },
        "events": dict(events),
        "corruptions": [str(c) for c in scan.corruptions],
        "interior_corruption": bool(scan.interior),
        "exactly_once_problems": problems[:20] + ([f"... {len(problems) - 20} more"] if len(problems) > 20 else []),
    }


def format_summary(s: dict[str, Any]) -> str:
    lines = [
        f"log        {s['path']}  ({s['segments']} segment(s), schema v{s['schema_version']})",
        f"run        {s['run_name'] or '-'}   model {s['model'] or '-'}",
        f"records    {s['samples']} samples, {s['batches']} batches, {sum(s['events'].values())} events",
        f"versions   {s['version_range']}   learner steps {s['learner_steps']}",
        f"consumed   {s['consumed_samples']} samples"
        + (f" ({s['batch_ids_without_sample']} batch ids without a sample record)" if s["batch_ids_without_sample"] else ""),
    ]
    r = s["reward"]
    if r["count"]:
        lines.append(f"reward     mean {r['mean']:.4f}  min {r['min']:.4f}  max {r['max']:.4f}  (n={r['count']})")
    hist = s["staleness_histogram"]
    if hist:
        total = sum(hist.values())
        lines.append("staleness  of consumed tokens (learner step - behaviour version):")
        for k, v in hist.items():
            bar = "#" * max(1, round(40 * v / total))
            lines.append(f"  eta={k:>3}  {v:>9}  {bar}")
    for c in s["corruptions"]:
        lines.append(f"CORRUPT    {c} (every intact record before and after it was read)")
    if s["interior_corruption"]:
        lines.append("           salvage with: asyncrl log repair PATH")
    lines.append("exactly-once  " + ("ok" if not s["exactly_once_problems"] else "VIOLATED"))
    lines += [f"  {p}" for p in s["exactly_once_problems"]]
    return "\n".join(lines)


def inspect_main(path: str, *, as_json: bool = False) -> int:
    try:
        s = summarize(path)
    except (LogFormatError, ValueError, OSError) as e:
        print(f"asyncrl log inspect: {e}")
        return 2
    print(json.dumps(s, indent=2) if as_json else format_summary(s))
    return 1 if s["corruptions"] or s["exactly_once_problems"] else 0

