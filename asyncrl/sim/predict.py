"""Predictions of the calibrated scale model, and their check against real runs.

Owns: ``predict`` (one cell: workers x eta from calibrated ``Params``), ``from_run`` (calibrate from one
finished run folder and predict a grid, the run's own cell first as the calibration's self-check) and
``validate`` (a grid of finished runs: calibrate from each, predict every cell, report the error of each
cell's samples/s and the total-variation distance between measured and predicted staleness histograms,
and leave-one-out predictions from the other runs pooled).
Never: starts a run (``scripts/simulate_scale.py`` runs the grid and hands over its folders), or prints
(tables go to the caller's ``show``).
"""

from __future__ import annotations

import statistics
from dataclasses import replace
from pathlib import Path
from typing import Any

from asyncrl.sim.calibrate import calibrate, measure, pool_params
from asyncrl.sim.model import simulate
from asyncrl.sim.params import Params, ShowTable, fmt_hist, window_rate, window_staleness

__all__ = ["from_run", "predict", "tv_distance", "validate"]

Cell = tuple[int, int]
"""(workers, eta)."""


def predict(p: Params, *, workers: int, eta: int, steps: int) -> dict[str, Any]:
    """Samples/s, step time and staleness histogram of the steady window of ``p`` run with ``workers`` and ``eta``."""
    r = simulate(replace(p, workers=workers, eta=eta, steps=steps))
    w = window_rate(r.version_times, r.batch_samples)
    span = r.version_times[-1] if r.version_times else 1.0
    return {"samples_per_s": w["samples_per_s"], "step_s": w["step_s"], "staleness": dict(sorted(window_staleness(r).items())),
            "learner_busy": r.learner_busy_s / span, "gen_busy": statistics.fmean(r.worker_busy_s) / span,
            "nowork_replies": r.nowork}


def tv_distance(a: dict[int, int], b: dict[int, int]) -> float:
    """Total-variation distance between two staleness histograms (0 = same shape, 1 = disjoint)."""
    na, nb = sum(a.values()) or 1, sum(b.values()) or 1
    return 0.5 * sum(abs(a.get(k, 0) / na - b.get(k, 0) / nb) for k in set(a) | set(b))


def _calibration_row(m: dict[str, Any], p: Params, history: list[dict[str, float]]) -> dict[str, Any]:
    return {"run": m["run_dir"], "workers": m["workers"], "eta": m["eta"], "measured_samples_per_s": m["samples_per_s"],
            "train_s": p.train_s, "publish_s": p.publish_s, "other_s": p.other_s, "fetch_s": p.fetch_s,
            "step_a": p.step_a, "step_c": p.step_c, "step_d": p.step_d, "cores": p.cores,
            "mean_len": statistics.fmean(p.lengths), "rounds": len(history), "last_ratios": history[-1] if history else {},
            "measured_wall": {k: m[k] for k in ("train_s", "publish_s", "learner_s", "fetch_s", "token_s", "queue_s")}}


def from_run(run_dir: Path, workers: list[int], etas: list[int], steps: int, show: ShowTable) -> dict[str, Any]:
    """Calibrate from the finished run ``run_dir`` and predict ``workers`` x ``etas`` on the same machine."""
    m = measure(run_dir)
    p, history = calibrate(m)
    rows = []
    cells = [(m["workers"], m["eta"])] + [(w, e) for w in workers for e in etas if (w, e) != (m["workers"], m["eta"])]
    for w, e in cells:
        pr = predict(p, workers=w, eta=e, steps=steps)
        row = {"workers": w, "eta": e, "predicted_samples_per_s": pr["samples_per_s"], "predicted_step_s": pr["step_s"],
               "predicted_staleness": fmt_hist(pr["staleness"]), "gen_busy": pr["gen_busy"],
               "learner_busy": pr["learner_busy"]}
        if (w, e) == (m["workers"], m["eta"]):
            row |= {"measured_samples_per_s": m["samples_per_s"], "measured_staleness": fmt_hist(m["staleness"]),
                    "error": pr["samples_per_s"] / m["samples_per_s"] - 1}
        rows.append(row)
    show(f"calibrated from {run_dir} ({m['workers']} workers, eta {m['eta']}): predictions on this "
         f"machine ({p.cores} cores); the first row is the calibration run itself", rows,
         ["workers", "eta", "predicted_samples_per_s", "measured_samples_per_s", "error",
          "predicted_step_s", "gen_busy", "learner_busy", "predicted_staleness", "measured_staleness"])
    return {"calibration": _calibration_row(m, p, history), "predictions": rows}



