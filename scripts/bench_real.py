#!/usr/bin/env python
"""A real model learns: SmolLM2-135M-Instruct trained with asyncrl (LoRA and full) and with TRL, side by side.

Every row trains the same model on the same reasoning-gym task, chat-templated prompts and reward for
the same wall-clock budget on this machine, and is scored before and after by the same greedy
evaluation (``scripts/eval_greedy.py``) on the same fixed held-out problems:

  asyncrl-lora   int8 W8A8 workers (``--quant``), eta=2, ACR, LoRA adapters (``learner.lora.*``)
  asyncrl-full   int8 W8A8 workers, eta=2, ACR, full fine-tuning
  trl-grpo       TRL's GRPOTrainer (full fine-tuning, one process: generate then train), in its own
                 venv ``.cache/trl-venv`` (``make trl-venv``; never a dependency of asyncrl), with the
                 asyncrl run's sizes: group size, prompts per step, max new tokens, temperature, lr,
                 warmup, micro-batch, clip range, gradient clip; scored by asyncrl's task scorer

The budget is enforced for real: asyncrl's controller ends training at the first batch request past
``learner.time_budget_s`` (the learner then checkpoints, exports and stops); TRL's trainer stops at the
first step end past it. Both clocks start when training starts (model loading excluded).

Reported per row: accuracy before/after (share of held-out problems fully correct, greedy) with a
Wilson 95% interval, mean task score, steps done, seconds per step (wall time between consecutive
policy versions, the first step excluded; with one step, that step's own time from the start of
training), learner seconds per step (asyncrl: the learner's busy time;
TRL: the step's time outside generate), rollout tokens/s (completion tokens made per wall second of
training between the first and the last step, from asyncrl's trajectory log and TRL's step logs: the
same measure for every row; TRL also reports tokens/s inside its generate calls), learner peak RSS (asyncrl: the learner rank; TRL: its one process), whole-job peak RSS (every process
of the run, summed at each sample), and the reward curve (plot ``bench_real_reward.png``). Key column:
``delta`` = accuracy_after - accuracy_before, and ``significant`` (the two intervals do not overlap).

Run: ``python scripts/bench_real.py [--quick] [--budget-s S] [--eval-size N] [--rows a,b] [--set K=V ...]
[--json PATH] [--plots DIR] [--keep DIR]``. The full run takes about 3 x (budget + 5 min);
``--quick`` (60 s budgets, 2 prompts x 32 new tokens per step, 32 held-out problems) under ten minutes, its figures are only a smoke check.
"""

from __future__ import annotations

import json
import math
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from asyncrl.bench.report import ROOT, parser, print_table, write_json
from asyncrl.bench.runs import exit_on_sigterm, run_measured, run_role, step_records, train_cmd, train_env
from asyncrl.learner.options import resolve_autocast
from asyncrl.rundir import RunDir

# The task (--preset). signed_sums (configs/experiment/smollm2_signed_sums.yaml, the default): two
# signed single-digit terms; training and held-out problems come from one space without overlapping,
# and no constant answer scores well on the held-out problems. letter_counting: a higher base accuracy,
# but most of its answers are "1" (the rows report majority_answer_share beside accuracy). chain_sum:
# the preset widened to two or three unsigned terms because the two-term space is small; its held-out
# set is then mostly three-term problems while training repeats the two-term ones, so a run moves the
# sampled reward, not held-out accuracy. The base accuracies behind each choice: docs/tasks.md,
# "Choosing a task for SmolLM2"; the benchmark's own: docs/benchmarks.md §8.
PRESETS = {
    "chain_sum": ["+experiment=smollm2_chain_sum", "task.rg_config={min_terms:2,max_terms:3,min_digits:1,max_digits:1}",
                  "task.size=400"],
    "letter_counting": ["+experiment=smollm2_letter_counting"],
    "signed_sums": ["+experiment=smollm2_signed_sums"],
}
# --quick: a smoke check of every row in under ten minutes on this machine, so half the prompts per step
# and half the answer length of the full run (its first step alone, generation included, is the budget)
QUICK = ["rollout.groups_per_step=2", "rollout.max_new_tokens=32"]
SMOKE = ["model=tiny", "task=addition"]  # --smoke: every code path in a minute or two; figures meaningless
# int8 W8A8 workers run torch._int_mm on a CPU with an int8 dot product (AVX-512 VNNI, AVX-VNNI, AMX), the
# AVX2 C kernel over the codes on one without (int_mm_avx2), and the same sums as fp32 GEMMs where that cannot be
# built (int_mm_fp32; docs/benchmarks.md §15), so --quant int8 never costs many times fp32 on any of them.
COMMON = ["rollout.eta=2", "algo=acr", "learner.eval_every=0", "learner.ckpt_every=0",
          "learner.total_steps=100000", "learner.lr_schedule=constant"]
