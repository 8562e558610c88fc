"""End-of-run PNG plots from ``run_dir/metrics.jsonl`` into ``run_dir/plots/``.

Owns: which metrics each plot shows, and drawing them with matplotlib's Agg canvas (no display, no
pyplot global state, so it is safe in a headless launcher and in threads).
Never: writes a plot with no data (a metric absent from the run is skipped; a plot none of whose
metrics is present is not written), invents points (a key logged only on some steps, such as eval every
N steps, is drawn only at the steps that have it; ``null`` values, i.e. non-finite ones, are gaps), or
draws a line through steps that lack the value: two points are joined only when no step of the run lies
between them (``gapped``), so a sparse series (a staleness bucket seen at steps 1 and 380, eval every 50
steps) is drawn as markers or as broken segments, never as a line across steps where it was not logged.

Plots (file: metrics):
- ``reward.png``: ``train/reward_mean``, its moving average over ``SMOOTH_WINDOW`` steps and, when
  present, ``eval/accuracy`` with the step-0 evaluation drawn as a horizontal baseline.
- ``eval_accuracy.png``: ``eval/accuracy``.
- ``kl_by_staleness.png``: ``mismatch/by_staleness/eta=J/kl_k3`` for every J (docs/algorithms.md §7 spells
  it ``η=J``; both spellings are accepted), one line per J, plus ``mismatch/kl_k3`` over all tokens.
- ``mismatch.png``: ``mismatch/lag0``, ``mismatch/stale``, ``mismatch/quant`` and ``mismatch/noise`` (the
  decomposition of asyncrl/learner/mismatch.py).
- ``clip_fractions.png``: keys starting ``actor/clipfrac`` or ``acr/clipfrac``, ``acr/empty_band_frac``,
  ``tbpo/seq_masked_frac``.
- ``throughput.png``: ``throughput/samples_per_s``, ``throughput/tokens_per_s`` and
  ``time/learner_busy_frac`` (one panel each). The run's closing report (``done``)
  and the step-0 evaluation report (``eval/baseline``) are not training steps and are left out here
  (the closing one's rate over export and final evaluation would be a spike at the last step).
- ``responses.png``: ``train/response_len_mean``; ``train/zero_variance_groups`` and
  ``train/first_token_stop_frac``.
- ``learner.png``: ``learner/loss``, ``learner/grad_norm``, ``learner/lr`` and ``actor/entropy``, one panel
  each, for those the run logged.

``reward.png``, ``responses.png`` and ``learner.png`` also mark each training-health alarm of the run
(``health.jsonl``) with a vertical line at its step.
"""

from __future__ import annotations

import dataclasses
import math
import os
import re
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from asyncrl.metrics.health_log import read_alarms
from asyncrl.metrics.writer import read_metrics
from asyncrl.rundir import RunDir

SMOOTH_WINDOW = 10
SMOOTHED = "~smoothed:"
"""Prefix of a derived line: the trailing moving average of the metric after it."""
BASELINE = "~baseline:"
"""Prefix of a derived line: the metric's value at step 0, drawn across the plot."""
ALARM_MARKED = ("reward.png", "responses.png", "learner.png")
"""Plots that mark where a training-health alarm fired (``mark_alarms``)."""
_STALENESS_KL = re.compile(r"^mismatch/by_staleness/(?:eta|η)=(\d+)/kl_k3$")


@dataclasses.dataclass(frozen=True)
class Line:
    key: str
    label: str
    style: dict[str, Any] = dataclasses.field(default_factory=dict)


@dataclasses.dataclass(frozen=True)
class Panel:
    ylabel: str
    lines: list[Line]
    ylim: tuple[float, float] | None = None
    log_if_positive: bool = False  # log y-axis when every plotted value is > 0
    skip_final: bool = False  # leave out the closing report (``done``) and the step-0 evaluation report


@dataclasses.dataclass(frozen=True)
class PlotSpec:
    filename: str
    title: str
    panels: Callable[[set[str]], list[Panel]]  # from the keys present in the run


