#!/usr/bin/env python
"""Asynchronous vs synchronous training: the same task, model and workers at eta in {0, 1, 2, 4}.

Each point is a real ``asyncrl train`` run (subprocess, run folder in a temporary directory) with
``rollout.eta=E`` and a fixed ``learner.total_steps``; evaluation and checkpoints happen only at
the end (``learner.eval_every=0 learner.ckpt_every=0``) so they do not sit inside the timed steps.
The first tenth of the steps (at least 2) is warm-up and not counted. Per run, from its own files:

* ``samples_per_s``: samples consumed by the learner per second of wall time over the window
  (steps x groups_per_step x group_size / controller ``time/wall_s`` difference);
* ``learner_busy``: mean of the learner's own ``time/learner_busy_frac`` (train time / whole step
  including waiting for the batch and publishing);
* ``gen_busy``: fraction of the window during which a worker's engine held at least one admitted
  sample, averaged over workers. Derived from the trajectory log: each FinishedSample carries the
  engine's ``timings`` (``queue_s``: submit -> admitted, ``total_s``: submit -> finished) and every
  sample of a group is submitted together (one RolloutAssignment), so the group's submit time is its
  log time (``SampleRecord.logged_at``) minus the longest ``total_s`` of its samples (exact up to the
  ms the last sample takes to reach the controller); the busy intervals [admitted, finished] of each
  worker are merged. This is wall time with work in the engine, not CPU time: on 2 shared cores a
  busy engine may be waiting for a core;
* stage times: ``G_s`` = busy seconds per worker per learner step (generation time per batch),
  ``T_s`` = mean ``time/learner_train_s + time/publish_s`` (the learner's work per step),
  ``wait_s`` = mean ``time/learner_wait_s``.

The ideal pipelining bound is ``(G + T) / max(G, T)`` with G and T measured in the eta=0 run of the
same invocation (there the stages do not overlap, so they are measured without contention).
``speedup`` = samples/s over the eta=0 run's samples/s, printed next to the bound.
``latency_bound`` = eta=0 step time / max(G, T): the eta=0 step also waits for things that are not
stage work (weight propagation, the worker's version report, request retries); asynchrony hides
those too, so the speedup can exceed (G + T) / max(G, T) but not this. A second table splits the
eta=0 step into consecutive segments (learner, propagation of the new version to an engine,
generation, collection into a batch) from the same timestamps (see ``Timeline.sync_breakdown``).
``efficiency`` = max(G, T) / step time of the run itself (its own stage times): how close the run
comes to the ideal pipelined step. On a shared machine T moves by tens of percent between runs,
which moves ``speedup`` with it; ``efficiency`` is the steadier figure.

``--regime rollout`` tries to make generation dominate on the tiny model (longer responses, one worker
holding one group at a time); ``--regime smollm2`` runs the real model, SmolLM2-135M-Instruct on its
preset (``+experiment=smollm2_signed_sums``: chat prompts, up to 64 new tokens, bf16 learner, one
worker), where a 135M-parameter decode is most of a step. ``G_over_T`` and ``rollout_bound`` = G >= 2T
say whether a run was rollout-bound. Both regimes run the sweep for fp32 and int8 workers by
default: ``vs_first_fmt`` is the end-to-end samples/s of each format over the first one at the same
eta (QuRL's claim is end-to-end rollout speed).

Run: ``python scripts/bench_async.py [--quick|--smoke] [--regime learner|rollout|smollm2] [--quant-formats
fp32,int8] [--etas 0,1,2,4] [--steps N]
[--heartbeat-s 1.0,0.05] [--set key=value ...] [--json PATH]``.
"""

from __future__ import annotations

import collections
import statistics
import sys
import tempfile
from pathlib import Path

from asyncrl.bench.report import parser, print_table, write_json
from asyncrl.bench.runs import exit_on_sigterm, run_train, step_records
from asyncrl.rundir import RunDir
from asyncrl.sim.params import warmup_steps

# Generation-dominated sizes: longer responses from one worker whose engine holds one group at a time
# (worker_slots = the default group size), so a step's groups are generated one after another while the
# learner's step stays as it is. (A smoke run with only longer responses stayed learner-bound: G/T 0.4.)
ROLLOUT_REGIME = ("rollout.max_new_tokens=96", "rollout.worker_slots=8")
REGIMES = {"learner": (), "rollout": ROLLOUT_REGIME, "smollm2": ("+experiment=smollm2_signed_sums", *ROLLOUT_REGIME)}


