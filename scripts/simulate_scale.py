#!/usr/bin/env python
"""A calibrated scale model of asyncrl: predicted samples/s and staleness for any number of workers and eta.

A discrete-event simulation (``scripts/scalesim.py``: learner, controller with the real staleness gate,
group buffer and batch assembler, generation workers with the native engine's step loop, weight sync,
CPU sharing) whose stage times come from a run folder's own metrics (``scripts/scalecal.py``). Three modes:

* ``--run DIR``: calibrate from one finished ``asyncrl train`` run and predict samples/s and the staleness
  histogram for ``--workers`` x ``--etas`` on the same machine (the run's own cell first: the
  calibration's self-check).
* ``--validate``: run the grid for real (``asyncrl train``, tiny model, ``--workers`` x ``--etas``,
  ``--steps`` each; ``--reuse DIR`` reads run folders ``DIR/w{W}-eta{E}`` instead), calibrate from ONE
  cell (``--calibrate-cell W,E``) and predict every other; the table gives the error of each cell's
  samples/s and the total-variation distance between the measured and predicted staleness histograms.
  It also repeats the exercise from every other calibration cell (median and max error per choice), and
  predicts each cell from the other runs pooled (leave one out: the median of each calibrated cost).
* ``--extrapolate`` (the default when no run is given): cluster shapes (``scripts/scalecluster.py``: the
  AReaL 1.5B/7B clusters and a 7B job on 192 generation + 64 training GPUs) at eta in {0, 1, 2, 4, 8},
  their async/sync speedup next to AReaL's published one, and what limits scale: controller messages/s
  against the controller throughput measured here, weight-sync bytes/s against the publisher's link, and
  trajectory-log bytes and fsyncs/s against an fsync measured on this disk now.

Run: ``python scripts/simulate_scale.py [--quick] [--run DIR | --validate [--reuse DIR]] [--extrapolate]
[--workers 1,2,4] [--etas 0,2,4] [--steps N] [--calibrate-cell 2,2] [--json PATH]``.
"""

from __future__ import annotations

import os
import shutil
import statistics
import sys
import tempfile
import time
from dataclasses import replace
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from asyncrl.rundir import RunDir  # noqa: E402
from scripts import benchlib  # noqa: E402
from scripts.scalecal import calibrate, measure  # noqa: E402
from scripts.scalesim import Params, simulate, window_rate, window_staleness  # noqa: E402


def predict(p: Params, *, workers: int, eta: int, steps: int) -> dict[str, Any]:
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


def fmt_hist(h: dict[int, int]) -> str:
    n = sum(h.values()) or 1
    return " ".join(f"{k}:{v / n:.2f}" for k, v in sorted(h.items()))


def _calibration_row(m: dict[str, Any], p: Params, history: list[dict[str, float]]) -> dict[str, Any]:
    return {"run": m["run_dir"], "workers": m["workers"], "eta": m["eta"], "measured_samples_per_s": m["samples_per_s"],
            "train_s": p.train_s, "publish_s": p.publish_s, "other_s": p.other_s, "fetch_s": p.fetch_s,
            "step_a": p.step_a, "step_c": p.step_c, "step_d": p.step_d, "cores": p.cores,
            "mean_len": statistics.fmean(p.lengths), "rounds": len(history), "last_ratios": history[-1] if history else {},
            "measured_wall": {k: m[k] for k in ("train_s", "publish_s", "learner_s", "fetch_s", "token_s", "queue_s")}}


def from_run(run_dir: Path, workers: list[int], etas: list[int], steps: int) -> dict[str, Any]:
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
    benchlib.print_table(f"calibrated from {run_dir} ({m['workers']} workers, eta {m['eta']}): predictions on this "
                         f"machine ({p.cores} cores); the first row is the calibration run itself", rows,
                         ["workers", "eta", "predicted_samples_per_s", "measured_samples_per_s", "error",
                          "predicted_step_s", "gen_busy", "learner_busy", "predicted_staleness", "measured_staleness"])
    return {"calibration": _calibration_row(m, p, history), "predictions": rows}


def run_grid(runs_dir: Path, workers: list[int], etas: list[int], steps: int, extra: list[str]) -> dict[tuple[int, int], Path]:
    out = {}
    for w in workers:
        for e in etas:
            name = f"w{w}-eta{e}"
            run = RunDir(runs_dir / name)
            if run.summary.exists():
                out[(w, e)] = runs_dir / name
                continue
            if run.config.exists():  # an earlier attempt that did not finish: start it over
                shutil.rmtree(runs_dir / name)
            overrides = [f"learner.total_steps={steps}", f"rollout.num_workers={w}", f"rollout.eta={e}",
                         "learner.eval_every=0", "learner.ckpt_every=0", *extra]
            t0 = time.time()
            print(f"  run {name}: asyncrl train {' '.join(overrides)}", flush=True)
            out[(w, e)] = benchlib.run_train(overrides, runs_dir=runs_dir, run_name=name, log_path=runs_dir / f"{name}.log")
            print(f"    done in {time.time() - t0:.0f} s", flush=True)
    return out


