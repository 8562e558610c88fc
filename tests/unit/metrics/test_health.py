"""Training-health alarms: replays of recorded runs, each alarm's rule, the rate limit, ``health.jsonl``.

The recorded runs under ``data/`` are the ``metrics.jsonl`` of real ``asyncrl train`` runs (tiny model,
2026-12-04, 2-core shared CPU, on top of 8f23feb), trimmed to the columns the alarms read:
- ``collapse_addition2_lr3e-3.jsonl``: ``task=addition2 learner.total_steps=60 learner.lr=3e-3
  learner.lr_schedule=constant learner.warmup_steps=0 learner.eval_every=20``: every group has zero
  reward variance from the start, and the model comes to answer every prompt with its end-of-text
  token alone from step 52 (mean response length 5.3 -> 1.2 tokens, one response taking 70-86% of each batch).
- ``diverged_addition_lr1e-2.jsonl``: the default task at ``learner.lr=1e-2`` (constant, no warm-up):
  greedy accuracy 0.75 at step 0, every reward 0 from step 4 on, one response taking ~90% of each batch.
- ``healthy_default.jsonl``: the default run, ``learner.total_steps=80 learner.eval_every=20``.

Two SmolLM2-135M-Instruct runs of the README's LoRA recipe (``+experiment=smollm2_signed_sums quant.fmt=int8
rollout.eta=2 algo=acr learner.lora.rank=16 learner.lora.alpha=32 learner.lr=2e-4 learner.lr_schedule=constant
learner.eval_every=50``; 2026-12-04, side by side on the 2-core CPU, at 82ee4ed), trimmed the same way:
- ``stalled_smollm2_signed3_lora.jsonl``: three signed terms (``task.rg_config={min_terms:3,max_terms:3,
  min_digits:1,max_digits:1,allow_negation:true}``), stopped after 152 steps: greedy 0.065 at steps 0,
  50 and 150 (0.070 at 100), sampled reward 0.02-0.04 throughout, 75-90% of groups without variance,
  responses 21 -> 10 tokens from step 60 on.
- ``learning_smollm2_signed2_lora.jsonl``: the preset's two signed terms, 240 steps: greedy 0.17 -> 0.315
  by step 50, sampled reward 0.05 -> 0.2-0.4, responses 22 -> 7 tokens (the preamble dropped) and
  70-100% of groups without variance (the policy is sure of most answers).
The workers' NoWork back-off counter is stored as ``controller/workers/told_to_wait_ms`` (it was recorded in
seconds; the values are the same).
"""

from __future__ import annotations

import io
import json
from pathlib import Path

import numpy as np
import pytest

import protocols as P
from asyncrl.config.health import ALARM_NAMES, HealthConfig, check_health
from asyncrl.config.loader import load_train_config
from asyncrl.config.schema import TrainConfig
from asyncrl.controller.batches import response_metrics
from asyncrl.metrics import Progress
from asyncrl.metrics.health import ALARMS, HealthMonitor, replay
from asyncrl.metrics.health_log import HealthWatch, alarms_report, format_alarm, read_alarms, summarize_alarms
from asyncrl.metrics.writer import MetricsWriter

DATA = Path(__file__).parent / "data"


def recorded(name: str) -> list[dict]:
    return [json.loads(line) for line in (DATA / name).read_text().splitlines()]


def fired(records, cfg: HealthConfig | None = None) -> dict[str, list[int]]:
    out: dict[str, list[int]] = {}
    for a in replay(records, cfg or HealthConfig()):
        out.setdefault(a.name, []).append(a.step)
    return out


def train_record(step: int, **metrics: float) -> dict:
    base = {"train/reward_mean": 0.5, "train/response_len_mean": 10.0, "actor/entropy": 1.0,
            "train/zero_variance_groups": 0.1, "train/majority_answer_share": 0.1, "time/learner_busy_frac": 0.6,
            "learner/updates": 2.0}
    return {"step": step, **base, **metrics}


# ----------------------------------------------------------------------------------- recorded runs
def test_the_recorded_length_collapse_raises_its_alarms_within_the_window():
    records = recorded("collapse_addition2_lr3e-3.jsonl")
    cfg = HealthConfig()
    alarms = fired(records, cfg)
    # the collapse: the first step whose length is below health.length_ratio of the early mean
    lengths = [(r["step"], r["train/response_len_mean"]) for r in records if "train/response_len_mean" in r]
    early = np.mean([v for _, v in lengths[: cfg.early_steps]])
    onset = next(s for s, v in lengths[cfg.early_steps:] if v < cfg.length_ratio * early)
    assert onset == 52
    assert alarms["length_collapse"] and onset <= alarms["length_collapse"][0] <= onset + cfg.window
    assert alarms["answer_takeover"] and onset <= alarms["answer_takeover"][0] <= onset + cfg.window
    # every group had zero variance from step 1: raised once the reward's early mean and a full window
    # after it show no gain (step 15), not again within the 60 steps (repeat_every 50)
    assert alarms["zero_variance"] == [cfg.early_steps + cfg.window]
    assert alarms["reward_flat"] == [60]  # the evaluation at step 60, the first at or after flat_after_steps
    assert "nonfinite" not in alarms and "entropy_collapse" not in alarms