class Timeline:
    """Wall-clock (time.time) timeline of a run, rebuilt from its trajectory log.

    ``samples[id] = (worker, submitted, admitted, finished)``: every sample of a group is submitted
    together (one RolloutAssignment), so the group's submit time is its log time (the earliest
    ``SampleRecord.logged_at`` of the group, written when its last sample arrived) minus the longest
    engine ``timings["total_s"]`` among its samples; admitted = submit + ``queue_s``, finished =
    submit + ``total_s``. ``batches[k] = (logged_at, sample ids)`` of learner step k.
    """

    def __init__(self, run_dir: Path) -> None:
        from asyncrl.log import BatchRecord, SampleRecord, read_log

        groups: dict[str, list] = collections.defaultdict(list)
        self.batches: dict[int, tuple[float, list[str]]] = {}
        for rec in read_log(RunDir(run_dir).trajectories).records:
            if isinstance(rec, SampleRecord):
                groups[rec.sample.group_id].append(rec)
            elif isinstance(rec, BatchRecord):
                self.batches[rec.step] = (rec.logged_at, list(rec.sample_ids))
        self.samples: dict[str, tuple[str, float, float, float]] = {}
        for recs in groups.values():
            timed = [r for r in recs if "total_s" in r.sample.timings]
            if not timed:
                continue
            submit = min(r.logged_at for r in timed) - max(r.sample.timings["total_s"] for r in timed)
            for r in timed:
                t = r.sample.timings
                self.samples[r.sample.sample_id] = (r.sample.worker_id, submit, submit + t.get("queue_s", 0.0),
                                                    submit + t["total_s"])

    def busy_intervals(self) -> dict[str, list[tuple[float, float]]]:
        """Per worker: the [admitted, finished] interval of every logged sample."""
        out: dict[str, list[tuple[float, float]]] = collections.defaultdict(list)
        for worker, _, admitted, finished in self.samples.values():
            out[worker].append((admitted, finished))
        return out

    def sync_breakdown(self, version_times: dict[int, float], steps: range) -> dict[str, float]:
        """Mean split of a synchronous (eta=0) step k -> k+1 into consecutive segments:
        ``learner_s`` (batch k sent -> version k+1 announced: receive, train, gather, publish),
        ``propagate_s`` (version k+1 announced -> first sample of batch k+1 submitted to an engine:
        weight fetch and load, the worker's version report, the work request and assignment),
        ``generate_s`` (first submit -> last finish of batch k+1's samples) and ``collect_s`` (last
        finish -> batch k+1 sent: push, scoring, logging, assembly). They add up to the step time only
        when nothing overlaps, i.e. at eta=0."""
        parts: dict[str, list[float]] = collections.defaultdict(list)
        for k in steps:
            if k not in self.batches or k + 1 not in self.batches or k + 1 not in version_times:
                continue
            ids = [i for i in self.batches[k + 1][1] if i in self.samples]
            if not ids:
                continue
            first = min(self.samples[i][1] for i in ids)
            last = max(self.samples[i][3] for i in ids)
            parts["learner_s"].append(version_times[k + 1] - self.batches[k][0])
            parts["propagate_s"].append(first - version_times[k + 1])
            parts["generate_s"].append(last - first)
            parts["collect_s"].append(self.batches[k + 1][0] - last)
        return {k: statistics.fmean(v) for k, v in parts.items()}


def merged_seconds(intervals: list[tuple[float, float]], lo: float, hi: float) -> float:
    """Length of the union of ``intervals`` clipped to [lo, hi]."""
    total, cur_a, cur_b = 0.0, None, None
    for a, b in sorted((max(a, lo), min(b, hi)) for a, b in intervals):
        if b <= a:
            continue
        if cur_b is None or a > cur_b:
            total += 0.0 if cur_b is None else cur_b - cur_a
            cur_a, cur_b = a, b
        else:
            cur_b = max(cur_b, b)
    return total + (0.0 if cur_b is None else cur_b - cur_a)


