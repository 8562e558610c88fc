#!/usr/bin/env python
"""A recipe search: named settings of a SmolLM2 task, several seeds each, at one budget per run.

Every point is a real ``asyncrl train`` run of SmolLM2-135M-Instruct (one int8 W8A8 worker, eta 2, ACR,
constant learning rate, greedy evaluation of the preset's 200 held-out problems at step 0, every 50
steps and at the end), stopped by ``learner.time_budget_s`` or after ``--steps``. A row is a named setting:

  lora-2e-4      LoRA r=16, alpha 32, lr 2e-4: the README's SmolLM2 recipe
  lora-5e-5      the same at a quarter of the learning rate
  lora-2e-4-ds   the recipe with the zero-variance alarm's advice: dynamic sampling (DAPO's filter) and
                 groups of 16 (2 groups per step, the same 32 samples)
  full-2e-5      full fine-tuning at the preset's lr 2e-5
  curriculum     the recipe on the two-term signed sums for the first half of the budget, then on the
                 preset task from the model that run exported (model.name=path model.path=...);
                 ``--curriculum-first RUN`` starts every seed's second stage from one finished first stage

``--seeds`` varies ``rollout.seed`` and ``learner.seed`` (sampling and LoRA initialisation); the training
and held-out problems stay the same. ``--parallel K`` runs K at a time and gives each K x ``--budget-s`` of
wall time, so each has about ``--budget-s`` of the machine (the runs of one batch share it evenly: every
run has a learner and a worker busy all the time). ``--steps N`` gives every run N learner steps instead
of a time budget (the curriculum N/2 per stage): a fixed amount of training whatever else runs beside it,
for a claim of the form "does not learn in N steps", which holds for any shorter budget. ``--summarize
DIR`` only reads the run folders an earlier call left in DIR.

Reported per run: learner steps, greedy accuracy at step 0 and at the end with its Wilson 95% interval,
the sampled reward over the first and the last 20 steps, the mean response length over the first 5 and
the last 20 steps, and the training-health alarms the run's metrics raise under the current rules
(name@first step). Per row: the mean final accuracy over seeds with its 95% interval (Student's t) and
the mean gain over step 0. A row learns when the lower end of its interval (of one seed: its Wilson
interval) is above the step-0 accuracy; the closing lines say which rows do.
"""

from __future__ import annotations

import json
import math
import statistics
import sys
import time
from pathlib import Path

from asyncrl.bench.measure import ci95, wilson
from asyncrl.bench.report import parser, print_table, write_json
from asyncrl.bench.runs import exit_on_sigterm, start_train, stop_train, train_result
from asyncrl.rundir import RunDir

SIGNED_2 = "task.rg_config={min_terms:2,max_terms:2,min_digits:1,max_digits:1,allow_negation:true}"
SIGNED_3 = "task.rg_config={min_terms:3,max_terms:3,min_digits:1,max_digits:1,allow_negation:true}"
PRESETS = {"signed_sums_3": ["+experiment=smollm2_signed_sums", SIGNED_3],
           "signed_sums": ["+experiment=smollm2_signed_sums", SIGNED_2]}
COMMON = ["quant.fmt=int8", "rollout.eta=2", "algo=acr", "learner.lr_schedule=constant", "learner.eval_every=50",
          "learner.ckpt_every=0"]
LORA = ["learner.lora.rank=16", "learner.lora.alpha=32", "learner.lr=2e-4"]
ROWS: dict[str, list[str]] = {
    "lora-2e-4": LORA,
    "lora-5e-5": [*LORA, "learner.lr=5e-5"],
    "lora-2e-4-ds": [*LORA, "algo.dynamic_sampling=true", "algo.group_size=16", "rollout.groups_per_step=2"],
    "full-2e-5": [],
    "curriculum": LORA,
}
CURRICULUM_FIRST = "signed_sums"  # the curriculum row's first stage, on half the budget
SMOKE = ["model=tiny", "task=addition", "task.eval_size=8"]  # every code path, seconds


def plan(row: str, seed: int, preset: list[str], first: list[str], budget: list[str],
         first_model: str = "") -> list[tuple[str, list[str]]]:
    """The stages of one run: (run name, overrides) in order, each with the ``budget`` overrides of one
    stage; a later stage's model is the previous stage's export (added when it starts); ``first`` is the
    curriculum's first task, ``first_model`` a finished first stage's exported model to start from instead."""
    name = f"{row}-s{seed}"
    setting = [*COMMON, *ROWS[row], f"rollout.seed={seed}", f"learner.seed={seed}", *budget]
    if row == "curriculum" and first_model:
        return [(name, [*preset, *setting, "model.name=path", f"model.path={first_model}"])]
    if row == "curriculum":
        return [(f"{name}-a", [*first, *setting]), (name, [*preset, *setting])]
    return [(name, [*preset, *setting])]