def test_the_recorded_divergence_raises_zero_variance_one_answer_and_flat_reward():
    alarms = fired(recorded("diverged_addition_lr1e-2.jsonl"))
    # every reward 0 from step 4: raised once the window after the early steps shows no gain (step 15)
    assert alarms["zero_variance"][0] == 15
    assert alarms["answer_takeover"][0] <= 15
    assert alarms["reward_flat"] == [60]  # greedy 0.000 at step 60 against 0.750 at step 0


def test_the_recorded_healthy_run_raises_nothing():
    assert fired(recorded("healthy_default.jsonl")) == {}


def test_the_recorded_smollm2_runs_alarm_on_the_three_term_run_and_not_on_the_two_term_run():
    """SmolLM2-135M-Instruct, the README's LoRA recipe, on three signed terms (no learning) and on the
    preset's two signed terms (learning), recorded side by side (module docstring)."""
    dead = recorded("stalled_smollm2_signed3_lora.jsonl")
    alarms = fired(dead)
    # most groups carry no gradient from the start and the reward never rises: raised as soon as the
    # reward's early mean and a window after it are known, then every repeat_every steps
    c = HealthConfig()
    assert alarms["zero_variance"][0] == c.early_steps + c.window
    assert alarms["reward_flat"] == [50, 100, 150]  # greedy 0.065, 0.070, 0.065 against 0.065 at step 0
    # the responses halve (21 -> 10 tokens) while the reward stays where it started: raised within the
    # window of the step where the windowed length first falls below half the early mean
    lengths = [(r["step"], r["train/response_len_mean"]) for r in dead if "train/response_len_mean" in r]
    early = np.mean([v for _, v in lengths[:c.early_steps]])
    onset = next(s for s, _ in lengths[c.early_steps + c.window:]
                 if np.mean([v for t, v in lengths if s - c.window < t <= s]) < c.length_ratio * early)
    assert alarms["length_collapse"][0] == onset
    learning = recorded("learning_smollm2_signed2_lora.jsonl")
    # the same recipe on the two-term task halves its responses and has as many zero-variance groups
    # early on, but its reward climbs: nothing is raised
    lengths = [r["train/response_len_mean"] for r in learning if "train/response_len_mean" in r]
    assert np.mean(lengths[-c.window:]) < c.length_ratio * np.mean(lengths[:c.early_steps])
    zero_var = [r["train/zero_variance_groups"] for r in learning if "train/zero_variance_groups" in r]
    assert np.mean(zero_var[:c.window]) > c.zero_variance_share
    assert fired(learning) == {}
    # what the rules raised before the learning gate (health.learning_gain) existed
    assert {"zero_variance", "length_collapse"} <= set(fired(learning, HealthConfig(learning_gain=1.0)))


def test_tighter_thresholds_make_the_healthy_run_raise_the_matching_alarm():
    records = recorded("healthy_default.jsonl")
    assert "zero_variance" not in fired(records, HealthConfig(zero_variance_share=0.0))  # it learns: quiet
    assert "zero_variance" in fired(records, HealthConfig(zero_variance_share=0.0, learning_gain=1.0))
    assert "learner_bound" in fired(records, HealthConfig(learner_busy_max=0.5, workers_idle_max=0.5))
    assert "rollout_bound" in fired(records, HealthConfig(learner_busy_min=1.0))


# ------------------------------------------------------------------------------------- each rule
def test_entropy_collapse_and_its_silence_on_a_solved_task():
    falling = [train_record(s, **{"actor/entropy": 1.0 if s <= 5 else 0.1, "train/reward_mean": 0.1})
               for s in range(1, 21)]
    assert fired(falling)["entropy_collapse"] == [15]  # 5 early steps, then a full window of 10
    solved = [dict(r, **{"train/reward_mean": 1.0}) for r in falling]
    assert "entropy_collapse" not in fired(solved)


def test_a_step_without_entropy_is_skipped_not_taken_as_zero():
    records = [train_record(s) for s in range(1, 30)]
    for r in records[5:]:
        del r["actor/entropy"]
    assert "entropy_collapse" not in fired(records)


