"""Stage times of a real run, read from its own folder, and their calibration into the simulator's ``Params``.

Owns: what a run folder says about its stages (``measure``: samples/s, staleness histogram, mean wall
time of each stage) and the inversion that turns those wall times into the model's intrinsic costs
(``calibrate``; ``pool_params`` merges the calibrations of several runs of one job). Never: starts runs,
or invents a stage time the run does not hold (the controller's per-message cost and the message
latency are model defaults, named as such in ``Params``).

Where each stage time comes from (``asyncrl train`` writes all of it):

* ``metrics.jsonl`` (the controller's record per learner version, stamped ``time``): ``time/learner_train_s``
  (train), ``time/publish_s`` (quantize + send), ``workers/weight_sync_s`` (each worker's fetch + unpack +
  hand-over per version, from heartbeats), and the version times themselves;
* ``trajectories/`` (the trajectory log): each sample's engine ``timings`` (``queue_s``, ``total_s``),
  response length, per-token versions, worker and log time; each batch's log time and sample ids. From
  them: the engine's decode-step cost ``a + c * active`` (a least-squares fit of each sample's seconds
  per token against how many samples its worker held at its midpoint), the learner's time beyond train
  and publish (``other_s`` = batch k logged -> version k+1 reported, minus train and publish), the
  staleness of every consumed sample, and the response lengths;
* ``config.json``: workers, eta, groups per step, group size, worker slots, steps.

Wall times measured on a shared CPU include the time a process waited for a core. ``calibrate``
therefore inverts the model: it simulates the calibration run itself and scales each intrinsic cost
until the simulated wall time of every stage matches the measured one (a fixed point, a few rounds).
"""

from __future__ import annotations

import bisect
import collections
import json
import os
import statistics
from collections.abc import Sequence
from dataclasses import replace
from pathlib import Path
from typing import Any

from asyncrl.log import BatchRecord, SampleRecord, read_log
from asyncrl.metrics import read_metrics
from asyncrl.rundir import RunDir
from asyncrl.sim.model import simulate
from asyncrl.sim.params import Params, warmup_steps, window_rate

__all__ = ["POOLED_COSTS", "calibrate", "measure", "params_for", "pool_params", "simulated_stages"]


