"""What a returned sample must satisfy before it may be scored, logged or trained on.

Owns: the field-by-field check of a ``FinishedSample`` against the group it answers and the model
(the wire codec already checked shapes and dtypes): it belongs to its group, repeats the assigned
prompt exactly, has at most ``max_new_tokens`` response ids, all inside the vocabulary, behaviour
log-probs that are log-probabilities (no NaN, none above 0; ``-inf`` is allowed and masked by the
learner, docs/algorithms.md "Token set"), and versions between the group's admission and the newest
version the learner has published (plus the one it may be publishing right now).
Never: raises on bad content (returns the reason), scores, logs or looks at other samples.
"""

from __future__ import annotations

from typing import Any

import numpy as np

import protocols as P
from asyncrl.controller import make_group_id, parse_sample_id

LOGP_TOLERANCE = 1e-4  # float32 log-softmax of a near-certain token can round a hair above 0


def check_sample(msg: P.FinishedSample, *, meta: dict[str, Any], admit_version: int, served_version: int,
                 vocab_size: int, max_new_tokens: int) -> tuple[str, str] | None:
    """None if ``msg`` may be accepted, else (counter key, human reason)."""
    parsed = parse_sample_id(msg.sample_id)
    if parsed is None or make_group_id(parsed[0]) != msg.group_id:
        return "group", f"sample id {msg.sample_id!r} does not belong to group {msg.group_id!r}"
    prompt = msg.prompt_ids.to_numpy()
    expected = np.asarray(meta.get("prompt_ids", ()), np.int64)
    if prompt.shape != expected.shape or not np.array_equal(prompt, expected):
        return "prompt", "prompt_ids differ from the assigned prompt"
    ids = msg.response_ids.to_numpy()
    if ids.size > max_new_tokens:
        return "length", f"{ids.size} response tokens, the assignment allows {max_new_tokens}"
    if ids.size and (int(ids.min()) < 0 or int(ids.max()) >= vocab_size):
        return "token_ids", f"response ids outside the vocabulary [0, {vocab_size}) (min {ids.min()}, max {ids.max()})"
    logp = msg.behav_logp.to_numpy()
    if np.isnan(logp).any() or (logp > LOGP_TOLERANCE).any():
        return "behav_logp", "behaviour log-probs must be <= 0 and not NaN"
    versions = msg.versions.to_numpy()
    if versions.size and (int(versions.min()) < admit_version or int(versions.max()) > served_version + 1):
        return "versions", (f"token versions {int(versions.min())}..{int(versions.max())} outside the served range "
                            f"{admit_version}..{served_version + 1}")
    return None