def test_nonfinite_fires_on_a_null_metric_and_on_skipped_updates():
    assert fired([train_record(3, **{"learner/grad_norm": None})])["nonfinite"] == [3]
    assert fired([train_record(4, **{"learner/skipped_nonfinite_minibatches": 1.0})])["nonfinite"] == [4]
    assert fired([train_record(4, **{"learner/grad_norm": float("nan")})])["nonfinite"] == [4]  # live, before JSON
    assert "nonfinite" not in fired([train_record(4, **{"learner/grad_norm": None})], HealthConfig(nonfinite=False))


def test_reward_flat_from_the_train_reward_without_evaluations():
    flat = [train_record(s, **{"train/reward_mean": 0.3}) for s in range(1, 61)]
    assert fired(flat)["reward_flat"] == [50]
    rising = [train_record(s, **{"train/reward_mean": 0.3 + 0.01 * s}) for s in range(1, 61)]
    assert "reward_flat" not in fired(rising)


def test_rate_limit_repeats_a_standing_alarm_every_repeat_every_steps():
    records = [train_record(s, **{"train/zero_variance_groups": 1.0}) for s in range(1, 121)]
    assert fired(records)["zero_variance"] == [15, 65, 115]
    assert fired(records, HealthConfig(repeat_every=30))["zero_variance"] == [15, 45, 75, 105]


def test_learner_bound_needs_a_busy_learner_and_waiting_workers():
    def run(busy: float) -> dict:
        return fired([train_record(s, **{"time/learner_busy_frac": busy, "time/wall_s": float(s),
                                         "workers/alive": 2.0, "controller/workers/told_to_wait_ms": 1900 * s})
                      for s in range(1, 15)])
    assert run(0.97)["learner_bound"] == [11]  # a full window: steps 2-11 (step 1 also waited for the workers)
    assert "learner_bound" not in run(0.9)


def test_disabled_monitor_raises_nothing():
    records = [train_record(s, **{"train/zero_variance_groups": 1.0}) for s in range(1, 30)]
    assert HealthMonitor(HealthConfig(enabled=False)).observe(1, records[0]) == []
    assert fired(records, HealthConfig(enabled=False)) == {}


def test_every_alarm_names_a_threshold_key_of_the_health_section():
    keys = {f"health.{k}" for k in HealthConfig.__dataclass_fields__}
    assert {s.threshold_key for s in ALARMS.values()} <= keys | {"rollout.quarantine_after"}  # the one event alarm


def test_the_config_names_exactly_the_alarms_the_monitor_raises():
    # learner.stop_on is checked against the config's names; the monitor's catalogue must hold the same ones
    assert tuple(ALARMS) == ALARM_NAMES
    assert TrainConfig().health == HealthConfig()


# ------------------------------------------------------------------------------ configuration
def test_health_keys_and_stop_on_are_hydra_overrides_checked_before_any_process():
    cfg = load_train_config(["learner.stop_on=[zero_variance,reward_flat]", "health.window=4"])
    assert cfg.learner.stop_on == ["zero_variance", "reward_flat"] and cfg.health.window == 4
    with pytest.raises(ValueError, match="choose from length_collapse"):
        load_train_config(["learner.stop_on=[zero_var]"])
    with pytest.raises(ValueError, match=r"health.length_ratio=2.0 must be in \[0, 1\]"):
        load_train_config(["health.length_ratio=2"])
    with pytest.raises(ValueError, match="drop health.enabled=false"):
        check_health(HealthConfig(enabled=False), ["nonfinite"])
    with pytest.raises(ValueError, match="health.window=0 must be >= 1"):
        load_train_config(["health.window=0"])


# ------------------------------------------------------------------------------ the controller side
def arr(ids):
    return P.Array.from_numpy(np.asarray(ids, np.int32))


def test_majority_answer_share_counts_the_batch_most_common_response_without_stop_tokens():
    m = response_metrics([True, False], [arr([7, 2]), arr([7]), arr([7, 2]), arr([5, 2])], stop_ids=[2])
    assert m["train/majority_answer_share"] == 0.75