def budget_overrides(steps: int, budget_s: float, parallel: int, stages: int) -> list[str]:
    """One stage's budget: ``steps`` learner steps (split over the stages), else the wall-clock share of
    ``budget_s`` machine-seconds when ``parallel`` runs share the machine."""
    if steps:
        return [f"learner.total_steps={max(1, steps // stages)}"]
    return ["learner.total_steps=100000", f"learner.time_budget_s={budget_s * parallel / stages:.3f}"]


def run_all(jobs: list[list[tuple[str, list[str]]]], runs_dir: Path, parallel: int) -> None:
    """Run every job (its stages in order), ``parallel`` at a time; stop what is running on any exit."""
    pending, running = list(jobs), []  # running: (Popen, log file, stages left, name, overrides)
    try:
        while pending or running:
            while pending and len(running) < parallel:
                running.append(_start(pending.pop(0), runs_dir, None))
            time.sleep(2.0)
            for entry in list(running):
                proc, log, stages, name, overrides = entry
                if proc.poll() is None:
                    continue
                log.close()
                running.remove(entry)
                run_dir = train_result(proc.returncode, overrides, runs_dir=runs_dir, run_name=name,
                                       log_path=Path(log.name))
                print(f"  {name}: done ({summarize_run(run_dir)['steps']} steps)", flush=True)
                if stages:
                    running.append(_start(stages, runs_dir, RunDir(run_dir).model))
    finally:
        for proc, log, *_ in running:
            stop_train(proc)
            log.close()


def _start(stages, runs_dir: Path, model: Path | None):
    name, overrides = stages[0]
    if model is not None:
        overrides = [*overrides, "model.name=path", f"model.path={model}"]
    log = open(runs_dir / f"{name}.log", "wb")  # noqa: SIM115  (closed when the run ends or is stopped)
    print(f"  {name}: started", flush=True)
    proc = start_train(overrides, runs_dir=runs_dir, run_name=name, log=log)
    return proc, log, stages[1:], name, overrides


def summarize_run(run_dir: Path) -> dict:
    """One run's figures from its metrics.jsonl, summary.json and config.json."""
    from asyncrl.metrics import read_metrics
    from asyncrl.metrics.health import health_config, replay

    recs = read_metrics(run_dir)
    steps = [r for r in recs if r.get("train/reward_mean") is not None]
    evals = [r for r in recs if r.get("eval/accuracy") is not None]
    summary = json.loads(RunDir(run_dir).summary.read_text()) if RunDir(run_dir).summary.exists() else {}
    n = int(evals[0].get("eval/n") or 0) if evals else 0
    # the final evaluation; a run stopped early (SIGTERM) has none: its last periodic one
    final = summary.get("eval_accuracy", evals[-1]["eval/accuracy"] if evals else None)
    # the alarms by the current rules (a replay of the metrics, as `asyncrl log show` does for a run
    # without health.jsonl), so that runs recorded under older rules compare
    config = json.loads(RunDir(run_dir).config.read_text())
    first_alarm: dict[str, int] = {}
    for a in replay(recs, health_config(config.get("health"))):
        first_alarm.setdefault(a.name, a.step)

    def mean(key: str, lo: int, hi: int | None) -> float:
        vals = [r[key] for r in steps[lo:hi] if r.get(key) is not None]
        return statistics.fmean(vals) if vals else math.nan

    return {"run": run_dir.name, "steps": len(steps), "eval_n": n,
            "eval_step0": evals[0]["eval/accuracy"] if evals and int(evals[0]["step"]) == 0 else math.nan,
            "eval_final": final if final is not None else math.nan,
            "eval_final_ci95": list(wilson(round(final * n), n)) if final is not None else [math.nan] * 2,
            "reward_first20": mean("train/reward_mean", 0, 20), "reward_last20": mean("train/reward_mean", -20, None),
            "len_first5": mean("train/response_len_mean", 0, 5), "len_last20": mean("train/response_len_mean", -20, None),
            "alarms": " ".join(f"{k}@{v}" for k, v in first_alarm.items()) or "-"}


def summarize(runs_dir: Path, rows: list[str], seeds: list[int]) -> tuple[list[dict], list[dict]]:
    """Per-run and per-row tables of the finished runs in ``runs_dir``."""
    per_run, per_row = [], []
    for row in rows:
        runs = [summarize_run(runs_dir / f"{row}-s{s}") for s in seeds
                if (runs_dir / f"{row}-s{s}" / "metrics.jsonl").exists()]
        for r in runs:
            per_run.append({"row": row, **r})
        if not runs:
            continue
        acc, acc_ci = ci95([r["eval_final"] for r in runs])
        base = ci95([r["eval_step0"] for r in runs])[0]
        # several seeds: the Student-t interval over seeds; one seed: its own Wilson interval
        low = acc - acc_ci if len(runs) > 1 else runs[0]["eval_final_ci95"][0]
        per_row.append({"row": row, "seeds": len(runs), "eval_step0": base, "eval_final_mean": acc,
                        "eval_final_ci95": acc_ci, "gain": acc - base, "learns": bool(low > base),
                        "steps_mean": statistics.fmean(r["steps"] for r in runs)})
    return per_run, per_row