def validate(runs: dict[Cell, Path], cal_cell: Cell, steps: int, show: ShowTable) -> dict[str, Any]:
    """Every finished run of ``runs`` predicted from ``cal_cell``'s calibration (and from every other cell's,
    and from the others pooled); ``cal_cell`` must be one of the runs."""
    measured = {cell: measure(path) for cell, path in runs.items()}
    if cal_cell not in measured:
        raise ValueError(f"the calibration cell {cal_cell} (workers, eta) is not among the runs {sorted(measured)}; "
                         "pick one of them (--calibrate-cell W,E)")
    per_cal: dict[Cell, list[dict[str, Any]]] = {}
    calibrations = {}
    params: dict[Cell, Params] = {}
    for cal, m in measured.items():
        p, history = calibrate(m)
        params[cal] = p
        calibrations[cal] = _calibration_row(m, p, history)
        rows = []
        for (w, e), mm in sorted(measured.items()):
            pr = predict(p, workers=w, eta=e, steps=steps)
            rows.append({"workers": w, "eta": e, "measured_samples_per_s": mm["samples_per_s"],
                         "predicted_samples_per_s": pr["samples_per_s"],
                         "error": pr["samples_per_s"] / mm["samples_per_s"] - 1,
                         "within_15pct": abs(pr["samples_per_s"] / mm["samples_per_s"] - 1) <= 0.15,
                         "staleness_tv": tv_distance(mm["staleness"], pr["staleness"]),
                         "measured_staleness": fmt_hist(mm["staleness"]), "predicted_staleness": fmt_hist(pr["staleness"]),
                         "measured_step_s": mm["step_s"], "predicted_step_s": pr["step_s"], "calibration": cal == (w, e)})
        per_cal[cal] = rows
    main = per_cal[cal_cell]
    show(f"validation: calibrated from the run with {cal_cell[0]} workers at eta {cal_cell[1]}, every cell "
         "predicted (error = predicted / measured - 1; staleness_tv = total-variation distance)", main,
         ["workers", "eta", "measured_samples_per_s", "predicted_samples_per_s", "error", "within_15pct",
          "staleness_tv", "measured_staleness", "predicted_staleness", "calibration"])
    summary = []
    for cal, rows in sorted(per_cal.items()):
        errs = [abs(r["error"]) for r in rows if not r["calibration"]]
        if not errs:  # a grid of one cell: nothing else to predict
            continue
        summary.append({"calibrated_from": f"w{cal[0]}-eta{cal[1]}", "median_abs_error": statistics.median(errs),
                        "max_abs_error": max(errs), "cells_within_15pct": sum(e <= 0.15 for e in errs),
                        "cells": len(errs)})
    if summary:
        show("the same from every possible calibration run (errors over the other cells)", summary,
             ["calibrated_from", "median_abs_error", "max_abs_error", "cells_within_15pct", "cells"])
    pooled = []
    for (w, e), mm in sorted(measured.items()):  # each cell from the median costs of all the others
        others = [p for cell, p in params.items() if cell != (w, e)]
        if not others:
            continue
        pr = predict(pool_params(others), workers=w, eta=e, steps=steps)
        err = pr["samples_per_s"] / mm["samples_per_s"] - 1
        pooled.append({"workers": w, "eta": e, "measured_samples_per_s": mm["samples_per_s"],
                       "predicted_samples_per_s": pr["samples_per_s"], "error": err, "within_15pct": abs(err) <= 0.15,
                       "staleness_tv": tv_distance(mm["staleness"], pr["staleness"])})
    if pooled:
        show("leave one out: each cell predicted from the median calibrated costs of the other runs",
             pooled, ["workers", "eta", "measured_samples_per_s", "predicted_samples_per_s", "error",
                      "within_15pct", "staleness_tv"])
    return {"calibrated_from": list(cal_cell), "cells": main, "by_calibration_cell": summary,
            "leave_one_out": pooled, "calibrations": {f"w{c[0]}-eta{c[1]}": v for c, v in calibrations.items()}}
