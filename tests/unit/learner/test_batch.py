"""LearnerBatch layout and its deterministic cuts."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from asyncrl.learner import LearnerBatch
from asyncrl.learner.plan import plan_step


def _two_samples() -> LearnerBatch:
    return LearnerBatch.from_samples(
        prompt_ids=[[5, 6], [7]],
        response_ids=[[8, 9, 10], [11]],
        behav_logp=[np.array([-0.1, -0.2, -0.3], np.float32), np.array([-0.4], np.float32)],
        versions=[np.array([3, 3, 4], np.int32), np.array([2], np.int32)],
        advantages=[1.5, -0.5],
        temperature=0.7,
        pad_id=0,
    )


def test_from_samples_places_response_tokens_after_prompt_and_right_pads():
    b = _two_samples()
    assert b.input_ids.tolist() == [[5, 6, 8, 9, 10], [7, 11, 0, 0, 0]]
    assert b.attention_mask.tolist() == [[1, 1, 1, 1, 1], [1, 1, 0, 0, 0]]
    assert b.loss_mask.tolist() == [[False, False, True, True, True], [False, True, False, False, False]]
    assert torch.allclose(b.behav_logp[0], torch.tensor([0, 0, -0.1, -0.2, -0.3]))
    assert torch.allclose(b.behav_logp[1], torch.tensor([0, -0.4, 0, 0, 0]))
    assert b.versions.tolist() == [[-1, -1, 3, 3, 4], [-1, 2, -1, -1, -1]]
    assert torch.allclose(b.advantages[0], torch.tensor([0, 0, 1.5, 1.5, 1.5]))
    assert b.temperature == 0.7
    assert (b.input_ids.dtype, b.behav_logp.dtype, b.versions.dtype) == (
        torch.int64,
        torch.float32,
        torch.int32,
    )
    assert (b.num_tokens, b.num_seqs) == (4, 2)


def test_from_samples_response_mask_zeroes_masked_token_fields():
    b = LearnerBatch.from_samples(
        [[1]],
        [[2, 3]],
        [np.array([-1.0, -2.0], np.float32)],
        [np.array([0, 1], np.int32)],
        [np.array([0.5, 0.7])],
        response_masks=[np.array([1, 0])],
    )
    assert b.loss_mask.tolist() == [[False, True, False]]
    assert b.behav_logp.tolist() == [[0.0, -1.0, 0.0]]
    assert b.versions.tolist() == [[-1, 0, -1]]
    assert torch.allclose(b.advantages, torch.tensor([[0.0, 0.5, 0.0]]))


@pytest.mark.parametrize(
    "kwargs, match",
    [
        (dict(prompt_ids=[[]]), "empty prompt"),
        (dict(behav_logp=[np.zeros(3, np.float32)]), "one entry per response token"),
        (dict(versions=[]), "one entry per sample"),
    ],
)
def test_from_samples_rejects_inconsistent_inputs(kwargs, match):
    args = dict(
        prompt_ids=[[1]],
        response_ids=[[2, 3]],
        behav_logp=[np.zeros(2, np.float32)],
        versions=[np.zeros(2, np.int32)],
        advantages=[1.0],
    )
    args.update(kwargs)
    with pytest.raises(ValueError, match=match):
        LearnerBatch.from_samples(**args)


def test_split_is_contiguous_covers_every_row_and_sizes_differ_by_at_most_one(tiny):
    b = tiny.batch(7)
    parts = b.split(3)
    assert [p.batch_size for p in parts] == [3, 2, 2]
    assert torch.equal(torch.cat([p.input_ids for p in parts]), b.input_ids)
    assert [p.input_ids.tolist() for p in b.split(3)] == [p.input_ids.tolist() for p in parts]
    with pytest.raises(ValueError, match="n_minibatches"):
        b.split(8)


def test_shard_gives_each_rank_a_contiguous_chunk_and_can_be_empty(tiny):
    b = tiny.batch(3)
    shards = [b.shard(r, 2) for r in range(2)]
    assert torch.equal(torch.cat([s.input_ids for s in shards]), b.input_ids)
    assert b.select([0]).shard(1, 2).batch_size == 0


def test_micro_batches_trim_trailing_padding(tiny):
    b = LearnerBatch.from_samples(
        [[1], [1], [1]],
        [[2, 3, 4, 5], [2], [2, 3]],
        [np.zeros(4, np.float32), np.zeros(1, np.float32), np.zeros(2, np.float32)],
        [np.zeros(4, np.int32), np.zeros(1, np.int32), np.zeros(2, np.int32)],
        [1.0, 1.0, 1.0],
    )
    (plan,) = plan_step(b, n_minibatches=1, rank=0, world_size=1, micro_batch_size=2)
    micro = plan.micros
    assert [m.seq_len for m in micro] == [5, 3]
    assert micro[1].input_ids.tolist() == [[1, 2, 3]]


def test_filler_has_no_loss_tokens_and_real_attention():
    f = LearnerBatch.filler(temperature=0.5)
    assert f.num_tokens == 0 and f.attention_mask.all() and f.temperature == 0.5