def validate(runs: dict[tuple[int, int], Path], cal_cell: tuple[int, int], steps: int) -> dict[str, Any]:
    measured = {cell: measure(path) for cell, path in runs.items()}
    if cal_cell not in measured:
        raise ValueError(f"--calibrate-cell {cal_cell} is not among the runs {sorted(measured)}")
    per_cal: dict[tuple[int, int], list[dict[str, Any]]] = {}
    calibrations = {}
    params: dict[tuple[int, int], Params] = {}
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
    benchlib.print_table(f"validation: calibrated from the run with {cal_cell[0]} workers at eta {cal_cell[1]}, every cell "
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
        benchlib.print_table("the same from every possible calibration run (errors over the other cells)", summary,
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
        benchlib.print_table("leave one out: each cell predicted from the median calibrated costs of the other runs",
                             pooled, ["workers", "eta", "measured_samples_per_s", "predicted_samples_per_s", "error",
                                      "within_15pct", "staleness_tv"])
    return {"calibrated_from": list(cal_cell), "cells": main, "by_calibration_cell": summary,
            "leave_one_out": pooled, "calibrations": {f"w{c[0]}-eta{c[1]}": v for c, v in calibrations.items()}}


POOLED_COSTS = ("train_s", "publish_s", "other_s", "fetch_s", "step_a", "step_c", "step_d", "train_s_per_token")


def pool_params(ps: list[Params]) -> Params:
    """One calibration from several runs of the same job: the median of each intrinsic cost (what one
    run's CPU speed or workload drift moves) and every run's response lengths; the rest from the first."""
    costs = {k: statistics.median(getattr(p, k) for p in ps) for k in POOLED_COSTS}
    return replace(ps[0], **costs, lengths=[n for p in ps for n in p.lengths])


def main(argv: list[str] | None = None) -> int:
    p = benchlib.parser("simulate_scale", __doc__.split("\n\n")[0])
    p.epilog = __doc__.split("\n\n", 1)[1]
    p.add_argument("--run", type=Path, help="calibrate from this finished run folder and predict the grid")
    p.add_argument("--validate", action="store_true", help="run the grid for real (or --reuse) and compare")
    p.add_argument("--reuse", type=Path, help="with --validate: read run folders DIR/w{W}-eta{E}, run the missing ones there")
    p.add_argument("--extrapolate", action="store_true", help="cluster shapes (default when neither --run nor --validate)")
    p.add_argument("--workers", default="1,2,4")
    p.add_argument("--etas", default="0,2,4")
    p.add_argument("--steps", type=int, default=None, help="learner steps per real run and per simulation (default 30; quick 16)")
    p.add_argument("--calibrate-cell", default="2,2", help="W,E: the validation run the model is calibrated from")
    p.add_argument("--set", nargs="*", default=[], metavar="KEY=VALUE", help="extra asyncrl train overrides for --validate")
    p.add_argument("--shrink", type=int, default=None,
                   help="simulate 1/N of each cluster (GPUs and prompts per step; the publisher link and controller "
                        "cost scaled to keep per-GPU loads; default 4, quick 8)")
    args = p.parse_args(argv)
    benchlib.exit_on_sigterm()
    workers = [int(x) for x in args.workers.split(",") if x]
    etas = [int(x) for x in args.etas.split(",") if x]
    steps = args.steps or (16 if args.quick else 30)
    tables: dict[str, Any] = {}
    if args.run:
        tables["run"] = from_run(args.run, workers, etas, steps)
    if args.validate:
        cal = tuple(int(x) for x in args.calibrate_cell.split(","))
        if args.reuse:
            runs = run_grid(args.reuse, workers, etas, steps, args.set)
            tables["validation"] = validate(runs, cal, steps)
        else:
            with tempfile.TemporaryDirectory(prefix="simulate_scale-") as tmp:
                runs = run_grid(Path(tmp), workers, etas, steps, args.set)
                tables["validation"] = validate(runs, cal, steps)
    if args.extrapolate or not (args.run or args.validate):
        from scripts.scaleextra import extrapolate

        tables["extrapolation"] = extrapolate(quick=args.quick, shrink=args.shrink or (8 if args.quick else 4))
    benchlib.write_json(args.json, "simulate_scale", tables, args, steps=steps, workers=workers, etas=etas,
                        cpus=os.cpu_count())
    return 0


if __name__ == "__main__":
    sys.exit(main())
