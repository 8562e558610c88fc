"""Launch-time model checks: every decoder-only causal LM that transformers loads is accepted, encoders,
encoder-decoders and vision-only models are refused with a message naming what is supported; the tiny
family folders load with the byte tokenizer and carry their chat template."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from transformers import AutoTokenizer

from asyncrl.models.families import CHATML_TEMPLATE, FAMILIES, make_family_model
from asyncrl.models.prepare import NATIVE_MODEL_TYPES, causal_lm_problem, check_model_folder


def _folder(tmp_path: Path, config: dict, weights: bool = True) -> Path:
    folder = tmp_path / str(config["model_type"])
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps(config))
    if weights:
        (folder / "model.safetensors").write_bytes(b"")
    return folder


def test_the_native_decoders_families_stay_importable_for_the_engine():
    assert NATIVE_MODEL_TYPES == ("llama", "qwen2", "qwen3", "mistral")


@pytest.mark.parametrize("model_type", ["qwen3", "qwen3_moe", "mixtral", "gemma3_text", "phi3", "gpt_neox"])
def test_decoder_only_causal_lms_are_accepted(tmp_path, model_type):
    folder = _folder(tmp_path, {"model_type": model_type, "architectures": ["XForCausalLM"]})
    assert check_model_folder(folder) == folder


@pytest.mark.parametrize(("config", "says"), [
    ({"model_type": "bert", "architectures": ["BertForMaskedLM"]}, "'bert' encoder (BertForMaskedLM)"),
    ({"model_type": "roberta"}, "'roberta' encoder"),
    ({"model_type": "bart", "is_encoder_decoder": True}, "encoder-decoder 'bart'"),
    ({"model_type": "vit", "architectures": ["ViTModel"]}, "'vit' model (ViTModel) that transformers' "
                                                           "AutoModelForCausalLM does not load"),
    ({"model_type": None}, "None model"),
])
def test_what_is_not_a_causal_lm_is_refused_naming_what_is(tmp_path, config, says):
    folder = _folder(tmp_path, {"model_type": config.get("model_type") or "none", **config})
    with pytest.raises(ValueError) as info:
        check_model_folder(folder)
    assert says in str(info.value)
    assert "decoder-only causal language models" in str(info.value) and "qwen3_moe" in str(info.value)


def test_a_bert_decoder_is_a_causal_lm():
    assert causal_lm_problem({"model_type": "bert", "is_decoder": True}) == ""


def test_missing_or_empty_folders_are_refused_with_the_fix(tmp_path):
    with pytest.raises(ValueError, match="does not exist; download or copy"):
        check_model_folder(tmp_path / "absent")
    with pytest.raises(ValueError, match="has no weights"):
        check_model_folder(_folder(tmp_path, {"model_type": "qwen3"}, weights=False))


@pytest.mark.parametrize("family", FAMILIES)
def test_family_folders_load_the_byte_tokenizer_with_the_chat_template(tmp_path, family):
    folder = make_family_model(tmp_path / family, family)
    assert check_model_folder(folder) == folder
    tok = AutoTokenizer.from_pretrained(folder)
    assert tok("1+2= ab")["input_ids"] == [1] + [4 + b for b in b"1+2= ab"]
    assert tok.chat_template == CHATML_TEMPLATE
    text = tok.apply_chat_template([{"role": "user", "content": "hi"}], tokenize=False, add_generation_prompt=True)
    assert text == "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"


def test_the_check_reads_transformers_tables_without_loading_torch(tmp_path):
    """The launcher (which checks a replayed run's folder) never loads torch: the tables are read from
    transformers' source, and equal the imported ones."""
    import subprocess
    import sys

    folder = _folder(tmp_path, {"model_type": "qwen3_moe"})
    code = ("import sys; from asyncrl.models.prepare import check_model_folder; from pathlib import Path; "
            f"check_model_folder(Path({str(folder)!r})); print('torch' in sys.modules, 'transformers' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.split() == ["False", "False"]
    import transformers.models.auto.modeling_auto as auto

    from asyncrl.models.prepare import auto_mapping_names

    for table in ("MODEL_FOR_CAUSAL_LM_MAPPING_NAMES", "MODEL_FOR_MASKED_LM_MAPPING_NAMES"):
        assert auto_mapping_names(table) == frozenset(getattr(auto, table))
