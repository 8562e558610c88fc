#!/usr/bin/env python
"""The algorithm comparison: objectives on quantized, stale rollouts vs a synchronous fp32 run, with CIs.

Every point is a real ``asyncrl train`` run (subprocess, run folder in a temporary directory) on the
embedded tiny model, at a fixed budget of learner steps, for several seeds. A configuration is named
``OBJ-FMT-etaN`` (e.g. ``tis-nvfp4-eta4``) or ``sync-fp32``; an optional suffix ``-tm`` / ``-smtm``
overrides the common aggregation for that configuration (the second row where the aggregation matters):

  sync-fp32      rollout.eta=0 quant=fp32 algo=ppo      the synchronous full-precision baseline
  ppo-...        algo=ppo                               naive: PPO with the behaviour log-probs as old policy
  decoupled-...  algo=decoupled                         AReaL decoupled PPO
  tis-...        algo=tis                               truncated importance sampling
  acr-...        algo=acr                               QuRL adaptive clipping range
  tbpo-...       algo=tbpo algo.tbpo_w_mode=clamp       QaRL trust bands, mismatch weight truncated (default)
  tbpo_drop-...  algo=tbpo algo.tbpo_w_mode=drop        QaRL trust bands, out-of-band responses dropped
  qarl-...       tbpo (clamp) + learner.rollout_aligned  QaRL whole: trust bands and a rollout-aligned learner

The full grid (the default) is every objective x eta in {0, 4, 8} x workers in {int8, nvfp4}, plus
sync-fp32, 5 seeds each (185 runs of 80 steps; ~4 h on 2 idle cores); ``--objectives/--etas/--formats`` shrink
it and ``--configs`` names cells directly. Every run gets the same settings: ``learner.n_minibatches``
(default 2, so every trust region acts), one aggregation (``--agg``, default token-mean), the task and
its warm start, the learning rate, ``learner.ckpt_every=0``, ``rollout.heartbeat_s=0.05`` and an
evaluation every eighth of the budget. ``seed=S`` varies the tiny model's initialisation, its warm start
and the sampling seed; ``--shared-init`` keeps one warm-started model (``seed=0``) and varies only
``learner.seed`` and ``rollout.seed`` (5 seeds without 5 warm starts).

Reported per configuration: the number of runs, the final greedy eval accuracy (mean, 95% confidence
interval from Student's t over seeds, min..max), the runs that collapsed (mean sampled training reward
over the last 10 steps below ``--collapse-reward``: the absorbing all-zero-reward state in which no
GRPO group carries a gradient), the mean training reward over the run (``reward_auc``) with its CI,
the token-weighted KL(behaviour || proximal) (k3), the run-mean log-prob gaps of docs/algorithms.md §7.1
(``mismatch/lag0`` with its CI over seeds, ``quant``, ``noise``) and, for TBPO, the mean fraction of positive /
negative responses whose mismatch weight was outside the band (clamped or dropped). Plot: eval
accuracy vs step, seed mean with a 95% CI band, per eta. ``--json`` is rewritten after every run;
``--resume A.json,B.json`` reuses the runs of earlier JSONs (same settings) and runs only the missing ones.

``--model smollm2`` runs the same cells on SmolLM2-135M-Instruct instead (the preset
``+experiment=smollm2_signed_sums``: signed single-digit sums with the chat template, 400 training items, 200
held-out questions) with LoRA r=16 / alpha 32 at lr 2e-4 (``--lr`` overrides), no warm start (every seed starts
from the pretrained weights; seeds vary ``learner.seed`` and ``rollout.seed``) and one evaluation, at the end.

Run: ``python scripts/bench_algos.py [--quick|--smoke] [--steps N] [--seeds 0,1,2,3,4] [--objectives ..]
[--etas 0,4,8] [--formats int8,nvfp4] [--configs a,b] [--task addition2] [--set key=value ...]``.
"""

from __future__ import annotations

import json
import math
import re
import statistics
import sys
import tempfile
import time
from pathlib import Path

from asyncrl.bench.measure import ci95
from asyncrl.bench.report import ROOT, parser, print_table, write_json
from asyncrl.bench.runs import exit_on_sigterm, run_train
from asyncrl.rundir import RunDir

