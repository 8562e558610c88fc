"""Extrapolation of the scale model to cluster shapes, and what limits scale there.

Owns: the ``--extrapolate`` tables of ``scripts/simulate_scale.py``: every shape of
``asyncrl/sim/cluster.py`` at several eta, its speedup over eta = 0 next to AReaL's published one, and
the load it puts on the three shared pieces (the controller, the publisher's link, the trajectory log's
fsyncs), each against a capacity the caller measured and passes in (seconds per controller message,
seconds per fsync). Never: starts a run, measures anything, or prints (tables go to the caller's ``show``).

A shape is simulated at 1/``shrink`` of its size (GPUs and prompts per step divided by ``shrink``; the
publisher's link bandwidth divided and the controller's cost per message multiplied by it, so every
per-GPU and per-message load is the full cluster's); rates are reported for the full cluster.
"""

from __future__ import annotations

import statistics
from dataclasses import replace
from typing import Any

from asyncrl.config.schema import LogConfig
from asyncrl.controller.core import no_work_retry_s
from asyncrl.sim.cluster import AREAL, ASSUMPTIONS, SHAPES, ClusterShape, cluster_params, derived
from asyncrl.sim.model import simulate
from asyncrl.sim.params import ShowTable, fmt_hist, window_rate, window_staleness

__all__ = ["LOG_BYTES_PER_TOKEN", "LOG_FSYNC_EVERY", "extrapolate", "simulate_shape"]

LOG_FSYNC_EVERY = LogConfig().fsync_every  # records per trajectory-log fsync, the log.fsync_every default
LOG_BYTES_PER_TOKEN = 12  # token id (int32) + behaviour log-prob (float32) + version (int32) per response token


