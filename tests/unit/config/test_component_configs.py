"""The run schema holds the library's own config types: every library option is a key of the composed
Hydra config, a ``key=value`` override changes what the library sees, the per-objective defaults apply
with or without a group file, and the group files give the objectives they gave before."""

from __future__ import annotations

import ast
import dataclasses
import json
from pathlib import Path

import pytest

from asyncrl.config.algo import OBJECTIVE_DEFAULTS, OBJECTIVES, AlgoConfig, ObjectiveConfig, objective_default
from asyncrl.config.loader import (
    CONFIG_DIR,
    apply_overrides,
    config_from_dict,
    load_train_config,
    schema_keys,
)
from asyncrl.config.schema import to_dict

ROOT = Path(__file__).resolve().parents[3]
BEFORE = json.loads((Path(__file__).parent / "data" / "algo_groups_at_886df6d.json").read_text())
"""What each ``configs/algo`` file resolved to before the run schema held ``AlgoConfig`` (commit 886df6d,
``workers/learner/process.objective_config`` then copied the fields by hand), with the values in effect."""


def in_effect(cfg) -> dict:
    """The objective a run trains with, in the recorded form (the kind's defaults filled in)."""
    a = cfg.algo
    out = {f.name: getattr(a, f.name) for f in dataclasses.fields(ObjectiveConfig)}
    out["kind"] = out.pop("objective")
    out |= {"eps_low": a.clip_low, "eps_high": a.clip_high, "agg": a.aggregation,
            "rs_modes": list(a.rs_modes), "rs_thresholds": list(a.rs_thresholds)}
    return out | {"advantage": a.advantage, "group_size": a.group_size, "dynamic_sampling": a.dynamic_sampling,
                  "n_minibatches": cfg.learner.n_minibatches}


def test_the_recording_covers_every_algo_group_file():
    assert sorted(BEFORE) == sorted(p.stem for p in (CONFIG_DIR / "algo").glob("*.yaml"))


@pytest.mark.parametrize("group", sorted(BEFORE))
def test_every_algo_group_file_gives_the_objective_it_gave_before(group):
    assert in_effect(load_train_config([f"algo={group}"])) == BEFORE[group]


@pytest.mark.parametrize("objective", OBJECTIVES)
def test_the_objective_defaults_apply_with_or_without_the_group_file(objective):
    alone = load_train_config([f"algo.objective={objective}"]).algo
    for name, value in (("eps_low", alone.clip_low), ("eps_high", alone.clip_high), ("agg", alone.aggregation)):
        assert value == objective_default(objective, name)
    if (CONFIG_DIR / "algo" / f"{objective}.yaml").is_file():
        grouped = load_train_config([f"algo={objective}"]).algo
        assert (grouped.clip_low, grouped.clip_high, grouped.aggregation) == (
            alone.clip_low, alone.clip_high, alone.aggregation)


def test_gspo_alone_trains_with_its_own_bands():
    a = load_train_config(["algo.objective=gspo"]).algo
    assert (a.clip_low, a.clip_high, a.aggregation) == (3e-4, 4e-4, "seq-mean-token-mean")
    assert OBJECTIVE_DEFAULTS["gspo"] == {"eps_low": 3e-4, "eps_high": 4e-4, "agg": "seq-mean-token-mean"}


def test_an_explicit_value_wins_over_the_objective_default():
    for overrides in (["algo=gspo", "algo.eps_high=0.3", "algo.agg=token-mean"],
                      ["algo.objective=gspo", "algo.eps_high=0.3", "algo.agg=token-mean"]):
        a = load_train_config(overrides).algo
        assert (a.clip_low, a.clip_high, a.aggregation) == (3e-4, 0.3, "token-mean")


def test_changing_the_objective_of_a_saved_run_takes_the_new_objectives_defaults():
    # config.json keeps what the user wrote (null = the objective's own), so a replay with another
    # objective does not inherit GSPO's bands.
    saved = config_from_dict(json.loads(json.dumps(to_dict(load_train_config(["algo=gspo"])))))
    assert (saved.algo.eps_low, saved.algo.clip_low) == (None, 3e-4)
    tis = apply_overrides(saved, ["algo=tis"]).algo
    assert (tis.objective, tis.clip_low, tis.clip_high, tis.aggregation) == ("tis", 0.2, 0.2, "token-mean")