def moving_average(values: Sequence[float], window: int) -> list[float]:
    """Trailing mean over the last ``window`` values (fewer at the start)."""
    out, total = [], 0.0
    for i, v in enumerate(values):
        total += v
        if i >= window:
            total -= values[i - window]
        out.append(total / min(i + 1, window))
    return out


def derived_series(records: Sequence[dict[str, Any]], key: str, skip_final: bool = False
                   ) -> tuple[list[int], list[float]]:
    """``series`` for a plain key; for ``SMOOTHED + key`` its moving average; for ``BASELINE + key`` the
    step-0 value held across every step the run reached."""
    if key.startswith(SMOOTHED):
        xs, ys = series(records, key[len(SMOOTHED):], skip_final)
        return (xs, moving_average(ys, SMOOTH_WINDOW)) if len(xs) >= 3 else ([], [])
    if key.startswith(BASELINE):
        xs, ys = series(records, key[len(BASELINE):], skip_final)
        last = max((r["step"] for r in records), default=0)
        if not xs or xs[0] != 0 or last == 0:
            return [], []
        return [0, last], [ys[0], ys[0]]
    return series(records, key, skip_final)


def series(records: Sequence[dict[str, Any]], key: str, skip_final: bool = False) -> tuple[list[int], list[float]]:
    """(steps, values) of the records that have ``key`` with a finite value, in file order."""
    steps: list[int] = []
    values: list[float] = []
    for rec in records:
        if skip_final and (rec.get("done") or rec.get("eval/baseline")):
            continue
        v = rec.get(key)
        if isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v):
            steps.append(rec["step"])
            values.append(float(v))
    return steps, values


def run_steps(records: Sequence[dict[str, Any]], skip_final: bool = False) -> list[int]:
    """The distinct steps of the run's records, ascending (the records ``series`` reads with ``skip_final``)."""
    return sorted({r["step"] for r in records if not (skip_final and (r.get("done") or r.get("eval/baseline")))})


def gapped(xs: Sequence[int], ys: Sequence[float], steps: Sequence[int]) -> tuple[list[float], list[float], bool]:
    """``xs``/``ys`` with a NaN point between two consecutive points that are not adjacent steps of
    ``steps`` (every step of the run, ascending), so matplotlib breaks the line there; and whether any
    such gap exists."""
    index = {s: i for i, s in enumerate(steps)}
    out_x: list[float] = []
    out_y: list[float] = []
    gap = False
    for i, (x, y) in enumerate(zip(xs, ys, strict=True)):
        if i and (x not in index or xs[i - 1] not in index or index[x] - index[xs[i - 1]] != 1):
            out_x.append(math.nan)
            out_y.append(math.nan)
            gap = True
        out_x.append(float(x))
        out_y.append(y)
    return out_x, out_y, gap


def panel_lines(panel: Panel, records: Sequence[dict[str, Any]], keys: set[str]
                ) -> list[tuple[Line, list[Any], list[float]]]:
    """The lines of ``panel`` that have data, with their (steps, values) as drawn: broken at steps that
    lack the value (``gapped``), and with markers when broken, so an isolated point shows. A baseline is a
    reference drawn across the run, not data, and is never broken. Steps are floats (NaN at a break)."""
    steps = run_steps(records, panel.skip_final)
    out: list[tuple[Line, list[Any], list[float]]] = []
    for line in panel.lines:
        if _base_key(line.key) not in keys:
            continue
        xs, ys = derived_series(records, line.key, panel.skip_final)
        if not xs:
            continue
        if line.key.startswith(BASELINE):
            out.append((line, [float(x) for x in xs], ys))
            continue
        gx, gy, gap = gapped(xs, ys, steps)
        if gap or len(xs) == 1:
            line = dataclasses.replace(line, style={"marker": "o"} | line.style)
        out.append((line, gx, gy))
    return out


