"""Model families built from a config alone: tiny random-weight folders of every family asyncrl is tested
on, and the published architectures of the presets (Qwen3-0.6B ... 8B, Llama-3.2-1B) for benchmarks.

Owns: ``FAMILIES`` (the tiny test families: llama, qwen2, qwen3, mistral, qwen3_moe, mixtral),
``tiny_family_config`` / ``build_family_model`` / ``make_family_model`` (a seeded random-weight HF folder
with the embedded byte tokenizer and a ChatML chat template), and ``preset_config`` (the configuration of a
published checkpoint, values copied from its config.json, for random-weight benchmarks).

Must never: download anything (a preset is a config, never weights) or use torch's global RNG (weights come
from a private ``torch.Generator`` seeded with ``seed``).

Invariants: every tiny family shares the byte tokenizer of ``asyncrl.models.tiny`` (vocab 260, ids 0-3
special), so any task's prompts tokenize the same way in every family (``AutoTokenizer`` loads the saved byte
pipeline for each of them; ``tests/unit/models/test_families.py`` checks the ids).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from asyncrl.models.tiny import SPECIAL_TOKENS, build_tiny_tokenizer, init_weights

FAMILIES = ("llama", "qwen2", "qwen3", "mistral", "qwen3_moe", "mixtral")
"""Tiny test families (HF ``model_type``): four dense, two mixture-of-experts."""

CHATML_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
"""The chat template written into tiny family folders (ChatML, as Qwen's; plain bytes for the tiny
tokenizer, so a chat prompt is recognisable in the token ids)."""

_TINY_COMMON: dict[str, Any] = {
    "vocab_size": len(SPECIAL_TOKENS) + 256,
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "max_position_embeddings": 512,
    "rms_norm_eps": 1e-6,
    "pad_token_id": 0,
    "bos_token_id": 1,
    "eos_token_id": 2,
    "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0},
}
_TINY_EXTRA: dict[str, dict[str, Any]] = {
    "llama": {"tie_word_embeddings": False},
    "qwen2": {"tie_word_embeddings": True, "use_sliding_window": False},
    "qwen3": {"tie_word_embeddings": True, "head_dim": 16, "use_sliding_window": False},
    "mistral": {"tie_word_embeddings": False, "head_dim": 16, "sliding_window": None},
    "qwen3_moe": {"tie_word_embeddings": False, "head_dim": 16, "num_experts": 4, "num_experts_per_tok": 2,
                  "moe_intermediate_size": 32, "decoder_sparse_step": 1, "norm_topk_prob": True,
                  "use_sliding_window": False},
    "mixtral": {"tie_word_embeddings": False, "head_dim": 16, "num_local_experts": 4, "num_experts_per_tok": 2,
                "sliding_window": None},
}

# Published configurations (config.json of each checkpoint). Only the architecture: no weights.
_QWEN3_COMMON: dict[str, Any] = {
    "vocab_size": 151936, "num_key_value_heads": 8, "head_dim": 128, "max_position_embeddings": 40960,
    "rms_norm_eps": 1e-6, "rope_parameters": {"rope_type": "default", "rope_theta": 1000000.0},
    "bos_token_id": 151643, "eos_token_id": 151645, "use_sliding_window": False,
}
PRESETS: dict[str, tuple[str, dict[str, Any]]] = {
    "qwen3-0.6b": ("qwen3", {**_QWEN3_COMMON, "hidden_size": 1024, "intermediate_size": 3072,
                             "num_hidden_layers": 28, "num_attention_heads": 16, "tie_word_embeddings": True}),
    "qwen3-1.7b": ("qwen3", {**_QWEN3_COMMON, "hidden_size": 2048, "intermediate_size": 6144,
                             "num_hidden_layers": 28, "num_attention_heads": 16, "tie_word_embeddings": True}),
    "qwen3-4b": ("qwen3", {**_QWEN3_COMMON, "hidden_size": 2560, "intermediate_size": 9728,
                           "num_hidden_layers": 36, "num_attention_heads": 32, "tie_word_embeddings": True}),
    "qwen3-8b": ("qwen3", {**_QWEN3_COMMON, "hidden_size": 4096, "intermediate_size": 12288,
                           "num_hidden_layers": 36, "num_attention_heads": 32, "tie_word_embeddings": False}),
    "llama-3.2-1b": ("llama", {"vocab_size": 128256, "hidden_size": 2048, "intermediate_size": 8192,
                               "num_hidden_layers": 16, "num_attention_heads": 32, "num_key_value_heads": 8,
                               "head_dim": 64, "max_position_embeddings": 131072, "rms_norm_eps": 1e-5,
                               "tie_word_embeddings": True, "bos_token_id": 128000, "eos_token_id": 128009,
                               "rope_parameters": {"rope_type": "llama3", "rope_theta": 500000.0, "factor": 32.0,
                                                   "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                                                   "original_max_position_embeddings": 8192}}),
}
"""Architectures of the ``configs/model/`` presets, by name (``preset_config``)."""


def _check_family(family: str) -> None:
    if family not in FAMILIES:
        raise ValueError(f"unknown tiny model family {family!r}; choose one of {', '.join(FAMILIES)}")


def tiny_family_config(family: str):
    """The HF config of the tiny ``family`` model (2 layers, hidden 64, the byte vocabulary)."""
    from transformers import AutoConfig

    _check_family(family)
    return AutoConfig.for_model(family, **_TINY_COMMON, **_TINY_EXTRA[family])


def preset_config(name: str):
    """The HF config of a published checkpoint (``PRESETS``); ``ValueError`` naming the choices."""
    from transformers import AutoConfig

    if name not in PRESETS:
        raise ValueError(f"unknown model preset {name!r}; choose one of {', '.join(PRESETS)}")
    model_type, values = PRESETS[name]
    return AutoConfig.for_model(model_type, **values)


def build_family_model(family: str, seed: int = 0):
    """A freshly initialised fp32 tiny ``family`` causal LM (``init_weights``)."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_config(tiny_family_config(family), dtype=torch.float32)
    return init_weights(model, seed).eval()


def make_family_model(out: str | Path, family: str, seed: int = 0) -> Path:
    """Write the tiny ``family`` model + byte tokenizer (with ``CHATML_TEMPLATE``) as an HF folder at ``out``."""
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    model = build_family_model(family, seed)
    model.generation_config.pad_token_id = 0
    model.save_pretrained(out)
    tok = build_tiny_tokenizer()
    tok.chat_template = CHATML_TEMPLATE
    tok.save_pretrained(out)
    return out