def simulate_shape(shape: ClusterShape, eta: int, shrink: int) -> dict[str, Any]:
    """``shape`` at ``eta``, simulated at 1/``shrink`` size: the steady window's figures for the full cluster."""
    small = replace(shape, gen_gpus=max(1, shape.gen_gpus // shrink), train_gpus=max(1, shape.train_gpus // shrink),
                    groups_per_step=max(1, shape.groups_per_step // shrink), egress_bw=shape.egress_bw / shrink,
                    ctl_msg_s=shape.ctl_msg_s * shrink)
    # the back-off a NoWork names is the full fleet's (the controller sizes it by the workers it has)
    r = simulate(cluster_params(small, eta=eta, nowork_retry_s=no_work_retry_s(shape.gen_gpus)))
    w = window_rate(r.version_times, r.batch_samples)
    span = r.version_times[-1]
    return {"step_s": w["step_s"], "samples_per_s": w["samples_per_s"] * shrink,
            "staleness": fmt_hist(window_staleness(r)),
            "gen_busy": statistics.fmean(r.worker_busy_s) / span, "learner_busy": r.learner_busy_s / span,
            "controller_busy": r.controller_busy_s / span,
            "controller_msgs_per_s": r.controller_msgs / span * shrink,
            "train_s": statistics.fmean(r.stage_wall.get("train_s", [0.0])),
            "fetch_s": statistics.fmean(r.stage_wall.get("fetch_s", [0.0]))}


def extrapolate(*, quick: bool, shrink: int, ctl_msg_s: float, fsync_s: float, show: ShowTable) -> dict[str, Any]:
    """Every shape (quick: the two 7B ones) at eta 0, 1, 2, 4, 8 (quick: 0 and 4), with ``ctl_msg_s`` seconds
    per controller message and ``fsync_s`` seconds per trajectory-log fsync as the measured capacities."""
    if shrink < 1:
        raise ValueError(f"shrink must be >= 1 (simulate 1/shrink of each cluster), got {shrink}")
    ctl, fsync = ctl_msg_s, fsync_s
    etas = [0, 4] if quick else [0, 1, 2, 4, 8]
    names = ["areal-7b", "7b-192gen-64train"] if quick else list(SHAPES)
    rows, limits, compare = [], [], []
    for name in names:
        shape = replace(SHAPES[name], ctl_msg_s=ctl, steps=8 if quick else 12)
        d = derived(shape)
        base = None
        for eta in etas:
            got = simulate_shape(shape, eta, shrink)
            base = got if eta == 0 else base
            speed = got["samples_per_s"] / base["samples_per_s"] if base else float("nan")
            rows.append({"shape": name, "gen_gpus": shape.gen_gpus, "train_gpus": shape.train_gpus, "eta": eta,
                         "speedup_vs_eta0": speed, **got})
            if eta == max(etas):
                tokens_per_sample = d["mean_len"]
                weight_bytes_s = d["fetch_bytes"] * shape.gen_gpus / got["step_s"]
                limits.append({
                    "shape": name, "eta": eta, "samples_per_s": got["samples_per_s"],
                    "controller_msgs_per_s": got["controller_msgs_per_s"], "controller_capacity_msgs_per_s": 1 / ctl,
                    "controller_use": got["controller_msgs_per_s"] * ctl,
                    # the model times empty NoWork retries without charging them; the worst case is every worker
                    # parked at a closed gate, each asking once per back-off (no_work_retry_s of the fleet)
                    "nowork_polls_per_s_max": shape.gen_gpus / no_work_retry_s(shape.gen_gpus),
                    "weight_sync_GB_per_version": d["fetch_bytes"] * shape.gen_gpus / 1e9,
                    "weight_sync_GB_per_s": weight_bytes_s / 1e9, "publisher_link_GB_per_s": shape.egress_bw / 1e9,
                    "fetch_s_per_version": got["fetch_s"],
                    "log_MB_per_s": got["samples_per_s"] * tokens_per_sample * LOG_BYTES_PER_TOKEN / 1e6,
                    "log_fsyncs_per_s": got["samples_per_s"] / LOG_FSYNC_EVERY, "fsync_s_here": fsync,
                    "log_fsync_use": got["samples_per_s"] / LOG_FSYNC_EVERY * fsync})
        if name in AREAL:
            a = AREAL[name]
            sync = next(r for r in rows if r["shape"] == name and r["eta"] == 0)
            best = max((r for r in rows if r["shape"] == name), key=lambda r: r["speedup_vs_eta0"])
            at4 = next((r for r in rows if r["shape"] == name and r["eta"] == 4), best)
            compare.append({"shape": name, "areal_speedup": a["sync_hours"] / a["async_hours"],
                            "predicted_speedup_eta4": at4["speedup_vs_eta0"], "predicted_best": best["speedup_vs_eta0"],
                            "best_eta": best["eta"], "areal_sync_step_s": a["sync_hours"] * 3.6,
                            "predicted_sync_step_s": sync["step_s"], "areal_async_step_s": a["async_hours"] * 3.6,
                            "predicted_async_step_s_eta4": at4["step_s"]})
    show(f"cluster shapes (simulated at 1/{shrink} size, rates for the full cluster); assumptions: "
         + "; ".join(ASSUMPTIONS), rows,
         ["shape", "gen_gpus", "train_gpus", "eta", "step_s", "samples_per_s", "speedup_vs_eta0",
          "gen_busy", "learner_busy", "controller_busy", "train_s", "fetch_s", "staleness"])
    if compare:
        show("async/sync speedup vs AReaL v0.3 Table 2 (1000 PPO steps; hours x 3.6 = seconds per step)",
             compare, list(compare[0]))
    show("what limits scale (at the largest eta): load on the shared pieces vs their capacity", limits,
         list(limits[0]))
    return {"assumptions": ASSUMPTIONS, "shrink": shrink, "shapes": {n: derived(SHAPES[n]) for n in names},
            "rows": rows, "areal": compare, "limits": limits, "controller_msg_s": ctl, "fsync_s": fsync}
