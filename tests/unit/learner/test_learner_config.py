"""The learner's settings reach the config and are checked before any process starts."""

from __future__ import annotations

import pytest

from asyncrl.config.loader import load_train_config


def test_learner_options_are_settable_from_the_command_line():
    cfg = load_train_config(["learner.lora.rank=8", "learner.lora.alpha=16", "learner.lora.target_modules=[q_proj,v_proj]",
                             "learner.activation_checkpointing=true", "learner.max_tokens_per_micro_batch=2048",
                             "learner.autocast=bf16", "learner.num_threads=3", "algo.kl_coef=0.001"])  # fmt: skip
    L = cfg.learner
    assert (L.lora.rank, L.lora.alpha, L.lora.target_modules) == (8, 16.0, ["q_proj", "v_proj"])
    assert L.activation_checkpointing and L.max_tokens_per_micro_batch == 2048 and L.autocast == "bf16"
    assert L.num_threads == 3 and cfg.algo.kl_coef == 0.001
    assert load_train_config([]).learner.log_entropy  # entropy is logged by default


@pytest.mark.parametrize(
    "override, match",
    [
        ("learner.autocast=fp16", "learner.autocast"),
        ("learner.lora.rank=-1", "learner.lora.rank"),
        ("learner.max_tokens_per_micro_batch=-5", "max_tokens_per_micro_batch"),
        ("learner.num_threads=-1", "num_threads"),
        ("learner.lora.dropout=1.5", "lora.dropout"),
        ("algo.kl_coef=-0.1", "kl_coef"),
    ],
)
def test_bad_learner_settings_are_refused_with_the_key(override, match):
    with pytest.raises(ValueError, match=match):
        load_train_config([override])


def test_autocast_auto_is_bf16_on_cuda_and_on_a_cpu_with_bf16_matmul_and_fp32_elsewhere():
    from asyncrl.learner.options import resolve_autocast

    assert load_train_config(["learner.autocast=auto"]).learner.autocast == "auto"
    avx2, bf16 = frozenset({"avx2", "fma"}), frozenset({"avx2", "avx512f", "avx512_bf16"})
    assert resolve_autocast("auto", "cpu", avx2)[0] == "" and "avx512_bf16" in resolve_autocast("auto", "cpu", avx2)[1]
    assert resolve_autocast("auto", "cpu", bf16)[0] == "bf16"
    assert resolve_autocast("auto", "cpu", frozenset({"amx_bf16"}))[0] == "bf16"
    assert resolve_autocast("auto", "cuda", avx2)[0] == "bf16"  # the CPU's flags do not matter on a GPU
    assert resolve_autocast("bf16", "cpu", avx2) == ("bf16", "as set")  # an explicit choice is kept
    assert resolve_autocast("", "cuda", bf16) == ("", "as set")


def test_lora_on_the_lm_head_is_refused_before_start():
    with pytest.raises(ValueError, match="lm_head"):
        load_train_config(["learner.lora.rank=4", "learner.lora.target_modules=[q_proj,lm_head]"])
