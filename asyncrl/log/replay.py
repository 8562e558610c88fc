"""Replay: the learner's batches rebuilt from a trajectory log, in the order they were consumed.

Owns: reading a run's log into ``TrainBatch`` messages identical (field for field) to those the
controller sent, and refusing logs that cannot be replayed (other schema version, other model,
interior corruption, a batch that names a sample the log does not hold). With ``salvage`` a log with
interior corruption is replayed without the batches whose samples were lost (the rest renumbered in
order), and every skipped byte range and batch is reported. A replay of a run still training replays the
``steps`` it counted (``logged_steps``) when it started, however far the live log has grown since.
Never: samples, scores or re-computes advantages; the logged ones are the data.
"""

from __future__ import annotations

import logging
from pathlib import Path

import protocols as P
from asyncrl.log import BatchRecord, LogCorruptionError, LogFormatError, SampleRecord, read_log, segment_paths

log = logging.getLogger("asyncrl.replay")


def train_sample(fs: P.FinishedSample, *, advantage: float, reward: float) -> P.TrainSample:
    """What the learner consumes of a scored sample (the controller's batches and replay agree on it)."""
    return P.TrainSample(sample_id=fs.sample_id, group_id=fs.group_id, prompt_ids=fs.prompt_ids,
                         response_ids=fs.response_ids, behav_logp=fs.behav_logp, versions=fs.versions,
                         advantage=advantage, reward=reward, finish_reason=fs.finish_reason)


class ReplayError(ValueError):
    """The log cannot be replayed; the message says why and what to do."""


def check_replayable(log_dir: str | Path, *, model_id: str, salvage: bool = False) -> list[str]:
    """Up-front check of the whole log: schema version, model, integrity. Returns warnings to show
    (a torn tail, or with ``salvage`` what will be skipped); raises for what cannot be replayed."""
    if not segment_paths(log_dir):
        raise ReplayError(f"no trajectory log in {log_dir}; pass run=runs/<name> of a run that logged samples")
    scan = read_log(log_dir)  # LogFormatError names a schema mismatch
    _check_model(log_dir, scan.header.model, model_id)
    if scan.interior and not salvage:
        raise LogCorruptionError(log_dir, scan.interior)
    notes = [f"log.salvage=true: skipping {c}" for c in scan.interior]
    torn = [c for c in scan.corruptions if c not in scan.interior]
    notes += [f"warning: {c} (the run stopped mid-write; records before it are replayed)" for c in torn]
    if torn and (lost := _steps_lost(log_dir, scan.records)):
        notes.append(f"warning: {lost}")
    return notes


def _steps_lost(log_dir: str | Path, records: list) -> str:
    """What a torn tail cost a finished run's replay: the steps its learner trained whose batch records are not
    in the log (the last ones were in the tail), or "" when none (or the run did not finish)."""
    import json

    from asyncrl.rundir import RunDir

    final = RunDir(Path(log_dir).parent).learner_final
    try:
        trained = int(json.loads(final.read_text())["version"])
    except (OSError, ValueError, KeyError):
        return ""
    held = 1 + max((r.step for r in records if isinstance(r, BatchRecord)), default=-1)
    if held >= trained:
        return ""
    return (f"the run trained {trained} steps ({final.name}) but its log holds the batches of {held}: the batch of "
            f"step {held} was in the torn tail. This replay trains {held} steps, so its final weights differ from "
            "the run's")


def logged_steps(log_dir: str | Path) -> int:
    """How many learner steps the log holds now (its last batch record's step + 1); 0 without a log."""
    if not segment_paths(log_dir):
        return 0
    return 1 + max((rec.step for rec in read_log(log_dir).records if isinstance(rec, BatchRecord)), default=-1)


def _check_model(log_dir, logged_model: str, model_id: str) -> None:
    if model_id and logged_model and logged_model != model_id:
        raise ReplayError(f"{log_dir} was written for model {logged_model!r}, this replay builds {model_id!r}; "
                          "replay with the run's own model settings")


def load_replay_batches(log_dir: str | Path, *, model_id: str = "", salvage: bool = False,
                        steps: int | None = None) -> list[P.TrainBatch]:
    """The batches of the log in the order they were consumed; with ``steps``, those of the first ``steps``
    logged steps only (a prefix of a run still training)."""
    scan = read_log(log_dir)  # LogFormatError (a ValueError) names a schema mismatch
    _check_model(log_dir, scan.header.model, model_id)
    if scan.interior and not salvage:
        raise LogCorruptionError(log_dir, scan.interior)
    for c in scan.interior:
        log.warning("log.salvage=true: skipping %s", c)
    samples: dict[str, SampleRecord] = {}
    batches: list[P.TrainBatch] = []
    expected = 0
    for rec in scan.records:
        if isinstance(rec, SampleRecord):
            samples[rec.sample.sample_id] = rec
        elif isinstance(rec, BatchRecord):
            if steps is not None and rec.step >= steps:
                break
            if rec.step != expected and not (salvage and rec.step > expected):
                raise ReplayError(f"{log_dir}: batch records jump from step {expected - 1} to {rec.step}; "
                                  "the log is incomplete")
            if rec.step != expected:
                log.warning("log.salvage=true: batch records %d..%d were lost", expected, rec.step - 1)
            expected = rec.step + 1
            missing = [s for s in rec.sample_ids if s not in samples]
            if missing and salvage:
                log.warning("log.salvage=true: skipping batch %d (%d of its samples were lost)", rec.step, len(missing))
                continue
            if missing:
                raise ReplayError(f"{log_dir}: batch {rec.step} names {len(missing)} samples the log does not "
                                  f"hold (first: {missing[0]})")
            chosen = [samples[s] for s in rec.sample_ids]
            reward = sum(r.reward for r in chosen) / len(chosen)
            batches.append(P.TrainBatch(step=len(batches),
                                        samples=[train_sample(r.sample, advantage=r.advantage, reward=r.reward)
                                                 for r in chosen],
                                        metrics={"train/reward_mean": reward}))
    if not batches:
        raise ReplayError(f"{log_dir} holds no consumed batch; nothing to replay")
    return batches


__all__ = ["LogFormatError", "ReplayError", "load_replay_batches", "logged_steps"]
