#!/usr/bin/env python
"""A calibrated scale model of asyncrl: predicted samples/s and staleness for any number of workers and eta.

The command line of the package ``asyncrl/sim``: a discrete-event simulation (``asyncrl/sim/model.py``:
learner, controller with the real staleness gate, group buffer, batch assembler and admission step,
generation workers with the native engine's step loop, weight sync, CPU sharing) whose stage times come
from a run folder's own metrics (``asyncrl/sim/calibrate.py``). This script owns what the package must
not do: parse the command line, start the real runs of ``--validate``, time this disk's fsync, print
and write the tables. Three modes:

* ``--run DIR``: calibrate from one finished ``asyncrl train`` run and predict samples/s and the staleness
  histogram for ``--workers`` x ``--etas`` on the same machine (the run's own cell first: the
  calibration's self-check).
* ``--validate``: run the grid for real (``asyncrl train``, tiny model, ``--workers`` x ``--etas``,
  ``--steps`` each; ``--reuse DIR`` reads run folders ``DIR/w{W}-eta{E}`` instead), calibrate from ONE
  cell (``--calibrate-cell W,E``) and predict every other; the table gives the error of each cell's
  samples/s and the total-variation distance between the measured and predicted staleness histograms.
  It also repeats the exercise from every other calibration cell (median and max error per choice), and
  predicts each cell from the other runs pooled (leave one out: the median of each calibrated cost).
* ``--extrapolate`` (the default when no run is given): cluster shapes (``asyncrl/sim/cluster.py``: the
  AReaL 1.5B/7B clusters and a 7B job on 192 generation + 64 training GPUs) at eta in {0, 1, 2, 4, 8},
  their async/sync speedup next to AReaL's published one, and what limits scale: controller messages/s
  against the controller throughput measured here, weight-sync bytes/s against the publisher's link, and
  trajectory-log bytes and fsyncs/s against an fsync measured on this disk now.

Run: ``python scripts/simulate_scale.py [--quick] [--run DIR | --validate [--reuse DIR]] [--extrapolate]
[--workers 1,2,4] [--etas 0,2,4] [--steps N] [--calibrate-cell 2,2] [--shrink N] [--json PATH]``.
"""

from __future__ import annotations

import os
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from asyncrl.bench.report import ROOT, parser, print_table, write_json
from asyncrl.bench.runs import exit_on_sigterm, run_train
from asyncrl.rundir import RunDir
from asyncrl.sim.cluster import controller_msg_s
from asyncrl.sim.extrapolate import extrapolate
from asyncrl.sim.predict import Cell, from_run, validate

CONTROLLER_RESULTS = ROOT / "benchmarks" / "results" / "bench_controller.json"


def fsync_seconds(rounds: int = 20, record_bytes: int = 64 * 4096) -> float:
    """Median seconds of one append of ``record_bytes`` + fsync on this machine's temp disk."""
    times = []
    with tempfile.NamedTemporaryFile(prefix="fsync-probe-") as f:
        payload = os.urandom(record_bytes)
        for _ in range(rounds):
            t0 = time.perf_counter()
            f.write(payload)
            f.flush()
            os.fsync(f.fileno())
            times.append(time.perf_counter() - t0)
    return statistics.median(times)


def run_grid(runs_dir: Path, workers: list[int], etas: list[int], steps: int, extra: list[str]) -> dict[Cell, Path]:
    """A finished ``asyncrl train`` run per cell in ``runs_dir/w{W}-eta{E}``: reused when its summary
    exists, started over when an earlier attempt did not finish."""
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
            out[(w, e)] = run_train(overrides, runs_dir=runs_dir, run_name=name, log_path=runs_dir / f"{name}.log")
            print(f"    done in {time.time() - t0:.0f} s", flush=True)
    return out


def _ints(text: str, flag: str) -> list[int]:
    try:
        return [int(x) for x in text.split(",") if x]
    except ValueError:
        raise ValueError(f"{flag} {text!r}: give whole numbers separated by commas, e.g. {flag} 1,2,4") from None


def _cell(text: str) -> Cell:
    cell = _ints(text, "--calibrate-cell")
    if len(cell) != 2:
        raise ValueError(f"--calibrate-cell {text!r}: give W,E (the workers and eta of one run), e.g. 2,2")
    return cell[0], cell[1]


def main(argv: list[str] | None = None) -> int:
    p = parser("simulate_scale", __doc__)
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
    exit_on_sigterm()
    try:
        workers, etas = _ints(args.workers, "--workers"), _ints(args.etas, "--etas")
        cal = _cell(args.calibrate_cell)
    except ValueError as e:
        p.error(str(e))
    steps = args.steps or (16 if args.quick else 30)
    tables: dict[str, Any] = {}
    if args.run:
        tables["run"] = from_run(args.run, workers, etas, steps, print_table)
    if args.validate:
        if args.reuse:
            runs = run_grid(args.reuse, workers, etas, steps, args.set)
            tables["validation"] = validate(runs, cal, steps, print_table)
        else:
            with tempfile.TemporaryDirectory(prefix="simulate_scale-") as tmp:
                runs = run_grid(Path(tmp), workers, etas, steps, args.set)
                tables["validation"] = validate(runs, cal, steps, print_table)
    if args.extrapolate or not (args.run or args.validate):
        tables["extrapolation"] = extrapolate(quick=args.quick, shrink=args.shrink or (8 if args.quick else 4),
                                              ctl_msg_s=controller_msg_s(CONTROLLER_RESULTS), fsync_s=fsync_seconds(),
                                              show=print_table)
    write_json(args.json, "simulate_scale", tables, args, steps=steps, workers=workers, etas=etas,
               cpus=os.cpu_count())
    return 0


if __name__ == "__main__":
    sys.exit(main())