def measure(run_dir: Path) -> dict[str, Any]:
    """Everything the model and its validation need from one finished run folder."""
    run_dir = Path(run_dir)
    cfg = json.loads(RunDir(run_dir).config.read_text())
    recs = [r for r in read_metrics(run_dir) if r.get("time/learner_train_s") is not None]
    if len(recs) < 4:
        raise ValueError(f"{run_dir}: {len(recs)} learner steps in metrics.jsonl; calibrate from a run of >= 4 steps "
                         "(learner.total_steps)")
    version_times = [float(r["time"]) for r in recs]
    skip = warmup_steps(len(recs))
    body = recs[skip:]
    batch = cfg["rollout"]["groups_per_step"] * cfg["algo"]["group_size"]
    rate = window_rate(version_times, batch)
    mean = lambda key: statistics.fmean(float(r.get(key) or 0.0) for r in body)  # noqa: E731
    sync = [float(r["workers/weight_sync_s"]) for r in recs if r.get("workers/weight_sync_s") is not None]

    samples: dict[str, Any] = {}
    groups: dict[str, list] = collections.defaultdict(list)
    batches: dict[int, tuple[float, list[str]]] = {}
    for rec in read_log(RunDir(run_dir).trajectories).records:
        if isinstance(rec, SampleRecord):
            samples[rec.sample.sample_id] = rec
            groups[rec.sample.group_id].append(rec)
        elif isinstance(rec, BatchRecord):
            batches[rec.step] = (rec.logged_at, list(rec.sample_ids))
    # engine intervals: a group's samples are submitted together, at (log time - longest total_s)
    spans: dict[str, tuple[str, float, float, float, int]] = {}
    for recs_g in groups.values():
        timed = [r for r in recs_g if "total_s" in r.sample.timings]
        if not timed:
            continue
        logged = min(r.logged_at for r in timed)
        submit = logged - max(r.sample.timings["total_s"] for r in timed)
        for r in timed:
            t = r.sample.timings
            spans[r.sample.sample_id] = (r.sample.worker_id, submit + t.get("queue_s", 0.0),
                                         submit + t.get("ttft_s", t.get("queue_s", 0.0)), submit + t["total_s"],
                                         max(1, r.sample.response_ids.to_numpy().size))
    staleness: collections.Counter = collections.Counter()
    first_timed = int(recs[skip - 1]["step"]) if skip - 1 < len(recs) else 0
    for step, (_, ids) in batches.items():
        if step < first_timed:
            continue
        for sid in ids:
            rec = samples.get(sid)
            if rec is not None and rec.sample.versions.to_numpy().size:
                staleness[step - int(rec.sample.versions.to_numpy().min())] += 1
    # learner time beyond train + publish: batch k logged -> version k+1 reported
    vt = {int(r["step"]): float(r["time"]) for r in recs}
    learner_s = [vt[k + 1] - batches[k][0] for k in batches if k + 1 in vt and k + 1 > skip]
    a, c, d, per_token = _fit_engine(spans)
    queue = [r.sample.timings.get("queue_s", 0.0) for rs in groups.values() for r in rs if "total_s" in r.sample.timings]
    return {
        "run_dir": str(run_dir), "workers": int(cfg["rollout"]["num_workers"]), "eta": int(cfg["rollout"]["eta"]),
        "groups_per_step": int(cfg["rollout"]["groups_per_step"]), "group_size": int(cfg["algo"]["group_size"]),
        "slots": int(cfg["rollout"]["worker_slots"]), "steps": len(recs), "batch_samples": batch,
        **rate, "version_times": version_times,
        "staleness": {int(k): v for k, v in sorted(staleness.items())},
        "train_s": mean("time/learner_train_s"), "publish_s": mean("time/publish_s"),
        "wait_s": mean("time/learner_wait_s"),
        "learner_s": statistics.fmean(learner_s) if learner_s else float("nan"),
        "fetch_s": sync[-1] if sync else float("nan"),
        "step_a": a, "step_c": c, "step_d": d, "token_s": per_token, "queue_s": statistics.fmean(queue),
        "lengths": [s[4] for s in spans.values()],
        "cpus": os.cpu_count() or 1,
    }


def _fit_engine(spans: dict[str, tuple[str, float, float, float, int]]) -> tuple[float, float, float, float]:
    """The engine's step cost ``a + c * rows + d * admitted`` from its samples' timings.

    ``spans[id] = (worker, admitted, first token, finished, tokens)``. Later steps: a sample's seconds per
    token after its first, against the rows its worker held at the midpoint (least squares: a, c). First
    step: the admission step's time minus ``a + c * rows`` there, against the samples admitted with it
    (least squares through 0: d). Returns (a, c, d, mean seconds per token admitted -> finished); a
    negative slope is clipped to 0 (the intercept is then the mean)."""
    by_worker: dict[str, list[tuple[float, float, float, int]]] = collections.defaultdict(list)
    for w, adm, first, end, n in spans.values():
        by_worker[w].append((adm, first, end, n))
    later_x, later_y, first_rows, first_adm, first_y, per_token = [], [], [], [], [], []
    for lst in by_worker.values():
        starts = sorted(x[0] for x in lst)
        ends = sorted(x[2] for x in lst)

        def rows_at(t: float, starts: list[float] = starts, ends: list[float] = ends) -> int:
            return max(1, bisect.bisect_right(starts, t) - bisect.bisect_left(ends, t))
        for adm, first, end, n in lst:
            per_token.append(max(0.0, end - adm) / n)
            if n > 1 and end > first:
                later_x.append(rows_at((first + end) / 2))
                later_y.append((end - first) / (n - 1))
            together = bisect.bisect_right(starts, adm + 0.005) - bisect.bisect_left(starts, adm - 0.005)
            first_rows.append(rows_at(adm + 1e-9))
            first_adm.append(max(1, together))
            first_y.append(max(0.0, first - adm))
    if not per_token:
        raise ValueError("the trajectory log holds no engine timings (timings.total_s); run with the native engine")
    a, c = _line(later_x, later_y) if later_x else (statistics.fmean(first_y), 0.0)
    resid = [y - (a + c * r) for y, r in zip(first_y, first_rows, strict=True)]
    sxx = sum(x * x for x in first_adm)
    d = max(0.0, sum(x * e for x, e in zip(first_adm, resid, strict=True)) / sxx) if sxx else 0.0
    return a, c, d, statistics.fmean(per_token)


