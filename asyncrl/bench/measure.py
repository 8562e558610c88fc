"""How a benchmark's figures are measured and summarised so that they hold still on a shared machine.

Owns: interleaved rounds (every compared path once per round, the order shuffled), ratios taken per round
and summarised (median, min, max, spread), the load average seen across the rounds, 95% intervals (Student's
t over seeds, Wilson for a proportion) and the wait for a device's queued work before a clock is read.
Never: prints a table or writes a file (``report`` does; ``print_ratio`` prints one line), or starts a
process.
"""

from __future__ import annotations

import math
import os
import random
import statistics
from collections.abc import Callable, Mapping, Sequence
from typing import Any

# two-sided 97.5% Student t quantiles for 1..30 degrees of freedom
T975 = [12.706, 4.303, 3.182, 2.776, 2.571, 2.447, 2.365, 2.306, 2.262, 2.228, 2.201, 2.179, 2.160, 2.145,
        2.131, 2.120, 2.110, 2.101, 2.093, 2.086, 2.080, 2.074, 2.069, 2.064, 2.060, 2.056, 2.052, 2.048,
        2.045, 2.042]


def ci95(xs: Sequence[float | None]) -> tuple[float, float]:
    """(mean, half-width of the 95% CI from Student's t) over the finite values of ``xs``; half-width nan
    for fewer than 2 values, both nan for none."""
    vals = [x for x in xs if x is not None and math.isfinite(x)]
    if not vals:
        return math.nan, math.nan
    if len(vals) < 2:
        return vals[0], math.nan
    t = T975[len(vals) - 2] if len(vals) - 1 <= len(T975) else 1.96
    return statistics.fmean(vals), t * statistics.stdev(vals) / math.sqrt(len(vals))


def wilson(k: int, n: int, z: float = 1.959964) -> tuple[float, float]:
    """Wilson score interval of a proportion ``k/n`` (95% for the default ``z``); ``(nan, nan)`` if n=0."""
    if n <= 0:
        return (math.nan, math.nan)
    p = k / n
    centre = (p + z * z / (2 * n)) / (1 + z * z / n)
    half = z * math.sqrt(p * (1 - p) / n + z * z / (4 * n * n)) / (1 + z * z / n)
    return (max(0.0, centre - half), min(1.0, centre + half))


def interleaved(paths: Mapping[str, Callable[[], float]], rounds: int, *, warmup: int = 1,
                seed: int = 0) -> dict[str, Any]:
    """Run every compared path once per round, ``rounds`` times, the order shuffled each round (seeded).

    Each callable measures itself once and returns its figure (seconds, or a rate). ``warmup`` rounds
    run first and are dropped. Paths measured in the same round saw the same machine load, so the
    ratio of two paths is taken per round (``ratio_stats``) before any summary: a neighbour's burst
    moves both figures of one round, not one path's best against another's worst. Returns
    ``{"values": {path: [figure per round]}, "load": [1-min load average after each round], "order":
    [[paths in the order run] per round]}``.
    """
    if rounds < 1:
        raise ValueError(f"rounds must be >= 1, got {rounds}")
    rng = random.Random(seed)
    names = list(paths)
    values: dict[str, list[float]] = {n: [] for n in names}
    load: list[float] = []
    order: list[list[str]] = []
    for r in range(warmup + rounds):
        this = names[:]
        rng.shuffle(this)
        got = {n: float(paths[n]()) for n in this}
        if r < warmup:
            continue
        for n in names:
            values[n].append(got[n])
        load.append(os.getloadavg()[0])
        order.append(this)
    return {"values": values, "load": load, "order": order}


def ratio_stats(num: Sequence[float], den: Sequence[float]) -> dict[str, float]:
    """Per-round ratios ``num[i] / den[i]`` summarised: median, min, max, and the interquartile spread
    relative to the median (``spread`` = (q3 - q1) / median; 0.05 means the middle half of the rounds
    lies within 5% of each other)."""
    if len(num) != len(den) or not num:
        raise ValueError(f"need the same non-zero number of rounds, got {len(num)} and {len(den)}")
    ratios = [a / b for a, b in zip(num, den, strict=True)]
    med = statistics.median(ratios)
    if len(ratios) >= 2:
        q1, _, q3 = statistics.quantiles(ratios, n=4, method="inclusive")
    else:
        q1 = q3 = med
    return {"ratio_median": med, "ratio_min": min(ratios), "ratio_max": max(ratios),
            "spread": (q3 - q1) / med if med else float("nan"), "rounds": len(ratios)}


def load_average_stats(load: Sequence[float]) -> dict[str, float]:
    """The 1-min load average seen across the rounds (median, max) and the machine's core count."""
    return {"load_median": statistics.median(load) if load else float("nan"),
            "load_max": max(load) if load else float("nan"), "cpus": float(os.cpu_count() or 0)}


def print_ratio(label: str, stats: Mapping[str, float], load: Mapping[str, float] | None = None) -> None:
    """One line: median ratio, [min, max], spread, rounds, and the load average during the rounds."""
    line = (f"{label}: {stats['ratio_median']:.3f}x median of {int(stats['rounds'])} interleaved rounds "
            f"[min {stats['ratio_min']:.3f}, max {stats['ratio_max']:.3f}, IQR/median {stats['spread']:.1%}]")
    if load is not None:
        line += f"; load average {load['load_median']:.2f} (max {load['load_max']:.2f}) on {int(load['cpus'])} cpus"
    print(line, flush=True)


def device_sync(device: Any) -> None:
    """Wait for the work queued on ``device`` (a ``torch.device`` or its name) before a clock is read: a
    CUDA synchronize; nothing on the CPU, which runs ops as they are called."""
    import torch

    device = torch.device(device)
    if device.type == "cuda":
        torch.cuda.synchronize(device)
