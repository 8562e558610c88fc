"""Fixtures for asyncrl.quant tests: tiny seeded Qwen2 causal LMs built in memory (never downloaded).

hidden 48 and intermediate 80 are multiples of 16 but not of 32, so MXFP4 exercises the padding rule
on every projection and NVFP4 on none.
"""

from __future__ import annotations

import pytest
import torch
from transformers import Qwen2Config, Qwen2ForCausalLM  # imported at collection, not inside a test


def make_tiny_qwen2(seed: int = 0, *, tie: bool = False, hidden: int = 48, inter: int = 80):
    cfg = Qwen2Config(
        vocab_size=96,
        hidden_size=hidden,
        intermediate_size=inter,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=64,
        tie_word_embeddings=tie,
    )
    torch.manual_seed(seed)
    model = Qwen2ForCausalLM(cfg).eval()
    with torch.no_grad():  # non-trivial gains and biases, so folding and noise tests see them
        for name, p in model.named_parameters():
            if name.endswith("layernorm.weight") or name.endswith("norm.weight"):
                p.uniform_(0.5, 1.5)
            elif name.endswith(".bias"):
                p.normal_(0, 0.02)
    return model


@pytest.fixture
def tiny_model():
    return make_tiny_qwen2()


@pytest.fixture
def probe_ids():
    return torch.randint(0, 96, (2, 9), generator=torch.Generator().manual_seed(7))