def _line(xs: Sequence[float], ys: Sequence[float]) -> tuple[float, float]:
    mx, my = statistics.fmean(xs), statistics.fmean(ys)
    sxx = sum((x - mx) ** 2 for x in xs)
    c = sum((x - mx) * (y - my) for x, y in zip(xs, ys, strict=True)) / sxx if sxx > 0 else 0.0
    if c <= 0:
        return my, 0.0
    return my - c * mx, c


def params_for(m: dict[str, Any], *, workers: int | None = None, eta: int | None = None, steps: int | None = None,
               cores: float | None = -1, **overrides: Any) -> Params:
    """``Params`` for the run ``m`` was measured on (stage costs as measured), with changes."""
    p = Params(workers=m["workers"] if workers is None else workers, eta=m["eta"] if eta is None else eta,
               groups_per_step=m["groups_per_step"], group_size=m["group_size"], slots=m["slots"],
               steps=m["steps"] if steps is None else steps, train_s=m["train_s"], publish_s=m["publish_s"],
               other_s=max(0.0, m["learner_s"] - m["train_s"] - m["publish_s"]),
               fetch_s=m["fetch_s"] if m["fetch_s"] == m["fetch_s"] else 0.0, step_a=max(m["step_a"], 1e-6),
               step_c=m["step_c"], step_d=m["step_d"], lengths=list(m["lengths"]),
               cores=m["cpus"] if cores == -1 else cores)
    return replace(p, **overrides)


_STAGES = ("train_s", "publish_s", "other_s", "fetch_s", "token_s")


def simulated_stages(p: Params) -> dict[str, float]:
    r = simulate(p)
    return {k: statistics.fmean(v) for k, v in r.stage_wall.items() if v}


def calibrate(m: dict[str, Any], rounds: int = 6) -> tuple[Params, list[dict[str, float]]]:
    """Intrinsic stage costs such that simulating the calibration run reproduces its measured stage wall
    times: each round scales every cost by measured / simulated wall time. Returns the params and the
    per-round ratios (they should approach 1)."""
    p = params_for(m)
    target = {"train_s": m["train_s"], "publish_s": m["publish_s"], "other_s": p.other_s, "fetch_s": p.fetch_s,
              "token_s": m["token_s"]}
    history = []
    for _ in range(rounds):
        sim = simulated_stages(p)
        ratios = {k: target[k] / sim[k] for k in _STAGES if sim.get(k) and target[k] > 0}
        history.append(ratios)
        tok = ratios.get("token_s", 1.0)
        p = replace(p, train_s=p.train_s * ratios.get("train_s", 1.0), publish_s=p.publish_s * ratios.get("publish_s", 1.0),
                    other_s=p.other_s * ratios.get("other_s", 1.0), fetch_s=p.fetch_s * ratios.get("fetch_s", 1.0),
                    step_a=p.step_a * tok, step_c=p.step_c * tok, step_d=p.step_d * tok)
        if all(abs(r - 1.0) < 0.01 for r in ratios.values()):
            break
    return p, history


POOLED_COSTS = ("train_s", "publish_s", "other_s", "fetch_s", "step_a", "step_c", "step_d", "train_s_per_token")


def pool_params(ps: list[Params]) -> Params:
    """One calibration from several runs of the same job: the median of each intrinsic cost (what one
    run's CPU speed or workload drift moves) and every run's response lengths; the rest from the first."""
    if not ps:
        raise ValueError("pool_params needs the calibrations of at least one run")
    costs = {k: statistics.median(getattr(p, k) for p in ps) for k in POOLED_COSTS}
    return replace(ps[0], **costs, lengths=[n for p in ps for n in p.lengths])
