#!/usr/bin/env python
"""The algorithm comparison in miniature: objectives on quantized, stale rollouts vs a synchronous fp32 run.

Every point is a real ``asyncrl train`` run (subprocess, run folder in a temporary directory) on the
embedded tiny model, at a fixed budget of learner steps, for several seeds (``seed=S``: the tiny
model's initialisation, its warm start and the sampling seed). Configurations (``--configs``):

  sync-fp32        rollout.eta=0 quant=fp32 algo=ppo      the synchronous full-precision baseline
  ppo-nvfp4        eta=4 quant=nvfp4 algo=ppo             "naive": PPO objective on quantized stale rollouts
  decoupled-nvfp4  eta=4 quant=nvfp4 algo=decoupled       AReaL decoupled PPO
  tis-nvfp4        eta=4 quant=nvfp4 algo=tis             truncated importance sampling
  acr-nvfp4        eta=4 quant=nvfp4 algo=acr             QuRL adaptive clipping range
  tbpo-nvfp4       eta=4 quant=nvfp4 algo=tbpo            QaRL trust-band policy optimisation
  acr-uaq-nvfp4    eta=4 quant=nvfp4 algo=acr quant.uaq=true   ACR + update-aware quantization
  ppo-int8, acr-int8   the same at eta=4 with int8 workers (tis-int8 too, not in the default set)

Every run also gets ``learner.ckpt_every=0`` (checkpoint only at the end), an evaluation every
quarter of the budget, and ``rollout.heartbeat_s=0.05`` (workers report their weight version within
50 ms; this shortens the synchronous baseline's steps and changes no objective).

Reported per configuration (mean and sample std over seeds): final greedy eval accuracy on the
task's evaluation set, the final sampled training reward (mean of the last 5 steps), the mean
training reward over the whole budget (``reward_auc``, a learning-speed measure), and the
token-weighted mean KL(behaviour || proximal) (k3 estimator) over training, overall and split by
staleness eta=j (``mismatch/by_staleness/eta=j/kl_k3``). Key column: ``eval_vs_sync`` = mean eval
accuracy / the sync-fp32 baseline's. Plots: reward curves, eval accuracy, and KL by staleness
under ``benchmarks/plots/``.

Run: ``python scripts/bench_algos.py [--quick|--smoke] [--steps N] [--seeds 0,1,2] [--configs a,b]
[--task addition] [--set key=value ...] [--json PATH] [--plots DIR]``.
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

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from scripts import benchlib  # noqa: E402

CONFIGS: dict[str, list[str]] = {
    "sync-fp32": ["rollout.eta=0", "quant=fp32", "algo=ppo"],
    "ppo-nvfp4": ["rollout.eta=4", "quant=nvfp4", "algo=ppo"],
    "decoupled-nvfp4": ["rollout.eta=4", "quant=nvfp4", "algo=decoupled"],
    "tis-nvfp4": ["rollout.eta=4", "quant=nvfp4", "algo=tis"],
    "acr-nvfp4": ["rollout.eta=4", "quant=nvfp4", "algo=acr"],
    "tbpo-nvfp4": ["rollout.eta=4", "quant=nvfp4", "algo=tbpo"],
    "acr-uaq-nvfp4": ["rollout.eta=4", "quant=nvfp4", "algo=acr", "quant.uaq=true"],
    "ppo-int8": ["rollout.eta=4", "quant=int8", "algo=ppo"],
    "tis-int8": ["rollout.eta=4", "quant=int8", "algo=tis"],
    "acr-int8": ["rollout.eta=4", "quant=int8", "algo=acr"],
}
DEFAULT = [c for c in CONFIGS if c != "tis-int8"]  # 9 x 3 seeds x 120 steps: ~32 min on 2 idle cores
BASELINE = "sync-fp32"
STALE_KL = re.compile(r"^mismatch/by_staleness/eta=(\d+)/kl_k3$")


def run_curves(run_dir: Path) -> dict:
    """Per-step curves and end-of-run numbers of one run, from its metrics.jsonl and summary.json."""
    from asyncrl.metrics import read_metrics

    recs = read_metrics(run_dir)
    steps = [r for r in recs if r.get("train/reward_mean") is not None]
    evals = [(int(r["step"]), r["eval/accuracy"]) for r in recs if r.get("eval/accuracy") is not None]
    kl, kl_stale = [], {}
    for r in steps:
        if r.get("mismatch/kl_k3") is not None:
            kl.append((int(r["step"]), r["mismatch/kl_k3"], r.get("actor/tokens", 0.0)))
        for k, v in r.items():
            m = STALE_KL.match(k)
            if m and v is not None:
                tokens = r.get(f"mismatch/by_staleness/eta={m.group(1)}/tokens", 0.0) or 0.0
                kl_stale.setdefault(m.group(1), []).append((int(r["step"]), v, tokens))
    summary = json.loads((run_dir / "summary.json").read_text())
    return {"reward": [(int(r["step"]), r["train/reward_mean"]) for r in steps], "eval": evals, "kl": kl,
            "kl_by_staleness": kl_stale, "eval_acc": summary.get("eval_accuracy"),
            "final_reward": summary.get("final_train_reward"), "wall_s": summary.get("wall_seconds"),
            "max_staleness": summary.get("max_consumed_staleness")}


def weighted_mean(points: list[tuple[int, float, float]]) -> float:
    w = sum(t for _, _, t in points)
    return sum(v * t for _, v, t in points) / w if w > 0 else float("nan")


def mean_std(xs: list[float]) -> tuple[float, float]:
    xs = [x for x in xs if x is not None and math.isfinite(x)]
    if not xs:
        return float("nan"), float("nan")
    return statistics.fmean(xs), statistics.stdev(xs) if len(xs) > 1 else 0.0


def aggregate(runs: dict[str, list[dict]]) -> list[dict]:
    rows = []
    base_eval = mean_std([r["eval_acc"] for r in runs.get(BASELINE, [])])[0]
    base_auc = mean_std([statistics.fmean(v for _, v in r["reward"]) for r in runs.get(BASELINE, [])
                         if r["reward"]])[0]
    for name, rs in runs.items():
        ev, ev_sd = mean_std([r["eval_acc"] for r in rs])
        fr, fr_sd = mean_std([r["final_reward"] for r in rs])
        auc, auc_sd = mean_std([statistics.fmean(v for _, v in r["reward"]) for r in rs if r["reward"]])
        kl = mean_std([weighted_mean(r["kl"]) for r in rs if r["kl"]])[0]
        row = {"config": name, "seeds": len(rs), "eval_acc": ev, "eval_std": ev_sd,
               "eval_vs_sync": ev / base_eval if base_eval else float("nan"), "final_reward": fr,
               "final_reward_std": fr_sd, "reward_auc": auc, "reward_auc_std": auc_sd,
               "auc_vs_sync": auc / base_auc if base_auc else float("nan"), "kl_k3": kl,
               "wall_s": statistics.fmean(r["wall_s"] for r in rs if r["wall_s"] is not None)}
        for j in range(0, 5):
            vals = [weighted_mean(r["kl_by_staleness"].get(str(j), [])) for r in rs]
            row[f"kl_eta{j}"] = mean_std([v for v in vals if math.isfinite(v)])[0]
        rows.append(row)
    return rows


def _smooth(xs: list[float], k: int) -> list[float]:
    return [statistics.fmean(xs[max(0, i - k + 1): i + 1]) for i in range(len(xs))]


def make_plots(runs: dict[str, list[dict]], out_dir: Path, prefix: str) -> list[str]:
    """reward curves (seed mean, moving average), eval accuracy bars, KL by staleness per config."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    out_dir.mkdir(parents=True, exist_ok=True)
    written = []
    # 1. reward curves
    fig = Figure(figsize=(9, 5))
    ax = fig.add_subplot(1, 1, 1)
    for name, rs in runs.items():
        n = min(len(r["reward"]) for r in rs)
        if n == 0:
            continue
        mean = [statistics.fmean(r["reward"][i][1] for r in rs) for i in range(n)]
        style = {"color": "black", "linewidth": 2.5} if name == BASELINE else {}
        ax.plot([rs[0]["reward"][i][0] for i in range(n)], _smooth(mean, 10), label=name,
                linestyle="--" if "int8" in name else "-", **style)
    ax.set_xlabel("learner step")
    ax.set_ylabel("sampled train reward (seed mean, 10-step moving average)")
    ax.set_title("Training reward")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8, ncol=2)
    path = out_dir / f"{prefix}_reward.png"
    FigureCanvasAgg(fig).print_png(str(path))
    written.append(str(path))
    # 2. eval accuracy (mean +- std over seeds, each seed as a dot)
    fig = Figure(figsize=(9, 4.5))
    ax = fig.add_subplot(1, 1, 1)
    names = list(runs)
    for i, name in enumerate(names):
        vals = [r["eval_acc"] for r in runs[name] if r["eval_acc"] is not None]
        if not vals:
            continue
        m, s = mean_std(vals)
        ax.bar(i, m, yerr=s, color="0.3" if name == BASELINE else "tab:blue", alpha=0.7, capsize=4)
        ax.scatter([i] * len(vals), vals, color="black", s=12, zorder=3)
    ax.set_xticks(range(len(names)))
    ax.set_xticklabels(names, rotation=30, ha="right", fontsize=8)
    ax.set_ylabel("final greedy eval accuracy")
    ax.set_ylim(0, 1.05)
    ax.grid(axis="y", alpha=0.3)
    fig.tight_layout()
    path = out_dir / f"{prefix}_eval.png"
    FigureCanvasAgg(fig).print_png(str(path))
    written.append(str(path))
    # 3. KL(behaviour || proximal) by staleness, one panel per configuration that logs it
    with_kl = [n for n in names if any(r["kl_by_staleness"] for r in runs[n])]
    if with_kl:
        cols = min(3, len(with_kl))
        rows_n = math.ceil(len(with_kl) / cols)
        fig = Figure(figsize=(4.2 * cols, 3.2 * rows_n))
        for i, name in enumerate(with_kl):
            ax = fig.add_subplot(rows_n, cols, i + 1)
            for j in sorted({j for r in runs[name] for j in r["kl_by_staleness"]}, key=int):
                pts = sorted(p for r in runs[name] for p in r["kl_by_staleness"].get(j, []))
                if pts:
                    ax.plot([p[0] for p in pts], [max(p[1], 1e-6) for p in pts], ".", markersize=3,
                            label=f"eta={j}")
            ax.set_yscale("log")
            ax.set_title(name, fontsize=9)
            ax.grid(alpha=0.3)
            if i == 0:
                ax.set_ylabel("KL(behav || prox), k3")
            ax.legend(fontsize=6, markerscale=2)
        fig.suptitle("KL(behaviour || proximal) per step by token staleness (all seeds)", fontsize=10)
        fig.tight_layout()
        path = out_dir / f"{prefix}_kl_by_staleness.png"
        FigureCanvasAgg(fig).print_png(str(path))
        written.append(str(path))
    return written