# One override per option, each with a value that differs from its default; a field added to
# AlgoConfig without a row here fails test_the_table_covers_every_option.
BASE = ["algo.objective=tis"]
OPTION_OVERRIDES: dict[str, tuple[list[str], object]] = {
    "objective": (["algo.objective=gspo"], "gspo"),
    "eps_low": (BASE + ["algo.eps_low=0.1"], 0.1),
    "eps_high": (BASE + ["algo.eps_high=0.28"], 0.28),
    "dual_clip": (BASE + ["algo.dual_clip=2.5"], 2.5),
    "is_cap": (BASE + ["algo.is_cap=1.5"], 1.5),
    "is_level": (BASE + ["algo.is_level=sequence"], "sequence"),
    "behav_cap": (BASE + ["algo.behav_cap=null"], None),
    "rs_modes": (BASE + ["algo.rs_modes=[seq_mean_k1]", "algo.rs_thresholds=['0.999_1.001']"], ("seq_mean_k1",)),
    "rs_thresholds": (BASE + ["algo.rs_modes=[token_k3]", "algo.rs_thresholds=['0.5']"], ("0.5",)),
    "tbpo_eps_pos_high": (BASE + ["algo.tbpo_eps_pos_high=1e-3"], 1e-3),
    "tbpo_eps_neg_low": (BASE + ["algo.tbpo_eps_neg_low=2e-4"], 2e-4),
    "tbpo_eps_neg_high": (BASE + ["algo.tbpo_eps_neg_high=5e-4"], 5e-4),
    "tbpo_w_low": (BASE + ["algo.tbpo_w_low=0.25"], 0.25),
    "tbpo_w_high": (BASE + ["algo.tbpo_w_high=4.0"], 4.0),
    "tbpo_w_mode": (BASE + ["algo.tbpo_w_mode=drop"], "drop"),
    "agg": (BASE + ["algo.agg=seq-mean-token-sum"], "seq-mean-token-sum"),
    "rejection_denominator": (BASE + ["algo.rejection_denominator=post_mask"], "post_mask"),
    "kl_coef": (BASE + ["algo.kl_coef=0.01"], 0.01),
    "entropy_coef": (BASE + ["algo.entropy_coef=0.02"], 0.02),
    "eta_max": (BASE + ["algo.eta_max=3"], 3),
    "stale_level": (BASE + ["algo.stale_level=sequence"], "sequence"),
    "abort_on_nonfinite_theta": (BASE + ["algo.abort_on_nonfinite_theta=false"], False),
    "advantage": (BASE + ["algo.advantage=rloo"], "rloo"),
    "group_size": (BASE + ["algo.group_size=4"], 4),
    "dynamic_sampling": (BASE + ["algo.dynamic_sampling=true"], True),
}


def test_the_table_covers_every_option():
    assert set(OPTION_OVERRIDES) == {f.name for f in dataclasses.fields(AlgoConfig)}


def test_every_objective_option_is_a_key_of_the_composed_config():
    keys = schema_keys()
    assert {f.name for f in dataclasses.fields(ObjectiveConfig)} <= {f.name for f in dataclasses.fields(AlgoConfig)}
    for f in dataclasses.fields(AlgoConfig):
        assert f"algo.{f.name}" in keys, f"ObjectiveConfig.{f.name} cannot be set from the command line"


@pytest.mark.parametrize("name", sorted(OPTION_OVERRIDES))
def test_an_override_changes_the_value_the_library_sees(name):
    overrides, expected = OPTION_OVERRIDES[name]
    default = getattr(load_train_config(BASE).algo, name)
    cfg = load_train_config(overrides)
    assert isinstance(cfg.algo, ObjectiveConfig)  # the object the learner hands to the loss, as is
    assert getattr(cfg.algo, name) == expected != default


def test_the_learner_hands_the_runs_algo_config_to_the_training_step():
    tree = ast.parse((ROOT / "workers" / "learner" / "process.py").read_text())
    calls = [n for n in ast.walk(tree) if isinstance(n, ast.Call) and getattr(n.func, "id", "") == "train_step"]
    assert calls and all(ast.unparse(c.args[2]) in ("cfg.algo", "self.cfg.algo") for c in calls)
    assert "ObjectiveConfig(" not in (ROOT / "workers" / "learner" / "process.py").read_text()


@pytest.mark.parametrize(("override", "message"), [
    ("algo.is_cap=-1", "algo.is_cap=-1.0 must be a finite number > 0"),
    ("algo.eps_low=1.5", "algo.eps_low=1.5 must be in (0, 1)"),
    ("algo.objective=grpo", "algo.objective='grpo' is not valid; choose one of: ppo, decoupled"),
    ("algo.group_size=1", "algo.group_size=1: GRPO needs groups of >= 2"),
    ("algo.rs_modes=[token_k3]", "give one threshold per mask"),
])
def test_validation_is_the_librarys_and_names_the_key(override, message):
    with pytest.raises(ValueError) as err:
        load_train_config([override])
    assert message in str(err.value)


def test_a_misspelt_objective_option_names_the_nearest_key():
    with pytest.raises(ValueError, match="did you mean algo.stale_level"):
        load_train_config(["algo.stale_levl=sequence"])