ROWS: dict[str, list[str] | None] = {
    "asyncrl-lora": ["learner.lora.rank=16", "learner.lora.alpha=32", "learner.lr=2e-4"],
    "asyncrl-full": [],
    "trl-grpo": None,  # the peer: sizes from asyncrl-full's resolved configuration
}
TRL_VENV = ROOT / ".cache" / "trl-venv"


def learner_label(cmdline: str) -> str | None:
    """The learner rank (torchrun's child), not torchrun itself."""
    return "learner" if run_role(cmdline) == "learner" else None


def evaluate(model_dir: Path, overrides: list[str], out: Path, threads: int) -> dict:
    """``scripts/eval_greedy.py`` in its own process (its memory never adds to a measured job)."""
    cmd = [sys.executable, str(ROOT / "scripts" / "eval_greedy.py"), "--model", str(model_dir),
           "--json", str(out), "--threads", str(threads), *overrides]
    res = subprocess.run(cmd, cwd=ROOT, env=train_env(), capture_output=True, text=True)
    if res.returncode != 0:
        raise RuntimeError(f"evaluation of {model_dir} failed:\n{res.stdout[-2000:]}\n{res.stderr[-3000:]}")
    print("   ", res.stdout.strip().splitlines()[-1], flush=True)
    return json.loads(out.read_text())


def run_asyncrl(name: str, overrides: list[str], tmp: Path) -> tuple[Path, dict]:
    """One ``asyncrl train`` run, its process tree's memory sampled; returns the run folder and memory."""
    cmd = train_cmd(overrides, runs_dir=tmp, run_name=name)
    mem = run_measured(cmd, tmp / f"{name}.log", learner_label, f"asyncrl train ({name})", train_env())
    return tmp / name, {"learner": mem.peak_by_label.get("learner", 0), "job": mem.peak_total_bytes}


def asyncrl_stats(run_dir: Path) -> dict:
    """Steps, per-step timings, rollout tokens/s and the reward curve from the run's metrics and trajectory log."""
    from asyncrl.log import SampleRecord, read_log

    steps = sorted(step_records(run_dir), key=lambda r: r["step"])
    times = [r["time"] for r in steps]
    scan = read_log(RunDir(run_dir).trajectories)
    tokens = [(r.logged_at, len(r.sample.response_ids.to_numpy())) for r in scan.records
              if isinstance(r, SampleRecord)]
    final = json.loads(RunDir(run_dir).learner_final.read_text())
    first = (steps[0].get("time/learner_wait_s", math.nan) + steps[0]["time/learner_train_s"]) if steps else math.nan
    return {"steps": len(steps), "seconds_per_step": _per_step(times, first),
            "learner_seconds_per_step": _mean([r["time/learner_train_s"] for r in steps[1:] or steps]),
            "worker_tokens_per_s": _rate(tokens, times), "learner_eval_mean_score": final.get("eval/accuracy"),
            "curve": [(t - times[0], r["step"], r.get("train/reward_mean")) for t, r in zip(times, steps, strict=True)]}


def _rate(tokens: list[tuple[float, int]], times: list[float]) -> float:
    """Completion tokens made per wall second between the first and the last step (same for every row)."""
    if len(times) < 2:
        return math.nan
    made = sum(n for t, n in tokens if times[0] < t <= times[-1])
    return made / (times[-1] - times[0])


