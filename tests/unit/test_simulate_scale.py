"""The scale simulator (asyncrl/sim: the model and its calibration) on synthetic stage times whose answer is known.

Each case fixes the stage costs so that the throughput follows from a formula: the synchronous step is
G + T + S (generation, training, weight sync one after another); with a large eta and a fast learner
the workers set the pace (workers x slots per generation round); with slow generation on a large eta the
learner sets it; processor sharing divides cores equally. The calibration's inversion recovers known
intrinsic costs from wall times inflated by CPU sharing. The cluster extrapolation runs at 1/32 size;
the command line (scripts/simulate_scale.py) answers --help and refuses a malformed option before it
starts anything.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from dataclasses import replace
from pathlib import Path

import pytest

from asyncrl.sim import Params, Sim, simulate, window_rate
from asyncrl.sim.calibrate import calibrate, pool_params
from asyncrl.sim.cluster import ClusterShape, controller_msg_s
from asyncrl.sim.extrapolate import extrapolate
from asyncrl.sim.params import fmt_hist
from asyncrl.sim.predict import tv_distance

ROOT = Path(__file__).resolve().parents[2]
B_GROUPS, G = 8, 8


def base(**kw) -> Params:
    p = Params(workers=1, eta=0, groups_per_step=B_GROUPS, group_size=G, slots=B_GROUPS * G, steps=12, train_s=0.3,
               publish_s=0.05, other_s=0.0, fetch_s=0.02, step_a=0.01, step_c=0.0, lengths=[5], msg_s=0.0,
               result_s=0.0, ctl_msg_s=0.0, cores=None)
    return replace(p, **kw)


def rate(p: Params) -> float:
    r = simulate(p)
    return window_rate(r.version_times, r.batch_samples)["samples_per_s"]


def test_eta0_is_synchronous_batch_over_generation_plus_training_plus_weight_sync():
    p = base()
    gen = max(p.lengths) * p.step_a  # every sample admitted in one step, 5 lock-step decode steps
    assert rate(p) == pytest.approx(B_GROUPS * G / (gen + p.train_s + p.publish_s + p.fetch_s), rel=1e-9)
    r = simulate(p)
    assert set(r.staleness) == {0}  # synchronous: nothing is stale


def test_large_eta_with_a_fast_learner_is_workers_times_the_per_worker_rate():
    p = base(workers=3, eta=8, slots=16, train_s=1e-4, publish_s=1e-4, fetch_s=0.0, lengths=[4], step_a=0.01, steps=60)
    per_worker = p.slots / (p.lengths[0] * p.step_a)  # a full credit window per generation round
    assert rate(p) == pytest.approx(p.workers * per_worker, rel=0.02)


def test_large_eta_with_fast_generation_is_paced_by_the_learner():
    p = base(workers=2, eta=4, train_s=0.4, publish_s=0.1, other_s=0.05, step_a=1e-4, steps=30)
    assert rate(p) == pytest.approx(B_GROUPS * G / (p.train_s + p.publish_s + p.other_s), rel=1e-6)


def test_asynchrony_overlaps_generation_with_training():
    sync, asyn = rate(base(eta=0, step_a=0.05)), rate(base(eta=2, step_a=0.05))
    p = base()
    gen = max(p.lengths) * 0.05
    assert asyn == pytest.approx(B_GROUPS * G / max(gen, p.train_s + p.publish_s), rel=0.02)
    assert asyn > sync


@pytest.mark.parametrize("eta", [0, 1, 3])
def test_no_consumed_sample_is_staler_than_eta(eta):
    r = simulate(base(workers=2, eta=eta, slots=16, step_a=0.02, lengths=[1, 3, 9], steps=20))
    assert max(r.staleness) <= eta and sum(r.staleness.values()) == 20 * B_GROUPS * G


@pytest.mark.parametrize(("cores", "procs", "finish"), [(1, 2, 2.0), (2, 2, 1.0), (2, 3, 1.5), (None, 5, 1.0)])
def test_busy_processes_share_the_cores_equally(cores, procs, finish):
    sim = Sim(cores)
    done = []
    for i in range(procs):
        sim.proc(f"p{i}").server("t").submit(1.0, lambda: done.append(sim.now))
    sim.run(lambda: False)
    assert done == pytest.approx([finish] * procs)


def test_a_link_shares_its_bandwidth_among_concurrent_transfers_and_takes_no_core():
    sim = Sim(1)
    link = sim.proc("link", cpu=False).server("l", shares_core=False)
    cpu = sim.proc("cpu").server("t")
    done = {}
    link.submit(1.0, lambda: done.setdefault("a", sim.now))
    link.submit(1.0, lambda: done.setdefault("b", sim.now))
    cpu.submit(1.0, lambda: done.setdefault("cpu", sim.now))
    sim.run(lambda: False)
    assert done == pytest.approx({"a": 2.0, "b": 2.0, "cpu": 1.0})


def test_calibration_recovers_intrinsic_costs_from_wall_times_inflated_by_cpu_sharing():
    true = base(workers=2, eta=2, slots=32, steps=30, train_s=0.2, publish_s=0.03, other_s=0.02, fetch_s=0.01,
                step_a=0.02, step_c=0.002, lengths=[2, 3, 4], cores=2)
    r = simulate(true)
    wall = {k: sum(v) / len(v) for k, v in r.stage_wall.items()}
    assert wall["train_s"] > true.train_s * 1.05  # the workers' engines took CPU from the learner
    w = window_rate(r.version_times, r.batch_samples)
    measured = {"workers": 2, "eta": 2, "groups_per_step": B_GROUPS, "group_size": G, "slots": 32, "steps": 30,
                "train_s": wall["train_s"], "publish_s": wall["publish_s"],
                "learner_s": wall["train_s"] + wall["publish_s"] + wall["other_s"], "fetch_s": wall["fetch_s"],
                "step_a": true.step_a * 1.5, "step_c": true.step_c * 1.5, "step_d": 0.0, "token_s": wall["token_s"],
                "lengths": [2, 3, 4], "cpus": 2, **w}
    got, history = calibrate(measured)
    assert got.train_s == pytest.approx(true.train_s, rel=0.05)
    assert got.publish_s == pytest.approx(true.publish_s, rel=0.1)
    assert got.step_a == pytest.approx(true.step_a, rel=0.1) and got.step_c == pytest.approx(true.step_c, rel=0.1)
    assert all(abs(v - 1) < 0.05 for v in history[-1].values())
    assert rate(got) == pytest.approx(w["samples_per_s"], rel=0.05)


def test_a_worker_asks_only_with_a_groups_worth_of_free_slots_as_the_real_worker_does():
    # Samples of mixed lengths finish one or a few at a time. With eta large the gate never shuts, so every
    # request the worker sends (free slots >= a group) is answered with work: no NoWork at all.
    r = simulate(base(workers=1, eta=8, slots=2 * G, lengths=[1, 2, 3, 5, 8, 13], steps=10))
    assert r.nowork == 0 and r.controller_msgs > 0


def test_params_refuse_a_credit_window_smaller_than_a_group():
    with pytest.raises(ValueError, match="raise slots"):
        base(slots=G - 1)


def test_pooled_calibration_takes_each_cost_as_the_median_over_runs_and_every_runs_lengths():
    runs = [base(train_s=t, step_a=a, lengths=n, workers=w) for t, a, n, w in
            ((0.2, 0.01, [3], 1), (0.5, 0.03, [4, 6], 2), (0.3, 0.02, [5], 4))]  # fmt: skip
    pooled = pool_params(runs)
    assert (pooled.train_s, pooled.step_a, pooled.publish_s) == (0.3, 0.02, 0.05)
    assert sorted(pooled.lengths) == [3, 4, 5, 6] and pooled.workers == 1
    # pooling copies of one calibration changes nothing: the same prediction
    assert rate(pool_params([runs[1]] * 3)) == pytest.approx(rate(runs[1]), rel=1e-12)


def test_predictions_compare_staleness_histograms_by_total_variation():
    assert tv_distance({0: 3, 1: 1}, {0: 30, 1: 10}) == 0.0  # the same shape at any count
    assert tv_distance({0: 5}, {2: 7}) == 1.0
    assert tv_distance({0: 1, 1: 1}, {0: 1}) == pytest.approx(0.5)
    assert fmt_hist({1: 1, 0: 3}) == "0:0.75 1:0.25"


def test_the_controller_cost_comes_from_the_best_row_of_a_bench_controller_result_file(tmp_path):
    path = tmp_path / "bench_controller.json"
    path.write_text(json.dumps({"tables": {"controller": [{"accepted_per_s": 800.0}, {"accepted_per_s": 1250.0}]}}))
    assert controller_msg_s(path) == pytest.approx(1 / 1250)
    assert controller_msg_s(tmp_path / "missing.json") == ClusterShape.ctl_msg_s  # the named default


def test_extrapolation_at_1_32_size_keeps_eta_and_charges_the_capacities_it_is_given():
    shown: list[tuple[str, list[dict], list[str]]] = []
    ctl, fsync = 1 / 1400, 0.004
    out = extrapolate(quick=True, shrink=32, ctl_msg_s=ctl, fsync_s=fsync, show=lambda *t: shown.append(t))
    titles = ("cluster shapes", "async/sync speedup vs AReaL", "what limits scale")
    assert len(shown) == 3 and all(t[0].startswith(title) for t, title in zip(shown, titles, strict=True))
    for _, rows, columns in shown:  # every printed column is in every row
        assert rows and all(set(columns) <= set(r) for r in rows)
    for r in out["rows"]:
        eta = r["eta"]
        assert max(int(k.split(":")[0]) for k in r["staleness"].split()) <= eta
        assert (r["speedup_vs_eta0"] == 1.0) if eta == 0 else (r["speedup_vs_eta0"] > 1.0)
    for lim in out["limits"]:
        assert lim["controller_use"] == pytest.approx(lim["controller_msgs_per_s"] * ctl)
        assert lim["log_fsync_use"] == pytest.approx(lim["log_fsyncs_per_s"] * fsync)
    with pytest.raises(ValueError, match="shrink must be >= 1"):
        extrapolate(quick=True, shrink=0, ctl_msg_s=ctl, fsync_s=fsync, show=lambda *t: None)


def _cli(*args: str) -> subprocess.CompletedProcess:
    env = dict(os.environ, PYTHONPATH=str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    return subprocess.run([sys.executable, str(ROOT / "scripts" / "simulate_scale.py"), *args], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=120, check=False)


def test_the_command_line_lists_its_modes_and_names_the_fix_for_a_bad_cell():
    helped = _cli("--help")
    assert helped.returncode == 0 and all(f in helped.stdout for f in ("--run", "--validate", "--extrapolate"))
    bad = _cli("--validate", "--calibrate-cell", "2")
    assert bad.returncode == 2 and "give W,E" in bad.stderr  # refused before any run starts
