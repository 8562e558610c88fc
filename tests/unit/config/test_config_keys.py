"""Configuration that says no: unknown keys are refused before any process starts (also with '+'),
naming the nearest valid key, and so are values of the wrong type, naming the key, the type and what it
accepts; model group files carry model-specific defaults."""

from __future__ import annotations

import pytest

from asyncrl.config.loader import (
    apply_overrides,
    check_known_keys,
    load_train_config,
    nearest_key,
    schema_keys,
)


@pytest.mark.parametrize(
    ("override", "suggested"),
    [
        ("+learner.gradient_checkpointing=true", None),
        ("+rollout.top_p=0.9", None),
        ("learner.lrr=1e-4", "learner.lr"),
        ("+model.warmstart_stepz=3", "model.warmstart_steps"),
        ("+task.answer_fromat=tag", "task.answer_format"),
        ("rollout.max_new_token=32", "rollout.max_new_tokens"),
    ],
)
def test_unknown_key_is_refused_even_with_plus(override: str, suggested: str | None) -> None:
    with pytest.raises(ValueError, match="unknown configuration key") as info:
        load_train_config([override])
    if suggested is not None:
        assert f"did you mean {suggested}?" in str(info.value)


def test_unknown_top_level_key_is_refused() -> None:
    with pytest.raises(ValueError, match="unknown configuration key 'foo'"):
        load_train_config(["+foo=1"])


def test_replay_overrides_refuse_unknown_keys_too() -> None:
    base = load_train_config([])
    with pytest.raises(ValueError, match="did you mean learner.lr"):
        apply_overrides(base, ["learner.lrr=1e-4"])


def test_free_form_generator_settings_are_not_checked_as_keys() -> None:
    cfg = load_train_config(["task=chain_sum", "task.rg_config={min_terms:2,max_digits:1}"])
    assert cfg.task.rg_config == {"min_terms": 2, "max_digits": 1}
    cfg = load_train_config(["task=chain_sum", "+task.rg_config.min_terms=3"])
    assert cfg.task.rg_config == {"min_terms": 3}


@pytest.mark.parametrize(
    ("override", "message"),
    [
        ("quant.uaq=maybe", "quant.uaq=maybe is not a bool; allowed: true or false"),
        ("rollout.groups_per_step=1e9", "rollout.groups_per_step=1e9 is not an int; it must be a whole number, "
         "written without a decimal point or exponent, e.g. rollout.groups_per_step=8; allowed: in [1, 4096] "
         "(prompt groups per learner step; the batch is this x group_size)"),
        ("rollout.eta=2.5", "rollout.eta=2.5 is not an int; it must be a whole number"),
        ("learner.lr=abc", "learner.lr=abc is not a float; it must be a number, e.g. learner.lr=0.0001; "
         "allowed: in (0, 1] (a learning rate, e.g. 1e-4)"),
        ("algo.dual_clip=x", "algo.dual_clip=x is not a float; it must be a number, e.g. algo.dual_clip=3.0"),
        ("learner.lora.target_modules=3", "learner.lora.target_modules=3 is not a list; give one in brackets, "
         "e.g. learner.lora.target_modules=[q_proj,k_proj,"),
    ],
)
def test_a_value_of_the_wrong_type_names_the_key_the_type_and_the_allowed_values(override: str, message: str) -> None:
    with pytest.raises(ValueError) as info:
        load_train_config([override])
    assert str(info.value).startswith(message), str(info.value)
    assert "Error merging override" not in str(info.value) and "\n" not in str(info.value)


def test_a_replay_or_resume_override_of_the_wrong_type_says_the_same() -> None:
    with pytest.raises(ValueError, match=r"^quant\.uaq=maybe is not a bool; allowed: true or false$"):
        apply_overrides(load_train_config([]), ["quant.uaq=maybe"])


def test_nearest_key_prefers_the_same_section() -> None:
    known = list(schema_keys())
    assert nearest_key("algo.kl_coeff", known) == "algo.kl_coef"
    assert nearest_key("learner.seed", known) == "learner.seed"


def test_check_known_keys_walks_nested_sections() -> None:
    check_known_keys({"learner": {"lr": 1.0}, "task": {"rg_config": {"anything": 1}}})
    with pytest.raises(ValueError, match="'transport.hots'.*transport.host"):
        check_known_keys({"transport": {"hots": "x"}})


def test_model_smollm2_alone_is_sized_for_this_machine() -> None:
    cfg = load_train_config(["model=smollm2"])
    assert cfg.model.name == "smollm2" and cfg.model.warmstart_steps == 0
    assert cfg.task.prompt_format == "chat"
    assert cfg.learner.lr <= 1e-4 and cfg.learner.micro_batch_size <= 16
    assert cfg.rollout.max_new_tokens >= 32 and cfg.rollout.num_workers == 1
    # an explicit override still wins over the model file
    assert load_train_config(["model=smollm2", "learner.lr=3e-5"]).learner.lr == 3e-5


def test_replay_applies_a_global_model_file() -> None:
    cfg = apply_overrides(load_train_config([]), ["model=smollm2"])
    assert cfg.model.name == "smollm2" and cfg.task.prompt_format == "chat" and cfg.learner.lr == 1e-5


def test_the_smollm2_preset_composes_with_or_without_model_smollm2() -> None:
    for overrides in (["+experiment=smollm2_chain_sum"], ["model=smollm2", "+experiment=smollm2_chain_sum"]):
        cfg = load_train_config(overrides)
        assert cfg.model.name == "smollm2" and cfg.task.name == "reasoning_gym"
        assert cfg.task.answer_format == "last_number"  # a strict grader is the preset's default
        assert cfg.task.prompt_format == "chat" and cfg.task.rg_config
    with pytest.raises(ValueError, match=r"write \+experiment=smollm2_chain_sum"):
        load_train_config(["experiment=smollm2_chain_sum"])
    with pytest.raises(ValueError, match="not a config in configs/experiment/"):
        load_train_config(["+experiment=nope"])