def run_trl(cfg_overrides: list[str], budget_s: float, tmp: Path, threads: int) -> tuple[Path, dict, dict]:
    """TRL's GRPOTrainer (``scripts/trl_grpo.py`` in the TRL venv) on the sizes of ``cfg_overrides``."""
    from asyncrl.config.loader import load_train_config
    from asyncrl.models.prepare import prepare_model
    from asyncrl.tasks import make_task
    from asyncrl.tasks.prompts import PromptEncoder, load_tokenizer
    from asyncrl.tasks.scoring import task_kwargs

    python = ensure_trl_venv()
    cfg = load_train_config(cfg_overrides)
    model_dir = prepare_model(cfg, log=lambda _m: None)

    encoder = PromptEncoder(load_tokenizer(model_dir), cfg.task.prompt_format,
                            cfg.task.system_prompt)
    task = make_task(cfg.task.name, **task_kwargs(cfg))
    a, r, L = cfg.algo, cfg.rollout, cfg.learner
    spec = {"model_dir": str(model_dir), "out_dir": str(tmp / "trl-model"), "metrics": str(tmp / "trl-metrics.jsonl"),
            "task_name": cfg.task.name, "task_kwargs": task_kwargs(cfg), "prompt_format": encoder.format,
            "system_prompt": cfg.task.system_prompt, "group_size": a.group_size, "groups_per_step": r.groups_per_step,
            "max_new_tokens": r.max_new_tokens, "temperature": r.temperature, "lr": L.lr,
            "warmup_steps": L.warmup_steps, "micro_batch_size": L.micro_batch_size, "grad_clip": L.grad_clip,
            "weight_decay": L.weight_decay, "eps_low": a.clip_low, "eps_high": a.clip_high, "seed": cfg.seed,
            "time_budget_s": budget_s, "threads": threads,
            "gradient_checkpointing": bool(getattr(L, "activation_checkpointing", False)),
            "bf16": resolve_autocast(L.autocast, "cpu")[0] == "bf16",  # what the asyncrl learner runs here
            # the controller's own prompt ids of the first problems: the runner checks TRL's are equal
            "check_prompt_ids": [encoder.encode(task.problem_at(i).prompt) for i in range(4)]}
    spec_path = tmp / "trl-spec.json"
    spec_path.write_text(json.dumps(spec))
    env = train_env() | {"OMP_NUM_THREADS": str(threads), "MKL_NUM_THREADS": str(threads)}
    mem = run_measured([str(python), str(ROOT / "scripts" / "trl_grpo.py"), str(spec_path)],
                       tmp / "trl-grpo.log", lambda c: "trl" if "trl_grpo.py" in c else None, "TRL GRPO", env)
    recs = [json.loads(x) for x in Path(spec["metrics"]).read_text().splitlines() if x.strip()]
    steps = [x for x in recs if "step" in x]
    times = [x["time"] for x in steps]
    # TRL generates then trains in one process: its "learner" time is the step's time outside generate
    begin = [x["train_begin"] for x in recs if "train_begin" in x]
    train_s = [b["time"] - a["time"] - b["generate_s"] for a, b in zip(steps, steps[1:], strict=False)]
    if len(steps) == 1 and begin:
        train_s = [steps[0]["time"] - begin[0] - steps[0]["generate_s"]]
    first = steps[0]["time"] - begin[0] if steps and begin else math.nan
    stats = {"steps": len(steps), "seconds_per_step": _per_step(times, first), "learner_seconds_per_step": _mean(train_s),
             "worker_tokens_per_s": _rate([(x["time"], x["completion_tokens"]) for x in steps], times),
             "generate_only_tokens_per_s": _mean([x["completion_tokens"] / x["generate_s"] for x in steps[1:]
                                                  if x.get("generate_s")]),
             "learner_eval_mean_score": None,
             "curve": [(t - times[0] if times else 0.0, x["step"], x.get("reward")) for t, x in
                       zip(times, steps, strict=True)]}
    peak = mem.peak_by_label.get("trl", 0)
    return Path(spec["out_dir"]), stats, {"learner": peak, "job": mem.peak_total_bytes}


def ensure_trl_venv() -> Path:
    """The TRL venv's python; built once with ``make trl-venv`` (pinned TRL, torch from constraints.txt)."""
    if not (TRL_VENV / ".installed").exists():
        print(f"building {TRL_VENV} (make trl-venv; once, a few minutes) ...", flush=True)
        subprocess.run(["make", "-C", str(ROOT), "trl-venv"], check=True)
    return TRL_VENV / "bin" / "python"


