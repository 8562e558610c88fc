"""Fixtures for the learner unit tests: a one-rank process group and a tiny in-memory Qwen2.

Nothing is downloaded: the model is ``Qwen2ForCausalLM(Qwen2Config(...))`` with a seeded
random init. ``reference_loss`` stands in for ``asyncrl.algo.policy_loss`` where a test needs a
loss with a known closed form (same signature).
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from transformers import Qwen2Config, Qwen2ForCausalLM

from asyncrl.learner import LearnerBatch, init_distributed

VOCAB = 37


def tiny_config(tie: bool = False) -> Qwen2Config:
    return Qwen2Config(
        vocab_size=VOCAB,
        hidden_size=16,
        intermediate_size=24,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=64,
        tie_word_embeddings=tie,
    )


def tiny_model(seed: int = 0, tie: bool = False) -> Qwen2ForCausalLM:
    torch.manual_seed(seed)
    model = Qwen2ForCausalLM(tiny_config(tie))
    model.eval()
    return model


def make_batch(n: int = 4, seed: int = 0, temperature: float = 1.0) -> LearnerBatch:
    """n samples with varied prompt/response lengths, versions and advantages."""
    rng = np.random.default_rng(seed)
    prompts, responses, lps, vers, advs = [], [], [], [], []
    for i in range(n):
        P, R = int(rng.integers(1, 5)), int(rng.integers(1, 7))
        prompts.append(rng.integers(1, VOCAB, P).tolist())
        responses.append(rng.integers(1, VOCAB, R).tolist())
        lps.append((-rng.random(R) * 3 - 0.1).astype(np.float32))
        vers.append(np.full(R, i % 3, dtype=np.int32))
        advs.append(float(rng.normal()))
    return LearnerBatch.from_samples(prompts, responses, lps, vers, advs, temperature=temperature)


def reference_loss(
    logp, prox_logp, behav_logp, advantages, mask, cfg, *, num_tokens, num_seqs, versions, learner_version
):
    """Token-mean decoupled clipped surrogate (eps 0.2, weight exp(prox - behav)), global denominator."""
    mask = mask.to(torch.bool)
    delta = torch.where(mask, logp - prox_logp, 0.0).clamp(-20, 20)
    w = torch.exp(torch.where(mask, prox_logp - behav_logp, 0.0).clamp(-20, 20)).detach()
    ratio = torch.exp(delta)
    surr = torch.maximum(-advantages * ratio, -advantages * ratio.clamp(0.8, 1.2))
    loss = torch.where(mask, w * surr, 0.0).sum() / num_tokens
    n = mask.sum().clamp(min=1)
    metrics = {
        "actor/ratio_mean": torch.where(mask, ratio, 0.0).sum() / n,
        "actor/ratio_max": torch.where(mask, ratio, -torch.inf).max() if mask.any() else torch.tensor(0.0),
    }
    return loss, metrics


@pytest.fixture(scope="session")
def dist_info():
    return init_distributed()


@pytest.fixture
def tiny():
    """Helpers as a namespace (test modules cannot import conftest under --import-mode=importlib)."""
    import types

    return types.SimpleNamespace(
        model=tiny_model, batch=make_batch, config=tiny_config, loss=reference_loss, vocab=VOCAB
    )