def _reward(keys: set[str]) -> list[Panel]:
    return [
        Panel(
            "reward / accuracy",
            [
                Line("train/reward_mean", "train reward (sampled, mean)", {"alpha": 0.45}),
                Line(SMOOTHED + "train/reward_mean", f"train reward, mean of last {SMOOTH_WINDOW} steps",
                     {"color": "C0", "linewidth": 2.2}),
                Line("eval/accuracy", "eval accuracy (greedy)", {"marker": "o", "color": "C1"}),
                Line(BASELINE + "eval/accuracy", "eval accuracy at step 0 (baseline)",
                     {"color": "C1", "linestyle": ":"}),
            ],
            ylim=(-0.02, 1.02),
        )
    ]


def _eval(keys: set[str]) -> list[Panel]:
    return [
        Panel(
            "accuracy", [Line("eval/accuracy", "eval accuracy (greedy)", {"marker": "o"})], ylim=(-0.02, 1.02)
        )
    ]


def _kl_by_staleness(keys: set[str]) -> list[Panel]:
    by_j = sorted((int(m.group(1)), k) for k in keys if (m := _STALENESS_KL.match(k)))
    lines = [Line(k, f"staleness {j}") for j, k in by_j]
    lines.append(Line("mismatch/kl_k3", "all tokens", {"color": "black", "linestyle": "--"}))
    return [Panel("KL(behav || prox), k3 estimate", lines, log_if_positive=True)]


def _mismatch(keys: set[str]) -> list[Panel]:
    return [Panel("mean |log-prob gap| (nats/token)", [
        Line("mismatch/lag0", "behaviour vs learner, lag 0"),
        Line("mismatch/stale", "added by version lag"),
        Line("mismatch/quant", "quantized vs full precision, same weights"),
        Line("mismatch/noise", "full precision vs itself, other batch shape", {"linestyle": ":"}),
    ], log_if_positive=True)]


def _clip_fractions(keys: set[str]) -> list[Panel]:
    clip = sorted(k for k in keys if k.startswith(("actor/clipfrac", "acr/clipfrac")))
    extra = ["acr/empty_band_frac", "tbpo/seq_masked_frac"]
    return [Panel("fraction", [Line(k, k) for k in clip + extra])]


def _throughput(keys: set[str]) -> list[Panel]:
    return [
        Panel("tokens / s", [Line("throughput/tokens_per_s", "generated tokens/s")], skip_final=True),
        Panel("samples / s", [Line("throughput/samples_per_s", "samples/s")], skip_final=True),
        Panel("busy fraction", [Line("time/learner_busy_frac", "learner busy")], ylim=(-0.02, 1.02), skip_final=True),
    ]


def _responses(keys: set[str]) -> list[Panel]:
    return [
        Panel("response tokens", [Line("train/response_len_mean", "mean response length"),
                                  Line("train/response_len_max", "longest response", {"alpha": 0.5})]),
        Panel("fraction", [Line("train/zero_variance_groups", "groups with equal rewards (no gradient)"),
                           Line("train/first_token_stop_frac", "samples ending at their first token")],
              ylim=(-0.02, 1.02)),
    ]


def _learner(keys: set[str]) -> list[Panel]:
    return [
        Panel("loss", [Line("learner/loss", "loss")]),
        Panel("gradient norm", [Line("learner/grad_norm", "grad norm (before clipping)")], log_if_positive=True),
        Panel("learning rate", [Line("learner/lr", "lr")]),
        Panel("entropy (nats/token)", [Line("actor/entropy", "policy entropy")]),
    ]


PLOTS: tuple[PlotSpec, ...] = (
    PlotSpec("reward.png", "Training reward (sampled) and eval accuracy (greedy) vs learner step", _reward),
    PlotSpec("eval_accuracy.png", "Greedy eval accuracy on the held-out set vs learner step", _eval),
    PlotSpec(
        "kl_by_staleness.png",
        "KL(behaviour || proximal) by token staleness vs learner step",
        _kl_by_staleness,
    ),
    PlotSpec("mismatch.png", "Behaviour-vs-learner log-prob gap taken apart vs learner step", _mismatch),
    PlotSpec("clip_fractions.png", "Clip / mask fractions of the objective vs learner step", _clip_fractions),
    PlotSpec("throughput.png", "Throughput and busy time vs learner step", _throughput),
    PlotSpec("responses.png", "What the model writes: response length, zero-variance groups", _responses),
    PlotSpec("learner.png", "Learner: loss, gradient norm, learning rate, entropy vs learner step", _learner),
)


