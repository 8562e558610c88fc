"""The embedded tiny model: deterministic build, HF-loadable folder, lossless byte tokenizer."""

from __future__ import annotations

import hashlib

import pytest

from asyncrl.models import ensure_tiny_model, make_tiny_model
from asyncrl.models import tiny as tiny_mod


def digests(folder) -> dict[str, str]:
    return {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in sorted(folder.iterdir())}


@pytest.fixture(scope="module")
def tiny_folder(tmp_path_factory):
    return ensure_tiny_model(tmp_path_factory.mktemp("m") / "tiny")


def test_same_seed_writes_identical_bytes_and_other_seed_differs(tiny_folder, tmp_path):
    again = make_tiny_model(tmp_path / "again", seed=0)
    assert digests(again) == digests(tiny_folder)
    other = make_tiny_model(tmp_path / "other", seed=1)
    d_other = digests(other)
    assert d_other["model.safetensors"] != digests(tiny_folder)["model.safetensors"]
    assert d_other["tokenizer.json"] == digests(tiny_folder)["tokenizer.json"]


def test_folder_loads_with_auto_classes_and_matches_the_spec(tiny_folder):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(str(tiny_folder))
    tok = AutoTokenizer.from_pretrained(str(tiny_folder))
    cfg = model.config
    assert cfg.model_type == "qwen2" and not cfg.tie_word_embeddings
    assert (cfg.num_attention_heads, cfg.num_key_value_heads, cfg.hidden_size) == (4, 2, 128)
    assert cfg.vocab_size == len(tok) == 260
    n_params = sum(p.numel() for p in model.parameters())
    assert 500_000 <= n_params <= 2_000_000
    assert (tok.pad_token_id, tok.bos_token_id, tok.eos_token_id) == (0, 1, 2)
    assert model.dtype.is_floating_point and str(model.dtype) == "torch.float32"


@pytest.mark.parametrize(
    "text", ["12+34=46", "What is 7*8? Answer: 56\n", "  tabs\tand  spaces ", "héllo 中"]
)
def test_tokenizer_is_one_token_per_byte_and_round_trips(tiny_folder, text):
    from tokenizers import Tokenizer
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(tiny_folder))
    raw = Tokenizer.from_file(str(tiny_folder / "tokenizer.json"))
    ids = tok(text).input_ids
    assert ids == [1] + [4 + b for b in text.encode()]
    assert raw.encode(text).ids == ids
    assert tok.decode(ids, skip_special_tokens=True) == text


def test_ensure_reuses_a_complete_folder_without_rebuilding(tiny_folder, monkeypatch):
    before = digests(tiny_folder)

    def fail(*args, **kwargs):
        raise AssertionError("rebuilt an existing model")

    monkeypatch.setattr(tiny_mod, "make_tiny_model", fail)
    assert ensure_tiny_model(tiny_folder) == tiny_folder.resolve()
    assert digests(tiny_folder) == before


def test_ensure_refuses_an_incomplete_foreign_folder(tmp_path):
    (tmp_path / "junk").mkdir()
    (tmp_path / "junk" / "config.json").write_text("{}")
    with pytest.raises(ValueError, match="remove it"):
        ensure_tiny_model(tmp_path / "junk")