def measure(run_dir: Path, batch_samples: int, n_workers: int) -> dict:
    import json

    recs = step_records(run_dir)
    steps = len(recs)
    skip = warmup_steps(steps)  # the steady window the scale simulator predicts, too
    win = recs[skip - 1:]  # the window starts when version `skip` is announced
    n = len(win) - 1
    if n < 1:
        raise RuntimeError(f"{run_dir}: only {steps} timed steps; use more --steps")
    wall = win[-1]["time/wall_s"] - win[0]["time/wall_s"]
    body = win[1:]
    mean = lambda key: statistics.fmean(r.get(key, 0.0) for r in body)  # noqa: E731
    lo, hi = win[0]["time"], win[-1]["time"]
    timeline = Timeline(run_dir)
    busy = timeline.busy_intervals()
    per_worker = {w: merged_seconds(iv, lo, hi) for w, iv in busy.items()}
    workers = max(n_workers, len(per_worker))
    gen_busy = sum(per_worker.values()) / (workers * (hi - lo))
    summary = json.loads(RunDir(run_dir).summary.read_text())
    return {
        "steps_timed": n, "samples_per_s": n * batch_samples / wall, "step_s": wall / n,
        "learner_busy": mean("time/learner_busy_frac"), "gen_busy": gen_busy,
        "G_s": sum(per_worker.values()) / workers / n,
        "T_s": mean("time/learner_train_s") + mean("time/publish_s"),
        "wait_s": mean("time/learner_wait_s"), "train_s": mean("time/learner_train_s"),
        "publish_s": mean("time/publish_s"),
        "max_staleness": max(r.get("staleness/max", 0.0) for r in body),
        "eval_acc": summary.get("eval_accuracy"), "final_reward": summary.get("final_train_reward"),
        "worker_busy_s": per_worker,
        # the controller logs VersionUpdate(k) as the metrics record of step k, stamped "time"
        "sync_breakdown": timeline.sync_breakdown({int(r["step"]): r["time"] for r in recs},
                                                  range(int(win[0]["step"]), int(win[-1]["step"]))),
    }


