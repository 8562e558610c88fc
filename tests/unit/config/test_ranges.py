"""Every numeric key has one range, and ``validate`` refuses a value outside it (or nan/inf) before any
process starts, naming the key, the value and the allowed range; the run name is one folder name."""

from __future__ import annotations

import dataclasses
import typing

import pytest

from asyncrl.config.loader import load_train_config, schema_keys
from asyncrl.config.ranges import INTERVALS, RANGES, Interval, check_run_name
from asyncrl.config.schema import TrainConfig


def numeric_keys(schema: type | None = None) -> set[str]:
    """Every int/float leaf of ``schema`` (default ``TrainConfig``, outside ``algo.*``, which validates itself)."""
    out: set[str] = set()

    def walk(schema: type, prefix: str) -> None:
        hints = typing.get_type_hints(schema)
        for f in dataclasses.fields(schema):
            kind = hints[f.name]
            if isinstance(kind, type) and dataclasses.is_dataclass(kind):
                if f"{prefix}{f.name}" != "algo":
                    walk(kind, f"{prefix}{f.name}.")
            elif kind in (int, float):
                out.add(f"{prefix}{f.name}")

    walk(schema or TrainConfig, "")
    return out


def test_every_numeric_key_has_exactly_one_range():
    assert set(RANGES) == numeric_keys()
    assert set(RANGES) <= set(schema_keys())


def test_every_numeric_worker_setting_has_a_range_and_shared_keys_share_the_runs():
    from asyncrl.config.ranges import WORKER_RANGES, check_ranges
    from asyncrl.config.roles import WorkerRoleConfig

    assert set(WORKER_RANGES) == numeric_keys(WorkerRoleConfig)
    for key in set(WORKER_RANGES) & set(RANGES) - {"rollout.worker_slots"}:
        assert WORKER_RANGES[key] == RANGES[key], key
    assert WORKER_RANGES["rollout.worker_slots"][0] == "[0, inf)"  # the run's range, and 0: take the run's
    check_ranges(WorkerRoleConfig(), WORKER_RANGES)  # the defaults are inside


def test_every_default_is_inside_its_range():
    load_train_config([])  # validate runs on the defaults


@pytest.mark.parametrize("override,message", [
    # each value below passed validate at 8f23feb and failed only inside a started process
    ("learner.min_lr_ratio=2", "learner.min_lr_ratio=2.0 must be in [0, 1]"),
    ("learner.weight_decay=-1", "learner.weight_decay=-1.0 must be >= 0"),
    ("learner.lr=inf", "learner.lr=inf is not a finite number; allowed: in (0, 1]"),
    ("learner.lora.alpha=nan", "learner.lora.alpha=nan is not a finite number; allowed: > 0"),
    ("rollout.heartbeat_s=-1", "rollout.heartbeat_s=-1.0 must be > 0"),
    ("learner.warmup_steps=-5", "learner.warmup_steps=-5 must be >= 0"),
    ("learner.grad_clip=nan", "learner.grad_clip=nan is not a finite number"),
    ("rollout.temperature=inf", "rollout.temperature=inf is not a finite number; allowed: > 0"),
    ("rollout.dead_after_s=inf", "rollout.dead_after_s=inf is not a finite number"),
    ("quant.aqn_stages=0", "quant.aqn_stages=0 must be >= 1"),
    ("quant.uaq_scale=0", "quant.uaq_scale=0.0 must be > 0"),
    ("task.eval_size=-1", "task.eval_size=-1 must be >= 1"),
    ("model.warmstart_lr=nan", "model.warmstart_lr=nan is not a finite number"),
    ("rollout.groups_per_step=1000000000", "rollout.groups_per_step=1000000000 must be in [1, 4096]"),
    ("transport.port=70000", "transport.port=70000 must be in [0, 65535]"),
    ("transport.port=-1", "transport.port=-1 must be in [0, 65535]"),
    ("rollout.eta=-1", "rollout.eta=-1 must be >= 0 (0 = synchronous training)"),
    ("learner.lora.dropout=1", "learner.lora.dropout=1.0 must be in [0, 1)"),
    ("learner.time_budget_s=-inf", "learner.time_budget_s=-inf is not a finite number"),
    ("seed=-1", "seed=-1 must be in [0, 4294967295]"),
])
def test_out_of_range_values_are_refused_naming_key_value_and_range(override, message):
    with pytest.raises(ValueError) as err:
        load_train_config([override])
    assert message in str(err.value)


@pytest.mark.parametrize("name,message", [
    ("", "run_name is empty"),
    ("../../etc", "must be one folder name"),
    ("a/b", "must be one folder name"),
    ("..", "must be one folder name"),
    (".", "must be one folder name"),
])
def test_run_name_must_be_one_folder_name(name, message):
    with pytest.raises(ValueError, match=message):
        load_train_config([f"run_name={name}"])


def test_ordinary_run_names_and_boundary_values_pass():
    check_run_name("demo-2.v1")
    cfg = load_train_config(["transport.port=65535", "learner.min_lr_ratio=1", "learner.grad_clip=-1",
                             "rollout.groups_per_step=4096", "learner.lora.dropout=0.5"])
    assert cfg.transport.port == 65535 and cfg.learner.grad_clip == -1


def test_intervals_parse_their_ends():
    closed, half = Interval.parse("[0, 1]"), Interval.parse("(0, inf)")
    assert 0 in closed and 1 in closed and 1.5 not in closed
    assert 0 not in half and 1e300 in half
    assert INTERVALS["learner.lora.dropout"].describe() == "in [0, 1)"