OBJECTIVES: dict[str, list[str]] = {
    "ppo": ["algo=ppo"],
    "decoupled": ["algo=decoupled"],
    "tis": ["algo=tis"],
    "acr": ["algo=acr"],
    "tbpo": ["algo=tbpo", "algo.tbpo_w_mode=clamp"],
    "tbpo_drop": ["algo=tbpo", "algo.tbpo_w_mode=drop"],
    "qarl": ["algo=tbpo", "algo.tbpo_w_mode=clamp", "learner.rollout_aligned=true"],
}
FORMATS = ("int8", "nvfp4")
# The model a run trains: the embedded tiny model (its task and warm start are added from the flags) or
# SmolLM2-135M-Instruct on its signed-sums preset with LoRA adapters, and each one's default learning rate.
MODELS: dict[str, list[str]] = {
    "tiny": [],
    "smollm2": ["+experiment=smollm2_signed_sums", "learner.lora.rank=16", "learner.lora.alpha=32"],
}
LR = {"tiny": 1e-4, "smollm2": 2e-4}
ETAS = (0, 4, 8)
AGG_TAGS = {"tm": "token-mean", "smtm": "seq-mean-token-mean"}
BASELINE = "sync-fp32"
NAME = re.compile(r"^(?P<obj>[a-z_]+)-(?P<fmt>[a-z0-9]+)-eta(?P<eta>\d+)(?:-(?P<agg>tm|smtm))?$")
STALE_KL = re.compile(r"^mismatch/by_staleness/eta=(\d+)/kl_k3$")
def config_overrides(name: str, agg: str) -> list[str]:
    """The overrides of one named cell (raises SystemExit naming the grammar for a bad name)."""
    if name == BASELINE:
        return ["rollout.eta=0", "quant=fp32", "algo=ppo", f"algo.agg={agg}"]
    m = NAME.match(name)
    if not m or m["obj"] not in OBJECTIVES or m["fmt"] not in FORMATS:
        raise SystemExit(f"unknown config {name!r}: use {BASELINE} or OBJ-FMT-etaN[-tm|-smtm] with OBJ in "
                         f"{', '.join(OBJECTIVES)} and FMT in {', '.join(FORMATS)} (e.g. tis-nvfp4-eta4)")
    return [f"rollout.eta={m['eta']}", f"quant={m['fmt']}", *OBJECTIVES[m["obj"]],
            f"algo.agg={AGG_TAGS[m['agg']] if m['agg'] else agg}"]


def grid(objectives: list[str], etas: list[int], formats: list[str]) -> list[str]:
    return [BASELINE] + [f"{o}-{f}-eta{e}" for e in etas for f in formats for o in objectives]


def run_curves(run_dir: Path) -> dict:
    """Per-step curves and end-of-run numbers of one run, from its metrics.jsonl and summary.json."""
    from asyncrl.metrics import read_metrics

    recs = read_metrics(run_dir)
    steps = [r for r in recs if r.get("train/reward_mean") is not None]
    summary = json.loads(RunDir(run_dir).summary.read_text())
    evals = [(int(r["step"]), r["eval/accuracy"]) for r in recs if r.get("eval/accuracy") is not None]
    if summary.get("eval_accuracy") is not None and (not evals or evals[-1][0] < len(steps)):
        evals.append((len(steps), summary["eval_accuracy"]))  # the final evaluation, after the last step
    kl, kl_stale, w_out = [], {}, {"pos": [], "neg": []}
    gaps: dict[str, list[float]] = {"lag0": [], "quant": [], "noise": []}
    for r in steps:
        for part, vals in gaps.items():
            if r.get(f"mismatch/{part}") is not None:
                vals.append(r[f"mismatch/{part}"])
        if r.get("mismatch/kl_k3") is not None:
            kl.append((int(r["step"]), r["mismatch/kl_k3"], r.get("actor/tokens", 0.0)))
        for k, v in r.items():
            m = STALE_KL.match(k)
            if m and v is not None:
                tokens = r.get(f"mismatch/by_staleness/eta={m.group(1)}/tokens", 0.0) or 0.0
                kl_stale.setdefault(m.group(1), []).append((int(r["step"]), v, tokens))
        for sign in w_out:
            for key in (f"tbpo/w_clamped_frac/{sign}", f"tbpo/seq_masked_frac/{sign}"):
                if r.get(key) is not None:
                    w_out[sign].append(r[key])
    return {"reward": [(int(r["step"]), r["train/reward_mean"]) for r in steps], "eval": evals, "kl": kl,
            "kl_by_staleness": kl_stale, "w_out": w_out, "gaps": gaps, "eval_acc": summary.get("eval_accuracy"),
            "final_reward": summary.get("final_train_reward"), "wall_s": summary.get("wall_seconds"),
            "entropy": [r["actor/entropy"] for r in steps if r.get("actor/entropy") is not None]}


