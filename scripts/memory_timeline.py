#!/usr/bin/env python
"""Where a run's memory goes over time: every process of one ``asyncrl train``, sampled side by side.

Runs ``asyncrl train runs_dir=TMP run_name=timeline OVERRIDES...`` and samples the resident memory
(RSS) of every process of its tree every ``--interval`` seconds (``asyncrl.bench.runs.TreeMemory``).
Processes are named by their command line (launcher, controller, learner, worker-N; anything else, such as the
short-lived preflight child, ``other``). Prints, per role, its peak and when it happened, and per ``--window`` seconds each
role's lowest and highest RSS (a floor that rises is memory the process keeps; a peak that rises
with it is a step that needs more each time); and the whole job's peak (the sum at one sample).

Run: ``python scripts/memory_timeline.py [--quick] [--interval S] [--window S] [--json PATH] -- OVERRIDES...``
e.g. ``-- +experiment=smollm2_signed_sums quant.fmt=int8 learner.time_budget_s=600 learner.total_steps=100000``.
``--quick``: the tiny model, 3 steps (a smoke check of the script).
"""

from __future__ import annotations

import tempfile
from collections import defaultdict
from pathlib import Path

from asyncrl.bench.report import parser, print_table, write_json
from asyncrl.bench.runs import run_measured, run_role, train_cmd, train_env


def main(argv: list[str] | None = None) -> int:
    p = parser("memory_timeline", __doc__)
    p.add_argument("--interval", type=float, default=0.2, help="seconds between samples (default %(default)s)")
    p.add_argument("--window", type=float, default=30.0, help="seconds per row of the timeline (default %(default)s)")
    p.add_argument("overrides", nargs="*", help="asyncrl train overrides (after --)")
    args = p.parse_args(argv)
    overrides = ["model=tiny", "learner.total_steps=3", *args.overrides] if args.quick else args.overrides
    if args.quick and args.json == p.get_default("json"):  # never over a full run's record
        args.json = args.json.replace(".json", ".quick.json")
    runs = Path(tempfile.mkdtemp(prefix="memory_timeline-"))
    cmd = train_cmd(overrides, runs_dir=runs, run_name="timeline")
    mem = run_measured(cmd, runs / "train.log", run_role, "asyncrl train", train_env(),
                       interval_s=args.interval, timeline=True)
    samples = mem.timeline or []
    gb = 2**30
    roles = sorted({r for _, s in samples for r in s})
    peaks = {r: max(((t, s[r]) for t, s in samples if r in s), key=lambda x: x[1]) for r in roles}
    t_job, job = max(((t, sum(s.values())) for t, s in samples), key=lambda x: x[1])
    windows: dict[int, dict[str, list[int]]] = defaultdict(lambda: defaultdict(list))
    for t, s in samples:
        for r, v in s.items():
            windows[int(t // args.window)][r].append(v)
    rows = [{"t_s": w * args.window, **{f"{r}_min_gb": min(v) / gb for r, v in by.items()},
             **{f"{r}_max_gb": max(v) / gb for r, v in by.items()}} for w, by in sorted(windows.items())]
    print(f"job peak {job / gb:.2f} GB at {t_job:.0f} s; per role: "
          + ", ".join(f"{r} {v / gb:.2f} GB at {t:.0f} s" for r, (t, v) in peaks.items()), flush=True)
    main_roles = [r for r in ("learner", "worker-0", "controller", "launcher") if r in roles]
    print_table(f"RSS GB per {args.window:.0f} s window (min / max)", rows,
                ["t_s", *[f"{r}_{m}_gb" for r in main_roles for m in ("min", "max")]])
    write_json(args.json, "memory_timeline", {"rows": rows}, args, overrides=overrides,
               job_peak_gb=job / gb, job_peak_t_s=t_job,
               role_peaks={r: {"gb": v / gb, "t_s": t} for r, (t, v) in peaks.items()})
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