def main(argv: list[str] | None = None) -> int:
    p = parser("bench_async", __doc__, smoke=True)
    p.add_argument("--etas", default=None, help="staleness bounds; 0 (synchronous) is the baseline "
                                                "(default 0,1,2,4; smoke 0,1)")
    p.add_argument("--steps", type=int, default=None, help="learner steps per run (default 120, quick 50, smoke 6)")
    p.add_argument("--workers", type=int, default=None, help="generation workers (default 2; rollout and smollm2 regimes: 1)")
    p.add_argument("--regime", choices=tuple(REGIMES), default="learner",
                   help="learner: the default task sizes (the learner's step dominates on this machine); rollout: "
                        f"{' '.join(ROLLOUT_REGIME)} and one worker; smollm2: {' '.join(REGIMES['smollm2'])} and "
                        "one worker (G >= 2T is checked and reported as rollout_bound)")
    p.add_argument("--quant-formats", default=None,
                   help="comma list of worker formats (quant.fmt), one eta sweep each; the table adds samples/s "
                        "vs the first format at the same eta (default: the config's; rollout and smollm2 regimes: fp32,int8)")
    p.add_argument("--heartbeat-s", default=None,
                   help="comma list of rollout.heartbeat_s values, one eta sweep each (default 1.0,0.05; quick "
                        "and smoke 1.0). The controller learns a worker's weight version from its heartbeat, so "
                        "this bounds how long an eta=0 step waits for it")
    p.add_argument("--set", nargs="*", default=[], metavar="KEY=VALUE",
                   help="extra asyncrl train overrides for every run (e.g. quant.fmt=nvfp4 algo=tis)")
    args = p.parse_args(argv)
    exit_on_sigterm()
    workers = args.workers or (2 if args.regime == "learner" else 1)
    regime = list(REGIMES[args.regime])
    fmts = [f for f in (args.quant_formats or ("" if args.regime == "learner" else "fp32,int8")).split(",") if f]
    etas = [int(e) for e in (args.etas or ("0,1" if args.smoke else "0,1,2,4")).split(",") if e]
    steps = args.steps or (6 if args.smoke else 50 if args.quick else 120)
    hbs = [float(h) for h in (args.heartbeat_s or ("1.0" if args.smoke or args.quick else "1.0,0.05")).split(",")]
    from asyncrl.config.loader import load_train_config

    base = [f"learner.total_steps={steps}", f"rollout.num_workers={workers}", "learner.eval_every=0",
            "learner.ckpt_every=0", *regime, *args.set]
    cfg = load_train_config(base)  # fails here, not in a child, on a bad override
    batch = cfg.rollout.groups_per_step * cfg.algo.group_size
    rows, logs = [], {}
    with tempfile.TemporaryDirectory(prefix="bench_async-") as tmp:
        for fmt in fmts or [cfg.quant.fmt]:
            for hb in hbs:
                for eta in etas:
                    name = f"{fmt}-eta{eta}-hb{hb:g}"
                    extra = [f"rollout.eta={eta}", f"rollout.heartbeat_s={hb}", *([f"quant={fmt}"] if fmts else [])]
                    print(f"  run {name}: asyncrl train {' '.join(base)} {' '.join(extra)}", flush=True)
                    run_dir = run_train([*base, *extra], runs_dir=Path(tmp), run_name=name,
                                        log_path=Path(tmp) / f"{name}.log")
                    m = measure(run_dir, batch, workers)
                    rows.append({"fmt": fmt, "heartbeat_s": hb, "eta": eta, **m})
                    print(f"    {m['samples_per_s']:.1f} samples/s, step {m['step_s']:.3f}s, G {m['G_s']:.3f}s, "
                          f"T {m['T_s']:.3f}s, learner busy {m['learner_busy']:.2f}, gen busy {m['gen_busy']:.2f}",
                          flush=True)
                    logs[name] = str(run_dir)
    for fmt, hb in {(r["fmt"], r["heartbeat_s"]) for r in rows}:
        series = [r for r in rows if r["heartbeat_s"] == hb and r["fmt"] == fmt]
        ref = next((r for r in series if r["eta"] == 0), series[0])
        g, t = ref["G_s"], ref["T_s"]
        for r in series:
            r["G_over_T"] = g / t if t else float("nan")
            r["rollout_bound"] = bool(g >= 2 * t)
            first = next((x for x in rows if x["fmt"] == rows[0]["fmt"] and x["heartbeat_s"] == hb
                          and x["eta"] == r["eta"]), r)
            r["vs_first_fmt"] = r["samples_per_s"] / first["samples_per_s"]
            r["speedup"] = r["samples_per_s"] / ref["samples_per_s"]
            r["bound"] = (g + t) / max(g, t)
            r["latency_bound"] = ref["step_s"] / max(g, t)
            r["own_bound"] = (r["G_s"] + r["T_s"]) / max(r["G_s"], r["T_s"])
            r["efficiency"] = max(r["G_s"], r["T_s"]) / r["step_s"]
    table = [{k: v for k, v in r.items() if k not in ("worker_busy_s", "sync_breakdown")} for r in rows]
    print_table(
        f"asyncrl train at eta in {etas} (regime {args.regime}): {cfg.model.name} model, task "
        f"{cfg.task.name}, {workers} workers of format {','.join(fmts) or cfg.quant.fmt}, {cfg.algo.objective}, {steps} steps ({batch} samples/step); speedup vs eta=0 "
        f"next to the pipelining bound (G+T)/max(G,T) from the eta=0 run's stage times",
        table, ["fmt", "heartbeat_s", "eta", "samples_per_s", "vs_first_fmt", "speedup", "bound", "latency_bound",
                "efficiency", "G_over_T", "rollout_bound",
                "learner_busy", "gen_busy", "G_s", "T_s", "wait_s", "step_s", "max_staleness", "eval_acc"])
    sync = [{"heartbeat_s": r["heartbeat_s"], "step_s": r["step_s"], **r["sync_breakdown"],
             "G_s": r["G_s"], "T_s": r["T_s"]} for r in rows if r["eta"] == 0 and r["sync_breakdown"]]
    if sync:
        print_table(
            "where a synchronous (eta=0) step goes: consecutive segments from the trajectory log and the controller's "
            "metrics timestamps (mean over the window)", sync,
            ["heartbeat_s", "step_s", "learner_s", "propagate_s", "generate_s", "collect_s", "G_s", "T_s"])
    write_json(args.json, "bench_async", {"runs": rows, "sync_breakdown": sync}, args, steps=steps,
               workers=workers, overrides=base, batch_samples=batch, heartbeats=hbs, etas=etas,
               regime=args.regime, formats=fmts)
    return 0


if __name__ == "__main__":
    sys.exit(main())