def test_watch_writes_health_jsonl_names_the_stop_and_resumes_without_raising_again(tmp_path):
    records = [train_record(s, **{"train/zero_variance_groups": 1.0}) for s in range(1, 31)]
    with MetricsWriter(tmp_path, tensorboard=False) as w:
        for r in records:
            w.log(r["step"], {k: v for k, v in r.items() if k != "step"})
    watch = HealthWatch(tmp_path, HealthConfig(), ["zero_variance"])
    raised = [a for r in records for a in watch.observe(r["step"], r)]
    watch.close()
    assert [(a["step"], a["alarm"], a["stop"]) for a in raised] == [(15, "zero_variance", True)]
    assert watch.stop_reason.startswith("health alarm zero_variance at step 15 (learner.stop_on)")
    assert read_alarms(tmp_path) == raised
    assert "-> stopping (learner.stop_on)" in format_alarm(raised[0])
    # resumed at step 5: the alarm at step 15 is dropped, and raised again when the run gets there
    resumed = HealthWatch(tmp_path, HealthConfig(), resume_step=5)
    assert read_alarms(tmp_path) == []
    again = [a for r in records[5:] for a in resumed.observe(r["step"], r)]
    assert [a["step"] for a in again] == [15]
    # resumed at step 20: the replay restores the rate limit, so nothing is raised twice
    resumed = HealthWatch(tmp_path, HealthConfig(), resume_step=20)
    assert [a for r in records[20:] for a in resumed.observe(r["step"], r)] == []
    assert summarize_alarms(tmp_path) == {"health_alarms": 1, "health_alarm_list": "zero_variance@15"}


def test_alarms_report_reads_health_jsonl_or_replays_metrics(tmp_path):
    assert alarms_report(tmp_path) == "health alarms: none (no metrics.jsonl)"
    with MetricsWriter(tmp_path, tensorboard=False) as w:
        for r in recorded("diverged_addition_lr1e-2.jsonl"):
            w.log(r["step"], {k: v for k, v in r.items() if k != "step"})
    text = alarms_report(tmp_path)
    assert text.startswith("health alarms: 3 (replayed from metrics.jsonl)")
    assert "step    60  reward_flat" in text and "try algo.dynamic_sampling=true" in text
    (tmp_path / "health.jsonl").write_text("")
    assert alarms_report(tmp_path) == "health alarms: none (health.jsonl)"


def test_progress_note_prints_an_alarm_line_between_progress_lines():
    out = io.StringIO()
    p = Progress(10, stream=out, force_plain=True)
    p.note("health alarm zero_variance at step 3: ...")
    p.close()
    assert out.getvalue().splitlines()[0] == "health alarm zero_variance at step 3: ..."


def test_plots_mark_where_an_alarm_fired(tmp_path):
    from matplotlib.figure import Figure

    from asyncrl.metrics.plots import ALARM_MARKED, make_plots, mark_alarms

    with MetricsWriter(tmp_path, tensorboard=False) as w:
        for r in recorded("diverged_addition_lr1e-2.jsonl"):
            w.log(r["step"], {k: v for k, v in r.items() if k != "step"})
    watch = HealthWatch(tmp_path, HealthConfig())
    for r in recorded("diverged_addition_lr1e-2.jsonl"):
        watch.observe(r["step"], r)
    watch.close()
    written = {p.name for p in make_plots(tmp_path)}
    assert "reward.png" in written and set(ALARM_MARKED) <= written
    axes = Figure().subplots(2, 1, squeeze=False)[:, 0]
    mark_alarms(axes, read_alarms(tmp_path))
    steps = sorted({int(line.get_xdata()[0]) for line in axes[1].lines})
    assert steps == sorted({a["step"] for a in read_alarms(tmp_path)}) == [11, 15, 60]
    assert {t.get_text() for t in axes[0].texts} == {"zero_variance", "answer_takeover", "reward_flat"}


def test_a_quarantined_worker_raises_worker_quarantined_naming_it_at_once_and_a_replay_counts_it(tmp_path):
    quarantined = {"gpu-3": "8 invalid samples in a row (rollout.quarantine_after=8), the last: behaviour "
                            "log-probs must be <= 0 and not NaN"}
    rows = [train_record(s, **{"controller/workers/quarantined": float(s >= 3) + float(s >= 5)}) for s in range(1, 9)]
    watch = HealthWatch(tmp_path, HealthConfig())
    raised = [a for r in rows for a in watch.observe(
        r["step"], r, quarantined={"gpu-3": quarantined["gpu-3"], **({"gpu-7": "token ids"} if r["step"] >= 5 else {})})]
    watch.close()
    # an event, not a standing condition: each new quarantine is raised, however close to the last
    assert [(a["step"], a["alarm"], a["value"]) for a in raised] == [(3, "worker_quarantined", 1.0),
                                                                      (5, "worker_quarantined", 2.0)]
    assert "worker gpu-3 quarantined: 8 invalid samples in a row" in raised[0]["message"]
    assert "gpu-7" in raised[1]["message"] and "gpu-3" not in raised[1]["message"]
    assert raised[0]["threshold_key"] == "rollout.quarantine_after" and "restart it" in raised[0]["fix"]
    # replayed from metrics.jsonl (no names there): the same alarms at the same steps
    assert fired(rows) == {"worker_quarantined": [3, 5]}
    assert "controller's log names" in replay(rows, HealthConfig())[0].detail