def _draw(
    spec: PlotSpec, panels: list[tuple[Panel, list[tuple[Line, list[int], list[float]]]]], path: Path,
    alarms: Sequence[dict[str, Any]] = (),
) -> None:
    from matplotlib.figure import Figure  # lazy: matplotlib costs about a second to import

    fig = Figure(figsize=(8.0, 3.2 * len(panels) + 0.6), layout="constrained")
    axes = fig.subplots(len(panels), 1, sharex=True, squeeze=False)[:, 0]
    for ax, (panel, drawn) in zip(axes, panels, strict=True):
        for line, xs, ys in drawn:
            style = dict(line.style)
            if len(xs) == 1:
                style.setdefault("marker", "o")
            ax.plot(xs, ys, label=line.label, **({"linewidth": 1.4, "markersize": 3.5} | style))
        if panel.log_if_positive and all(y > 0 for _, _, ys in drawn for y in ys if not math.isnan(y)):
            ax.set_yscale("log")
        if panel.ylim is not None:
            ax.set_ylim(*panel.ylim)
        ax.set_ylabel(panel.ylabel)
        ax.grid(True, alpha=0.3)
        n_points = sum(len(xs) for _, xs, _ in drawn)
        ax.legend(loc="best" if n_points < 5000 else "upper left", fontsize="small")  # "best" is O(points)
    mark_alarms(list(axes), alarms)
    axes[-1].set_xlabel("learner step")
    fig.suptitle(spec.title)
    tmp = path.with_name(path.name + ".tmp")
    fig.savefig(tmp, format="png", dpi=100)
    os.replace(tmp, path)


def mark_alarms(axes: Sequence[Any], alarms: Sequence[dict[str, Any]]) -> None:
    """A dashed red vertical line on every panel at each step a training-health alarm fired
    (``health.jsonl``), named once at the top of the first panel."""
    named: set[tuple[int, str]] = set()
    for a in alarms:
        step, name = a.get("step"), str(a.get("alarm"))
        if not isinstance(step, int):
            continue
        for ax in axes:
            ax.axvline(step, color="tab:red", linestyle="--", linewidth=0.9, alpha=0.7)
        if (step, name) not in named:
            named.add((step, name))
            axes[0].annotate(name, (step, 1.0), xycoords=("data", "axes fraction"), rotation=90, fontsize=7,
                             color="tab:red", ha="right", va="top")


def _base_key(key: str) -> str:
    for prefix in (SMOOTHED, BASELINE):
        if key.startswith(prefix):
            return key[len(prefix):]
    return key


def make_plots(run_dir: str | Path, records: Sequence[dict[str, Any]] | None = None) -> list[Path]:
    """Writes the plots that have data under ``run_dir/plots/``; returns the files written, in the
    order of ``PLOTS``. ``records`` defaults to ``read_metrics(run_dir)``."""
    run_dir = Path(run_dir)
    if records is None:
        records = read_metrics(run_dir)
    keys = {k for rec in records for k in rec}
    alarms = read_alarms(run_dir)
    written: list[Path] = []
    for spec in PLOTS:
        panels = []
        for panel in spec.panels(keys):
            drawn = panel_lines(panel, records, keys)
            if drawn:
                panels.append((panel, drawn))
        if not panels:
            continue
        out_dir = RunDir(run_dir).plots
        out_dir.mkdir(parents=True, exist_ok=True)
        path = out_dir / spec.filename
        _draw(spec, panels, path, alarms if spec.filename in ALARM_MARKED else ())
        written.append(path)
    return written
