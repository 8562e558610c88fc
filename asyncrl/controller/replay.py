"""Replay: the learner's batches rebuilt from a trajectory log, in the order they were consumed.

Owns: reading a run's log into ``TrainBatch`` messages identical (field for field) to those the
controller sent, and refusing logs that cannot be replayed (other schema version, other model,
a batch that names a sample the log does not hold).
Never: samples, scores or re-computes advantages; the logged ones are the data.
"""

from __future__ import annotations

from pathlib import Path

import protocols as P
from asyncrl.controller.core import train_sample
from asyncrl.log import BatchRecord, LogFormatError, SampleRecord, read_log, segment_paths
from asyncrl.log.framing import read_header


class ReplayError(ValueError):
    """The log cannot be replayed; the message says why and what to do."""


def check_replayable(log_dir: str | Path, *, model_id: str) -> None:
    """Cheap up-front check (first segment's header only): schema version and model."""
    paths = segment_paths(log_dir)
    if not paths:
        raise ReplayError(f"no trajectory log in {log_dir}; pass run=runs/<name> of a run that logged samples")
    with open(paths[0], "rb") as f:
        head = f.read(1 << 20)
    header, _ = read_header(memoryview(head), str(paths[0]))  # LogFormatError names a schema mismatch
    _check_model(log_dir, header.model, model_id)


def _check_model(log_dir, logged_model: str, model_id: str) -> None:
    if model_id and logged_model and logged_model != model_id:
        raise ReplayError(f"{log_dir} was written for model {logged_model!r}, this replay builds {model_id!r}; "
                          "replay with the run's own model settings")


def load_replay_batches(log_dir: str | Path, *, model_id: str = "") -> list[P.TrainBatch]:
    scan = read_log(log_dir)  # LogFormatError (a ValueError) names a schema mismatch
    _check_model(log_dir, scan.header.model, model_id)
    samples: dict[str, SampleRecord] = {}
    batches: list[P.TrainBatch] = []
    for rec in scan.records:
        if isinstance(rec, SampleRecord):
            samples[rec.sample.sample_id] = rec
        elif isinstance(rec, BatchRecord):
            if rec.step != len(batches):
                raise ReplayError(f"{log_dir}: batch records jump from step {len(batches) - 1} to {rec.step}; "
                                  "the log is incomplete")
            missing = [s for s in rec.sample_ids if s not in samples]
            if missing:
                raise ReplayError(f"{log_dir}: batch {rec.step} names {len(missing)} samples the log does not "
                                  f"hold (first: {missing[0]})")
            chosen = [samples[s] for s in rec.sample_ids]
            reward = sum(r.reward for r in chosen) / len(chosen)
            batches.append(P.TrainBatch(step=rec.step,
                                        samples=[train_sample(r.sample, advantage=r.advantage, reward=r.reward)
                                                 for r in chosen],
                                        metrics={"train/reward_mean": reward}))
    if not batches:
        raise ReplayError(f"{log_dir} holds no consumed batch; nothing to replay")
    return batches


__all__ = ["LogFormatError", "ReplayError", "load_replay_batches"]