def main(argv: list[str] | None = None) -> int:
    p = parser("bench_recipes", __doc__, smoke=True)
    p.add_argument("--preset", default="signed_sums_3", choices=sorted(PRESETS), help="the task (default %(default)s)")
    p.add_argument("--rows", default="lora-2e-4", help=f"comma list of {', '.join(ROWS)} (default %(default)s)")
    p.add_argument("--seeds", default="0,1", help="comma list (default %(default)s)")
    p.add_argument("--budget-s", type=float, default=1800.0, help="machine seconds per run (default %(default)s)")
    p.add_argument("--parallel", type=int, default=1, help="runs at a time, each given that many times its budget")
    p.add_argument("--steps", type=int, default=0, help="learner steps per run instead of --budget-s (default: off; "
                   "--quick: 30)")
    p.add_argument("--curriculum-first", default="", metavar="RUN",
                   help="a finished run of the curriculum's first stage: every seed's second stage starts from its "
                        "exported model (and gets the whole budget)")
    p.add_argument("--keep", default="", help="run folder root (default: a new temporary folder)")
    p.add_argument("--summarize", default="", metavar="DIR", help="only summarize the runs already in DIR")
    args = p.parse_args(argv)
    exit_on_sigterm()
    rows = [r for r in args.rows.split(",") if r]
    if bad := [r for r in rows if r not in ROWS]:
        raise SystemExit(f"unknown row(s) {bad}; choose from {list(ROWS)}")
    seeds = [int(s) for s in args.seeds.split(",") if s]
    if args.parallel < 1:
        raise SystemExit("--parallel must be >= 1")
    budget = 20.0 if args.smoke else args.budget_s
    if args.quick and not args.steps:  # minutes: 30 steps of each run, enough to see it start
        args.steps = 30
    preset, first = (SMOKE, SMOKE) if args.smoke else (PRESETS[args.preset], PRESETS[CURRICULUM_FIRST])
    if args.summarize:
        runs_dir = Path(args.summarize)
    else:
        import tempfile

        from asyncrl.config.loader import load_train_config

        runs_dir = Path(args.keep or tempfile.mkdtemp(prefix="bench_recipes-"))
        runs_dir.mkdir(parents=True, exist_ok=True)
        first_model = str(RunDir(Path(args.curriculum_first).resolve()).model) if args.curriculum_first else ""
        jobs = [plan(r, s, preset, first, budget_overrides(args.steps, budget, args.parallel,
                                                          2 if r == "curriculum" and not first_model else 1), first_model)
                for r in rows for s in seeds]
        for stages in jobs:
            for _, overrides in stages:  # a bad override fails now, not an hour in
                load_train_config(overrides)
        each = f"{args.steps} learner steps" if args.steps else f"{budget:.0f} machine-seconds"
        print(f"{len(jobs)} runs of {each}, {args.parallel} at a time, in {runs_dir}", flush=True)
        run_all(jobs, runs_dir, args.parallel)
    per_run, per_row = summarize(runs_dir, rows, seeds)
    print_table("runs", per_run, ["row", "run", "steps", "eval_step0", "eval_final", "eval_final_ci95",
                                           "reward_first20", "reward_last20", "len_first5", "len_last20", "alarms"])
    print_table("rows (final greedy accuracy: mean over seeds, 95% CI half-width from Student's t)", per_row,
                ["row", "seeds", "steps_mean", "eval_step0", "eval_final_mean", "eval_final_ci95", "gain",
                          "learns"])
    for r in per_row:
        verdict = "learns" if r["learns"] else "does not learn beyond the noise"
        spread = f"+- {r['eval_final_ci95']:.3f} over {r['seeds']} seeds" if r["seeds"] > 1 else "one seed, Wilson"
        print(f"  {r['row']}: {verdict} ({r['eval_step0']:.3f} -> {r['eval_final_mean']:.3f}, {spread})")
    if args.smoke and args.json == p.get_default("json"):  # never over the full run's record
        args.json = args.json.replace(".json", ".smoke.json")
    write_json(args.json, "bench_recipes",
               {"runs": per_run, "rows": per_row}, args, preset=preset, common=COMMON,
               rows={r: ROWS[r] for r in rows}, seeds=seeds, budget_s=None if args.steps else budget,
               steps=args.steps or None, parallel=args.parallel,
               runs_dir=str(runs_dir))
    return 0


if __name__ == "__main__":
    sys.exit(main())
