"""What a returned sample must satisfy before it may be scored, logged or trained on.

Owns: the field-by-field check of a ``FinishedSample`` against the group it answers and the model
(the wire codec already checked shapes and dtypes): it belongs to its group, repeats the assigned
prompt exactly, has at most ``max_new_tokens`` response ids, all inside the vocabulary, behaviour
log-probs that are log-probabilities (no NaN, none above 0; ``-inf`` is allowed and masked by the
learner, docs/algorithms.md "Token set"), and versions between the group's admission and the newest
version the learner has published (plus the one it may be publishing right now). Those are exactly the
versions a worker may hold for the group: it is handed the group only once the version its engine has
applied reaches the admission (``asyncrl.controller.buffer``), and the gate's staleness bound counts from
the admission (``asyncrl.controller.gate``). A token of a published version older than the admission is
*late* (``Rejection.late``: an honest worker whose engine had not applied the version it asked with), a
token of no published version is invalid.
Never: raises on bad content (returns the reason), scores, logs or looks at other samples.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np

import protocols as P
from asyncrl.controller import make_group_id, parse_sample_id

LOGP_TOLERANCE = 1e-4  # float32 log-softmax of a near-certain token can round a hair above 0


@dataclass(frozen=True, slots=True)
class Rejection:
    """Why a sample was rejected: ``key`` names the field (``samples/invalid/<key>``), ``reason`` says what
    was wrong."""

    key: str
    reason: str
    late: bool = False
    """Honest but unusable: every field is valid and every token's version was really published, but some
    tokens are older than the group's admission, so the staleness bound could not hold when it is consumed.
    Counted as ``samples/late_version``, never as invalid input (it does not count towards a quarantine)."""

    @property
    def counter(self) -> str:
        """The controller counter this rejection adds to."""
        return "samples/late_version" if self.late else f"samples/invalid/{self.key}"


def check_sample(msg: P.FinishedSample, *, meta: dict[str, Any], admit_version: int, served_version: int,
                 vocab_size: int, max_new_tokens: int) -> Rejection | None:
    """None if ``msg`` may be accepted, else why not."""
    parsed = parse_sample_id(msg.sample_id)
    if parsed is None or make_group_id(parsed[0]) != msg.group_id:
        return Rejection("group", f"sample id {msg.sample_id!r} does not belong to group {msg.group_id!r}")
    prompt = msg.prompt_ids.to_numpy()
    expected = np.asarray(meta.get("prompt_ids", ()), np.int64)
    if prompt.shape != expected.shape or not np.array_equal(prompt, expected):
        return Rejection("prompt", "prompt_ids differ from the assigned prompt")
    ids = msg.response_ids.to_numpy()
    if ids.size > max_new_tokens:
        return Rejection("length", f"{ids.size} response tokens, the assignment allows {max_new_tokens}")
    if ids.size and (int(ids.min()) < 0 or int(ids.max()) >= vocab_size):
        return Rejection("token_ids", f"response ids outside the vocabulary [0, {vocab_size}) (min {ids.min()}, "
                                      f"max {ids.max()})")
    logp = msg.behav_logp.to_numpy()
    if np.isnan(logp).any() or (logp > LOGP_TOLERANCE).any():
        return Rejection("behav_logp", "behaviour log-probs must be <= 0 and not NaN")
    versions = msg.versions.to_numpy()
    if not versions.size:
        return None
    lo, hi = int(versions.min()), int(versions.max())
    if lo < 0 or hi > served_version + 1:
        return Rejection("versions", f"token versions {lo}..{hi} outside the published versions "
                                     f"0..{served_version + 1}")
    if lo < admit_version:
        return Rejection("versions", f"token versions {lo}..{hi} start before the group was admitted at version "
                                     f"{admit_version}: made partly by older weights than its staleness bound allows",
                         late=True)
    return None