def _per_step(times: list[float], first_s: float) -> float:
    """Mean wall seconds between consecutive steps (the first step, with its warm-up, excluded); with
    one step only, that step's own wall time ``first_s`` (from the start of training, warm-up included)."""
    return (times[-1] - times[0]) / (len(times) - 1) if len(times) > 1 else first_s


def _mean(xs: list) -> float:
    xs = [float(x) for x in xs if x is not None and math.isfinite(float(x))]
    return statistics.fmean(xs) if xs else math.nan


def make_plot(curves: dict[str, list], path: Path, title: str) -> str:
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    fig = Figure(figsize=(11, 4.5))
    for i, (xkey, xlabel) in enumerate([(0, "training seconds"), (1, "step")]):
        ax = fig.add_subplot(1, 2, i + 1)
        for name, pts in curves.items():
            pts = [p for p in pts if p[2] is not None]
            if pts:
                ys = [p[2] for p in pts]
                smooth = [statistics.fmean(ys[max(0, j - 4): j + 1]) for j in range(len(ys))]
                line, = ax.plot([p[xkey] for p in pts], smooth, label=f"{name} (5-step mean)")
                ax.plot([p[xkey] for p in pts], ys, ".", color=line.get_color(), alpha=0.35, markersize=4)
        ax.set_xlabel(xlabel)
        ax.set_ylabel("sampled train reward")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    FigureCanvasAgg(fig).print_png(str(path))
    return str(path)


