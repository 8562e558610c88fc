"""Per-forward AQN (``quant.aqn_resample=forward``): every engine forward perturbs the RMSNorm gains afresh.

The reference is built without the engine's hooks: a plain HF model whose gain *parameters* are replaced by
``g + z`` before each step of a token-by-token HF forward with its own KV cache, with ``z`` the draw of
the forward that samples that token (``asyncrl.quant.aqn.forward_noise``). The engine's behaviour
log-probs must be the log-probs of exactly those noisy forwards.
"""

from __future__ import annotations

import copy

import numpy as np
import pytest
import torch

from asyncrl.engine.base import GenRequest, SamplingParams
from asyncrl.engine.native.engine import NativeEngine
from asyncrl.quant import ForwardAqn, QuantError, publish
from asyncrl.quant.aqn import forward_noise

SIGMA = 0.05
SEED = 1234


def _requests(n: int = 5, tokens: int = 6) -> list[GenRequest]:
    texts = ["1+2=", "17+25=", "9+9=", "3+8=", "40+4="]
    return [GenRequest(f"r{i}", [1] + [4 + b for b in texts[i % len(texts)].encode()],
                       SamplingParams(max_new_tokens=tokens, stop_token_ids=(), seed=7))
            for i in range(n)]


def _publication(model, resample: str, sigma: float = SIGMA):
    return publish(model.state_dict(), "fp32", version=1, aqn_sigma=sigma, aqn_seed=SEED, aqn_resample=resample)


def _generate(model, requests, *, max_batch_size: int = 8, resample: str = "forward") -> dict[str, object]:
    engine = NativeEngine(copy.deepcopy(model), version=0, max_batch_size=max_batch_size)
    engine.update_weights(1, _publication(model, resample))
    out = {r.sample_id: r for r in engine.generate(requests)}
    engine.close()
    return out


@torch.no_grad()
def _noisy_reference(model, prompt: list[int], response: list[int], sample_id: str) -> np.ndarray:
    """log p of each response token under the gains g + z_t of the forward that sampled token t."""
    from transformers import DynamicCache

    ref = copy.deepcopy(model)
    sites = sorted((n, m) for n, m in ref.named_modules()
                   if n.rsplit(".", 1)[-1] in ("input_layernorm", "post_attention_layernorm"))
    clean = [m.weight.detach().clone() for _, m in sites]
    hidden = clean[0].shape[-1]
    cache = DynamicCache(config=ref.config)
    out = []
    for t in range(len(response)):
        z = forward_noise(SEED, sample_id, t, SIGMA, len(sites), hidden)
        for i, (_, m) in enumerate(sites):
            m.weight.copy_(clean[i] + z[i])
        feed = prompt if t == 0 else [response[t - 1]]
        logits = ref(torch.tensor([feed]), cache=cache, use_cache=True).logits[0, -1].float()
        out.append(float(torch.log_softmax(logits, -1)[response[t]]))
    return np.asarray(out)


def test_behaviour_logprob_is_the_one_of_the_noisy_forward_that_sampled_the_token(tiny_hf):
    results = _generate(tiny_hf, _requests())
    for req in _requests():
        r = results[req.sample_id]
        assert len(r.response_ids) == 6
        expected = _noisy_reference(tiny_hf, req.prompt_ids, r.response_ids, req.sample_id)
        np.testing.assert_allclose(r.behav_logp, expected, atol=1e-4)


def test_noise_is_fresh_per_forward_and_independent_of_the_batch(tiny_hf, reference):
    reqs = _requests()
    batched = _generate(tiny_hf, reqs, max_batch_size=8)
    one_by_one = _generate(tiny_hf, reqs, max_batch_size=1)
    clean = _generate(tiny_hf, reqs, resample="publication")  # noise in the gains, drawn once
    for req in reqs:
        a, b = batched[req.sample_id], one_by_one[req.sample_id]
        assert a.response_ids == b.response_ids
        np.testing.assert_allclose(a.behav_logp, b.behav_logp, atol=1e-5)
        # not the clean policy: the noise moved every token's log-prob
        plain = reference.plain(tiny_hf, req.prompt_ids, a.response_ids, 1.0).numpy()
        assert np.abs(a.behav_logp - plain).min() > 1e-6
    # consecutive forwards of one sample draw different noise
    z0 = forward_noise(SEED, "r0", 0, SIGMA, 4, 8)
    z1 = forward_noise(SEED, "r0", 1, SIGMA, 4, 8)
    assert not torch.equal(z0, z1)
    assert any(not np.allclose(batched[r.sample_id].behav_logp, clean[r.sample_id].behav_logp) for r in reqs)


def test_publication_in_forward_mode_keeps_the_gains_clean_and_records_the_mode(tiny_hf):
    sd = tiny_hf.state_dict()
    fwd = _publication(tiny_hf, "forward")
    once = _publication(tiny_hf, "publication")
    gain = "model.layers.0.input_layernorm.weight"
    assert torch.equal(fwd.tensors[gain], sd[gain])
    assert not torch.equal(once.tensors[gain], sd[gain])
    assert (fwd.aqn_resample, fwd.aqn_seed, fwd.aqn_sigma) == ("forward", SEED, SIGMA)
    assert fwd.header()["aqn_resample"] == "forward" and "aqn_resample" not in once.header()
    fwd.verify()
    with pytest.raises(QuantError, match="aqn_resample='publication' with UAQ"):
        publish(sd, "fp32", version=1, aqn_sigma=SIGMA, aqn_seed=SEED, aqn_resample="forward",
                uaq_s=1.5, uaq_sites=("attn_qkv",))
    with pytest.raises(QuantError, match="choose one of: publication, forward"):
        publish(sd, "fp32", version=1, aqn_resample="token")


def test_hook_equals_replacing_the_gain(tiny_hf):
    model = copy.deepcopy(tiny_hf)
    noisy = copy.deepcopy(tiny_hf)
    aqn = ForwardAqn(model)
    aqn.set_publication(SEED, SIGMA)
    aqn.set_rows([("s", 3)])
    z = forward_noise(SEED, "s", 3, SIGMA, len(aqn.names), aqn.hidden)
    mods = dict(noisy.named_modules())
    with torch.no_grad():
        for i, name in enumerate(aqn.names):
            mods[name].weight.add_(z[i])
        ids = torch.tensor([[1, 5, 9, 13, 17]])
        np.testing.assert_allclose(model(ids).logits.numpy(), noisy(ids).logits.numpy(), atol=1e-5)
        aqn.set_rows(None)
        np.testing.assert_allclose(model(ids).logits.numpy(), tiny_hf(ids).logits.numpy(), atol=0)