def main(argv: list[str] | None = None) -> int:
    p = benchlib.parser("bench_algos", __doc__.split("\n\n")[0], smoke=True)
    p.epilog = __doc__.split("\n\n", 1)[1]
    p.add_argument("--steps", type=int, default=None, help="learner steps per run (default 120, quick 40, smoke 4)")
    p.add_argument("--seeds", default=None, help="comma list (default 0,1,2; quick and smoke 0)")
    p.add_argument("--configs", default=None, help=f"comma list of {', '.join(CONFIGS)} (default: all but tis-int8; smoke: "
                                                   f"{BASELINE},acr-nvfp4)")
    p.add_argument("--task", default="addition", help="task config group (default %(default)s)")
    p.add_argument("--set", nargs="*", default=[], metavar="KEY=VALUE", help="extra overrides for every run")
    p.add_argument("--plots", default=str(benchlib.ROOT / "benchmarks" / "plots"),
                   help="folder for the PNG plots (default %(default)s)")
    args = p.parse_args(argv)
    benchlib.exit_on_sigterm()
    steps = args.steps or (4 if args.smoke else 40 if args.quick else 120)
    seeds = [int(s) for s in (args.seeds or ("0" if args.quick or args.smoke else "0,1,2")).split(",") if s]
    names = [c for c in (args.configs or (f"{BASELINE},acr-nvfp4" if args.smoke else ",".join(DEFAULT))).split(",")
             if c]
    bad = [c for c in names if c not in CONFIGS]
    if bad:
        raise SystemExit(f"unknown config(s) {bad}; choose from {list(CONFIGS)}")
    common = [f"task={args.task}", f"learner.total_steps={steps}", "learner.ckpt_every=0",
              f"learner.eval_every={max(1, steps // 4)}", "rollout.heartbeat_s=0.05", *args.set]
    from asyncrl.config import load_train_config

    for n in names:
        load_train_config([*common, *CONFIGS[n]])  # a bad override fails now, not after an hour
    runs: dict[str, list[dict]] = {n: [] for n in names}
    t_start = time.monotonic()
    prefix = "algos_smoke" if args.smoke else "algos_quick" if args.quick else "algos"
    with tempfile.TemporaryDirectory(prefix="bench_algos-") as tmp:
        for seed in seeds:  # seed-major: a partial run still compares every configuration
            for n in names:
                name = f"{n}-s{seed}"
                t0 = time.monotonic()
                run_dir = benchlib.run_train([*common, *CONFIGS[n], f"seed={seed}", f"learner.seed={seed}"],
                                             runs_dir=Path(tmp), run_name=name, log_path=Path(tmp) / f"{name}.log")
                r = run_curves(run_dir)
                r["seed"] = seed
                runs[n].append(r)
                print(f"  {name}: eval {r['eval_acc']}, final reward {r['final_reward']:.3f} "
                      f"({time.monotonic() - t0:.0f}s; {time.monotonic() - t_start:.0f}s total)", flush=True)
    rows = aggregate(runs)
    benchlib.print_table(
        f"{args.task}, tiny model, {steps} learner steps, seeds {seeds}: final greedy eval accuracy (mean, std) "
        f"vs the synchronous fp32 baseline, reward, and token-weighted KL(behav||prox) by staleness",
        rows, ["config", "seeds", "eval_acc", "eval_std", "eval_vs_sync", "final_reward", "reward_auc",
               "auc_vs_sync", "kl_k3", "kl_eta0", "kl_eta1", "kl_eta2", "kl_eta3", "kl_eta4", "wall_s"])
    plots = make_plots(runs, Path(args.plots), prefix)
    print("plots: " + ", ".join(plots))
    benchlib.write_json(args.json, "bench_algos", {"summary": rows}, args, steps=steps, seeds=seeds,
                        configs={n: CONFIGS[n] for n in names}, common_overrides=common, plots=plots,
                        runs=runs, total_s=time.monotonic() - t_start)
    return 0


if __name__ == "__main__":
    sys.exit(main())