def weighted_mean(points: list) -> float:
    w = sum(p[2] for p in points)
    return sum(p[1] * p[2] for p in points) / w if w > 0 else float("nan")


def tail_reward(r: dict, k: int = 10) -> float:
    vals = [v for _, v in r["reward"][-k:]]
    return statistics.fmean(vals) if vals else float("nan")


def aggregate(runs: dict[str, list[dict]], collapse_reward: float) -> list[dict]:
    rows = []
    base_eval = ci95([r["eval_acc"] for r in runs.get(BASELINE, [])])[0]
    for name, rs in runs.items():
        if not rs:
            continue
        evals = [r["eval_acc"] for r in rs if r["eval_acc"] is not None]
        ev, ev_ci = ci95(evals)
        auc, auc_ci = ci95([statistics.fmean(v for _, v in r["reward"]) for r in rs if r["reward"]])
        fr, fr_ci = ci95([tail_reward(r) for r in rs])
        row = {"config": name, "runs": len(rs), "eval_acc": ev, "eval_ci95": ev_ci,
               "eval_min": min(evals) if evals else float("nan"), "eval_max": max(evals) if evals else float("nan"),
               "eval_vs_sync": ev / base_eval if base_eval else float("nan"),
               "collapsed": sum(tail_reward(r) < collapse_reward for r in rs),
               "final_reward": fr, "final_reward_ci95": fr_ci, "reward_auc": auc, "reward_auc_ci95": auc_ci,
               "kl_k3": ci95([weighted_mean(r["kl"]) for r in rs if r["kl"]])[0],
               "w_out_pos": ci95([statistics.fmean(r["w_out"]["pos"]) for r in rs if r["w_out"]["pos"]])[0],
               "w_out_neg": ci95([statistics.fmean(r["w_out"]["neg"]) for r in rs if r["w_out"]["neg"]])[0],
               **{f"gap_{part}{tail}": stat for part in ("lag0", "quant", "noise") for tail, stat in zip(
                   ("", "_ci95"), ci95([statistics.fmean(r["gaps"][part]) for r in rs
                                       if r.get("gaps", {}).get(part)]), strict=True)},
               "entropy": ci95([statistics.fmean(r["entropy"]) for r in rs if r.get("entropy")])[0],
               "wall_s": statistics.fmean(r["wall_s"] for r in rs if r["wall_s"] is not None)
               if any(r["wall_s"] is not None for r in rs) else float("nan")}
        rows.append(row)
    return rows


