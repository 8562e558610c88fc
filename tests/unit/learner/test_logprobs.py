"""token_logprobs against a direct log_softmax computation."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from asyncrl.learner import token_logprobs
from asyncrl.learner.logprobs import logprobs_from_logits


def _manual(model, batch, tau):
    logits = model(input_ids=batch.input_ids, attention_mask=batch.attention_mask).logits
    lp = F.log_softmax(logits.float() / tau, dim=-1)  # [B, S, V], row t predicts token t+1
    want = torch.zeros(batch.input_ids.shape)
    ent = torch.zeros(batch.input_ids.shape)
    B, S = batch.input_ids.shape
    for b in range(B):
        for t in range(1, S):
            if batch.loss_mask[b, t]:
                want[b, t] = lp[b, t - 1, batch.input_ids[b, t]]
                ent[b, t] = -(lp[b, t - 1].exp() * lp[b, t - 1]).sum()
    return want, ent


def test_token_logprobs_equals_manual_log_softmax_at_the_next_token(tiny):
    model, batch = tiny.model(), tiny.batch(4, temperature=0.7)
    with torch.no_grad():
        got, ent = token_logprobs(model, batch, with_entropy=True)
        want, want_ent = _manual(model, batch, 0.7)
    assert got.dtype == torch.float32 and got.shape == batch.input_ids.shape
    torch.testing.assert_close(got, want, rtol=0, atol=1e-6)
    torch.testing.assert_close(ent, want_ent, rtol=0, atol=1e-5)
    assert (got[~batch.loss_mask] == 0).all()


def test_explicit_temperature_overrides_the_batch_temperature(tiny):
    model, batch = tiny.model(), tiny.batch(2, temperature=1.0)
    with torch.no_grad():
        got, _ = token_logprobs(model, batch, temperature=2.0)
        want, _ = _manual(model, batch, 2.0)
    torch.testing.assert_close(got, want, rtol=0, atol=1e-6)


def test_chunked_logprobs_match_unchunked_values_and_gradients():
    torch.manual_seed(0)
    logits = torch.randn(3, 6, 11, requires_grad=True)
    ids = torch.randint(0, 11, (3, 6))
    pos = torch.rand(3, 6) > 0.3
    pos[:, 0] = False
    a, ea = logprobs_from_logits(logits, ids, pos, 0.9, with_entropy=True, chunk_tokens=2)
    (a.sum() + ea.sum()).backward()
    g_chunked = logits.grad.clone()
    logits.grad = None
    b, eb = logprobs_from_logits(logits, ids, pos, 0.9, with_entropy=True, chunk_tokens=10_000)
    (b.sum() + eb.sum()).backward()
    torch.testing.assert_close(a, b)
    torch.testing.assert_close(ea, eb)
    torch.testing.assert_close(g_chunked, logits.grad)


def test_empty_positions_still_give_a_graph_through_the_model(tiny):
    model, batch = tiny.model(), tiny.batch(2)
    logp, _ = token_logprobs(model, batch, positions=torch.zeros_like(batch.loss_mask))
    assert (logp == 0).all() and logp.requires_grad
    logp.sum().backward()
    grads = [p.grad for p in model.parameters()]
    assert all(g is not None and (g == 0).all() for g in grads)


def test_selecting_position_zero_is_rejected(tiny):
    model, batch = tiny.model(), tiny.batch(2)
    pos = batch.loss_mask.clone()
    pos[0, 0] = True
    with pytest.raises(ValueError, match="position 0"):
        token_logprobs(model, batch, positions=pos)


def _full_logits_path(model, batch, tau, with_entropy=True):
    logits = model(input_ids=batch.input_ids, attention_mask=batch.attention_mask).logits  # [B, S, V]
    return logprobs_from_logits(logits, batch.input_ids, batch.loss_mask, tau, with_entropy=with_entropy)


@pytest.mark.parametrize("tie", [False, True])
@pytest.mark.parametrize("chunk", [1, 3, 1024])
def test_response_only_head_equals_the_full_logits_path_without_grad(tiny, tie, chunk):
    model, batch = tiny.model(seed=3, tie=tie), tiny.batch(6, seed=2, temperature=0.8)
    with torch.no_grad():
        got, ent = token_logprobs(model, batch, with_entropy=True, chunk_tokens=chunk)
        want, want_ent = _full_logits_path(model, batch, 0.8)
    torch.testing.assert_close(got, want, rtol=0, atol=1e-6)
    torch.testing.assert_close(ent, want_ent, rtol=0, atol=1e-6)


@pytest.mark.parametrize("tie", [False, True])
def test_response_only_head_equals_the_full_logits_path_with_grad(tiny, tie):
    batch = tiny.batch(6, seed=4, temperature=1.1)
    w = torch.randn(batch.input_ids.shape, generator=torch.Generator().manual_seed(0))
    grads, values = [], []
    for path in ("chunked", "full"):
        model = tiny.model(seed=5, tie=tie)
        if path == "chunked":
            logp, ent = token_logprobs(model, batch, with_entropy=True, chunk_tokens=4)
        else:
            logp, ent = _full_logits_path(model, batch, 1.1)
        assert logp.requires_grad and ent.requires_grad
        ((logp * w).sum() + 0.3 * (ent * w).sum()).backward()
        values.append((logp.detach(), ent.detach()))
        grads.append({n: p.grad.clone() for n, p in model.named_parameters()})
    torch.testing.assert_close(values[0][0], values[1][0], rtol=0, atol=1e-6)
    torch.testing.assert_close(values[0][1], values[1][1], rtol=0, atol=1e-6)
    for name in grads[1]:
        torch.testing.assert_close(grads[0][name], grads[1][name], rtol=1e-5, atol=1e-6, msg=name)


def test_head_forward_is_restored_after_the_call(tiny):
    model, batch = tiny.model(), tiny.batch(2)
    with torch.no_grad():
        token_logprobs(model, batch)
        out = model(input_ids=batch.input_ids, attention_mask=batch.attention_mask).logits
    assert out.shape[-1] == tiny.vocab