def main(argv: list[str] | None = None) -> int:
    p = parser("bench_real", __doc__, smoke=True)
    p.add_argument("--budget-s", type=float, default=None,
                   help="training seconds per row (default 1800, quick 60, smoke 1e-6: one step)")
    p.add_argument("--eval-size", type=int, default=None, help="held-out problems (default 200, quick 32, smoke 8)")
    p.add_argument("--preset", default="signed_sums", choices=sorted(PRESETS), help="the task (default %(default)s)")
    p.add_argument("--rows", default=",".join(ROWS), help="comma list of %(default)s")
    p.add_argument("--quant", default="int8", help="the asyncrl workers' format (default %(default)s; "
                   "int8 = W8A8 with torch._int_mm)")
    p.add_argument("--set", nargs="*", default=[], metavar="KEY=VALUE", help="extra overrides for the asyncrl rows "
                   "(and the sizes TRL copies)")
    p.add_argument("--threads", type=int, default=os.cpu_count() or 1,
                   help="torch threads of the TRL process and of the evaluations (default: the machine's CPUs, "
                        "%(default)s; asyncrl's processes take learner.num_threads and one per worker)")
    p.add_argument("--plots", default=str(ROOT / "benchmarks" / "plots"), help="PNG folder (%(default)s)")
    p.add_argument("--keep", default="", help="keep the run folders and logs here (default: a temporary folder)")
    args = p.parse_args(argv)
    exit_on_sigterm()
    budget = args.budget_s or (1e-6 if args.smoke else 60.0 if args.quick else 1800.0)
    n_eval = args.eval_size or (8 if args.smoke else 32 if args.quick else 200)
    if args.json == p.get_default("json") and (args.quick or args.smoke):  # never over the full run's record
        args.json = args.json.replace(".json", ".smoke.json" if args.smoke else ".quick.json")
    names = [n for n in args.rows.split(",") if n]
    if bad := [n for n in names if n not in ROWS]:
        raise SystemExit(f"unknown row(s) {bad}; choose from {list(ROWS)}")
    from asyncrl.config.loader import load_train_config

    base = [*(SMOKE if args.smoke else PRESETS[args.preset]), *(QUICK if args.quick and not args.smoke else []),
            f"quant.fmt={args.quant}", *COMMON, f"task.eval_size={n_eval}",
            f"learner.time_budget_s={budget:.6f}", *args.set]
    for n in names:
        load_train_config([*base, *(ROWS[n] or [])])  # a bad override fails now, not after an hour
    t_start = time.monotonic()
    tmp = Path(args.keep or tempfile.mkdtemp(prefix="bench_real-"))
    tmp.mkdir(parents=True, exist_ok=True)
    rows, curves = [], {}
    before: dict = {}

    def record(**extra) -> None:
        write_json(args.json, "bench_real", {"rows": rows}, args, rows=rows, budget_s=budget,
                   eval_size=n_eval, overrides=base, row_overrides={n: ROWS[n] for n in names},
                   examples_before=before.get("examples"), curves=curves,
                   total_s=time.monotonic() - t_start, **extra)

    try:
        from asyncrl.models.prepare import prepare_model

        base_dir = prepare_model(load_train_config(base), log=print)
        print(f"evaluating the base model on {n_eval} held-out problems ...", flush=True)
        before = evaluate(base_dir, base, tmp / "eval-before.json", args.threads)
        for n in names:
            print(f"{n}: training for {budget:.0f} s ...", flush=True)
            t0 = time.monotonic()
            if ROWS[n] is None:
                model_dir, stats, mem = run_trl(base, budget, tmp, args.threads)
            else:
                run_dir, mem = run_asyncrl(n, [*base, *ROWS[n]], tmp)
                model_dir, stats = RunDir(run_dir).model, asyncrl_stats(run_dir)
            after = evaluate(model_dir, base, tmp / f"eval-after-{n}.json", args.threads)
            curves[n] = stats.pop("curve")
            row = {"name": n, "steps": stats["steps"], "accuracy_before": before["accuracy"],
                   "accuracy_after": after["accuracy"], "delta": after["accuracy"] - before["accuracy"],
                   "ci95_before": before["ci95"], "ci95_after": after["ci95"],
                   "significant": after["ci95"][0] > before["ci95"][1] or after["ci95"][1] < before["ci95"][0],
                   "mean_score_before": before["mean_score"], "mean_score_after": after["mean_score"],
                   "n_eval": after["n"], "task": after["task"], "learner_peak_rss_gb": mem["learner"] / 2**30,
                   "job_peak_rss_gb": mem["job"] / 2**30, **stats, "row_wall_s": time.monotonic() - t0,
                   "majority_answer_share": after.get("majority_answer_share"),
                   "answers_top_before": before.get("answers_top"), "answers_top_after": after.get("answers_top"),
                   "examples_after": after["examples"]}
            rows.append(row)
            print(f"  {n}: {row['steps']} steps, {row['seconds_per_step']:.1f} s/step, accuracy "
                  f"{row['accuracy_before']:.3f} -> {row['accuracy_after']:.3f}, learner peak "
                  f"{row['learner_peak_rss_gb']:.2f} GB, job peak {row['job_peak_rss_gb']:.2f} GB "
                  f"({row['row_wall_s']:.0f} s)", flush=True)
            # every finished row is on disk at once: a later row's failure (an hour on) loses nothing
            record(complete=False)
    finally:
        if not args.keep:
            shutil.rmtree(tmp, ignore_errors=True)
    cfg = load_train_config(base)
    model = {"smollm2": "SmolLM2-135M-Instruct", "tiny": "tiny model"}.get(cfg.model.name, cfg.model.name)
    task = rows[0]["task"] if rows else cfg.task.name
    title = (f"{model}, {task}, {budget:g} s per row, G={cfg.algo.group_size} x "
             f"{cfg.rollout.groups_per_step} prompts/step, {cfg.rollout.max_new_tokens} new tokens")
    prefix = "bench_real_smoke" if args.smoke else "bench_real_quick" if args.quick else "bench_real"
    plot = make_plot(curves, Path(args.plots) / f"{prefix}_reward.png", title)
    n_held = rows[0]["n_eval"] if rows else n_eval
    print_table(f"{title}; greedy accuracy on {n_held} held-out problems (Wilson 95% CI)", rows,
                ["name", "steps", "accuracy_before", "accuracy_after", "delta", "significant",
                          "majority_answer_share",
                          "seconds_per_step", "learner_seconds_per_step", "worker_tokens_per_s",
                          "learner_peak_rss_gb", "job_peak_rss_gb"])
    for r in rows:
        print(f"  {r['name']}: CI before {[round(x, 3) for x in r['ci95_before']]}, "
              f"after {[round(x, 3) for x in r['ci95_after']]}")
    record(complete=True, plots=[plot])
    return 0


if __name__ == "__main__":
    sys.exit(main())