def make_plots(runs: dict[str, list[dict]], out_dir: Path, prefix: str) -> list[str]:
    """Eval accuracy vs step (seed mean, 95% CI band), one panel per staleness bound eta."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    out_dir.mkdir(parents=True, exist_ok=True)
    panels: dict[str, list[str]] = {}
    for name in runs:
        m = NAME.match(name)
        panels.setdefault(f"eta={m['eta']}" if m else "eta=0", []).append(name)
    keys = sorted(panels, key=lambda k: int(k.split("=")[1]))
    fig = Figure(figsize=(5.2 * len(keys), 4.4))
    for i, key in enumerate(keys):
        ax = fig.add_subplot(1, len(keys), i + 1)
        names = panels[key] + ([BASELINE] if BASELINE in runs and BASELINE not in panels[key] else [])
        for name in names:
            by_step: dict[int, list[float]] = {}
            for r in runs[name]:
                for step, acc in r["eval"]:
                    by_step.setdefault(step, []).append(acc)
            steps = sorted(s for s, v in by_step.items() if len(v) == len(runs[name]))
            if not steps:
                continue
            stats = [ci95(by_step[s]) for s in steps]
            mean = [m for m, _ in stats]
            half = [0.0 if math.isnan(h) else h for _, h in stats]
            style = {"color": "black", "linewidth": 2.2} if name == BASELINE else {}
            line = ax.plot(steps, mean, marker=".", linestyle="--" if "int8" in name else "-",
                           label=f"{name} (n={len(runs[name])})", **style)[0]
            ax.fill_between(steps, [m - h for m, h in zip(mean, half, strict=True)],
                            [m + h for m, h in zip(mean, half, strict=True)], color=line.get_color(), alpha=0.15)
        ax.set_title(key, fontsize=10)
        ax.set_xlabel("learner step")
        ax.set_ylim(-0.02, 1.02)
        ax.grid(alpha=0.3)
        if i == 0:
            ax.set_ylabel("greedy eval accuracy (seed mean, 95% CI)")
        ax.legend(fontsize=7)
    fig.tight_layout()
    path = out_dir / f"{prefix}_eval_vs_step.png"
    FigureCanvasAgg(fig).print_png(str(path))
    return [str(path)]


def main(argv: list[str] | None = None) -> int:
    p = parser("bench_algos", __doc__, smoke=True)
    p.add_argument("--steps", type=int, default=None, help="learner steps per run (default 80, quick 40, smoke 4)")
    p.add_argument("--seeds", default=None, help="comma list (default 0,1,2,3,4; quick and smoke 0)")
    p.add_argument("--objectives", default=",".join(OBJECTIVES), help="grid objectives (default: all)")
    p.add_argument("--etas", default=",".join(map(str, ETAS)), help="grid staleness bounds (default %(default)s)")
    p.add_argument("--formats", default=",".join(FORMATS), help="grid worker formats (default %(default)s)")
    p.add_argument("--configs", default=None, help="explicit cells instead of the grid, e.g. sync-fp32,tis-nvfp4-eta4")
    p.add_argument("--model", default="tiny", choices=sorted(MODELS),
                   help="tiny: the embedded model warm-started on --task; smollm2: SmolLM2-135M-Instruct with LoRA on "
                        "the signed-sums preset (default %(default)s)")
    p.add_argument("--task", default="addition2", help="task config group, tiny model (default %(default)s)")
    p.add_argument("--warmstart-steps", type=int, default=1000, help="supervised warm start (default %(default)s)")
    p.add_argument("--lr", type=float, default=None, help="learner.lr (default 1e-4 tiny, 2e-4 smollm2)")
    p.add_argument("--agg", default="token-mean", choices=sorted(AGG_TAGS.values()),
                   help="one aggregation for every objective (default %(default)s)")
    p.add_argument("--n-minibatches", type=int, default=2, help="optimizer updates per step (default %(default)s)")
    p.add_argument("--shared-init", action="store_true",
                   help="one warm-started model (seed=0) for every run; seeds vary learner.seed and rollout.seed")
    p.add_argument("--collapse-reward", type=float, default=0.05,
                   help="a run collapsed if its mean train reward over the last 10 steps is below this")
    p.add_argument("--until", default=None, metavar="HH:MM",
                   help="start no new run after this UTC time (the runs finished so far are reported)")
    p.add_argument("--set", nargs="*", default=[], metavar="KEY=VALUE", help="extra overrides for every run")
    p.add_argument("--resume", default=None, metavar="JSON[,JSON]",
                   help="reuse the runs recorded in these JSON files (same settings); run only the missing ones")
    p.add_argument("--plots", default=str(ROOT / "benchmarks" / "plots"),
                   help="folder for the PNG plots (default %(default)s)")
    args = p.parse_args(argv)
    exit_on_sigterm()
    steps = args.steps or (4 if args.smoke else 40 if args.quick else 80)
    seeds = [int(s) for s in (args.seeds or ("0" if args.quick or args.smoke else "0,1,2,3,4")).split(",") if s]
    if args.configs:
        names = [c for c in args.configs.split(",") if c]
    elif args.smoke:
        names = [BASELINE, "acr-nvfp4-eta4"]
    elif args.quick:
        names = [BASELINE, "tis-nvfp4-eta4", "tbpo-nvfp4-eta4"]
    else:
        names = grid([o for o in args.objectives.split(",") if o], [int(e) for e in args.etas.split(",") if e],
                     [f for f in args.formats.split(",") if f])
    cells = {n: config_overrides(n, args.agg) for n in names}
    warm = "0" if args.smoke else str(args.warmstart_steps)
    model = MODELS[args.model]
    if args.model == "tiny":
        model = [f"task={args.task}", f"model.warmstart_steps={warm}", *model]
    evals_every = max(2, steps // 8) if args.model == "tiny" else 0  # SmolLM2: 200 greedy problems, once
    common = [*model, f"learner.lr={args.lr or LR[args.model]}",
              f"learner.n_minibatches={args.n_minibatches}", f"learner.total_steps={steps}",
              "learner.ckpt_every=0", f"learner.eval_every={evals_every}", "rollout.heartbeat_s=0.05",
              *args.set]
    shared_init = args.shared_init or args.model != "tiny"
    from asyncrl.config.loader import load_train_config

    for n in names:
        load_train_config([*common, *cells[n]])  # a bad override fails now, not after an hour
    runs: dict[str, list[dict]] = {n: [] for n in names}
    for path in [x for x in (args.resume or "").split(",") if x]:
        old = json.loads(Path(path).read_text())
        if old.get("common_overrides") != common:
            raise SystemExit(f"--resume {path}: its runs used {old.get('common_overrides')}, not {common}")
        for n, rs in old.get("runs", {}).items():
            if n in runs:
                have = {r["seed"] for r in runs[n]}
                runs[n] += [r for r in rs if r["seed"] in seeds and r["seed"] not in have]
    t_start = time.monotonic()
    prefix = "algos_smoke" if args.smoke else "algos_quick" if args.quick else "algos"
    if args.model != "tiny":
        prefix += f"_{args.model}"

    def save() -> list[dict]:
        rows = aggregate(runs, args.collapse_reward)
        write_json(args.json, "bench_algos", {"summary": rows}, args, steps=steps, seeds=seeds,
                   configs=cells, common_overrides=common, runs=runs, total_s=time.monotonic() - t_start)
        return rows

    with tempfile.TemporaryDirectory(prefix="bench_algos-") as tmp:
        for seed in seeds:  # seed-major: a partial run still compares every configuration
            for n in names:
                if any(r["seed"] == seed for r in runs[n]):
                    continue
                if args.until and time.strftime("%H:%M", time.gmtime()) >= args.until:
                    print(f"  {n}-s{seed}: not started (--until {args.until} UTC)", flush=True)
                    continue
                name = f"{n}-s{seed}"
                seeding = ([f"learner.seed={seed}", f"rollout.seed={seed}"] if shared_init
                           else [f"seed={seed}", f"learner.seed={seed}", f"rollout.seed={seed}"])
                t0 = time.monotonic()
                run_dir = run_train([*common, *cells[n], *seeding], runs_dir=Path(tmp), run_name=name,
                                    log_path=Path(tmp) / f"{name}.log")
                r = run_curves(run_dir)
                r["seed"] = seed
                runs[n].append(r)
                print(f"  {name}: eval {r['eval_acc']}, last-10 reward {tail_reward(r):.3f} "
                      f"({time.monotonic() - t0:.0f}s; {time.monotonic() - t_start:.0f}s total)", flush=True)
                save()
    rows = save()
    print_table(
        f"{args.task if args.model == 'tiny' else 'signed sums'}, {args.model} model, {steps} learner steps, n_minibatches={args.n_minibatches}, agg={args.agg}, "
        f"seeds {seeds}: final greedy eval accuracy (mean, 95% CI), runs collapsed (last-10 reward < "
        f"{args.collapse_reward}), reward, KL(behav||prox), mean |log-prob gap| per run (lag 0, quant, noise; "
        "docs/algorithms.md §7.1), TBPO w out of band (pos/neg)",
        rows, ["config", "runs", "eval_acc", "eval_ci95", "eval_min", "eval_max", "eval_vs_sync", "collapsed",
               "final_reward", "reward_auc", "reward_auc_ci95", "kl_k3", "gap_lag0", "gap_lag0_ci95", "gap_quant", "gap_noise", "w_out_pos", "w_out_neg", "wall_s"])
    plots = make_plots(runs, Path(args.plots), prefix)
    print("plots: " + ", ".join(plots))
    write_json(args.json, "bench_algos", {"summary": rows}, args, steps=steps, seeds=seeds,
               configs=cells, common_overrides=common, plots=plots, runs=runs,
               total_s=time.monotonic() - t_start)
    return 0


if __name__ == "__main__":
    sys.exit(main())
