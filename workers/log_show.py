"""``asyncrl log show RUN [--last N] [--step K]``: what the model wrote, decoded, with rewards and versions.

Owns: picking samples out of a trajectory log (the last N logged, or the ones learner step K consumed),
grouping them by prompt group, and printing each prompt once (decoded exactly as the model saw it,
chat template included) followed by its completions with reward, advantage, finish reason, length and
the policy versions that produced their tokens; after them, the learner's log-prob gap of that step
taken apart (``mismatch/*``, when the run measured it).
Before the samples: the run's training-health alarms (``health.jsonl``; step, name, message, cause, fix).
Never: modifies the log, or builds a model: the tokenizer comes from ``--tokenizer`` or from the model
folder the run's config names, which must already exist (a run creates it).
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

from asyncrl.log.framing import LogFormatError
from asyncrl.log.records import BatchRecord, SampleRecord
from asyncrl.log.trajectory import read_log
from asyncrl.rundir import RunDir


def run_tokenizer(run: Path, tokenizer_dir: str | None) -> Any:
    """The tokenizer of ``--tokenizer DIR``, else of the model folder the run's ``config.json`` names."""
    from asyncrl.tasks.prompts import load_tokenizer

    if tokenizer_dir:
        return load_tokenizer(tokenizer_dir)
    from asyncrl.models.prepare import model_folder
    from workers.run_config import read_run_config

    folder = model_folder(read_run_config(run))
    if not (folder / "tokenizer_config.json").is_file():
        raise ValueError(f"the run's model folder {folder} is not here (run from the folder the run was started "
                         "in, or pass --tokenizer DIR)")
    return load_tokenizer(folder)


def select(records: list[Any], *, last: int | None, step: int | None) -> list[tuple[SampleRecord, int | None]]:
    """(sample, consuming step or None) for ``--step K`` (in batch order) or the last ``last`` samples
    (``last`` >= 1, or None: ``DEFAULT_LAST``)."""
    if last is not None and last < 1:
        raise ValueError(f"--last {last}: N is how many samples to show and must be >= 1 (e.g. --last 8)")
    samples = {r.sample.sample_id: r for r in records if isinstance(r, SampleRecord)}
    consumed_at = {sid: r.step for r in records if isinstance(r, BatchRecord) for sid in r.sample_ids}
    if step is not None:
        batches = [r for r in records if isinstance(r, BatchRecord) and r.step == step]
        if not batches:
            steps = sorted({r.step for r in records if isinstance(r, BatchRecord)})
            span = f"{steps[0]}..{steps[-1]}" if steps else "none yet"
            raise ValueError(f"no batch for learner step {step} in this log (steps logged: {span})")
        chosen = [samples[sid] for sid in batches[-1].sample_ids if sid in samples]
        if last is not None:
            chosen = chosen[:last]
    else:
        chosen = list(samples.values())[-(DEFAULT_LAST if last is None else last):]
    return [(s, consumed_at.get(s.sample.sample_id)) for s in chosen]


def format_samples(chosen: list[tuple[SampleRecord, int | None]], decode: Callable[[list[int]], str]) -> str:
    out: list[str] = []
    current_group = None
    for rec, step in chosen:
        s = rec.sample
        if s.group_id != current_group:
            current_group = s.group_id
            prompt = s.prompt_ids.to_numpy().tolist()
            out.append(f"=== group {s.group_id}  (admitted at version {rec.admitted_version}, "
                       f"{len(prompt)} prompt tokens)")
            out.append(_indent(decode(prompt), "  | "))
        response = s.response_ids.to_numpy().tolist()
        versions = s.versions.to_numpy()
        vspan = f"v{int(versions.min())}" if versions.size and versions.min() == versions.max() else (
            f"v{int(versions.min())}..v{int(versions.max())}" if versions.size else "-")
        used = f"step {step}" if step is not None else "not consumed yet"
        out.append(f"--- {s.sample_id}  reward {rec.reward:.3f}  advantage {rec.advantage:+.3f}  "
                   f"{s.finish_reason}  {len(response)} tokens  {vspan}  {used}  worker {s.worker_id}")
        out.append(_indent(decode(response), "  > "))
    return "\n".join(out)


def _indent(text: str, prefix: str) -> str:
    return "\n".join(prefix + line for line in (text.splitlines() or [""]))


DEFAULT_LAST = 8
"""Samples shown without ``--last`` or ``--step``."""


def show_main(run: str, *, last: int | None = None, step: int | None = None, tokenizer: str | None = None) -> int:
    path = Path(run)
    print_alarms(path if RunDir(path).config.is_file() else path.parent)
    try:
        scan = read_log(path)
    except (LogFormatError, OSError) as e:
        raise ValueError(f"cannot read the trajectory log of {run}: {e}") from e
    chosen = select(scan.records, last=last, step=step)
    if not chosen:
        print("no samples logged yet")
        return 0
    run_dir = path if RunDir(path).config.is_file() else path.parent
    tok = run_tokenizer(run_dir, tokenizer)
    print(format_samples(chosen, lambda ids: tok.decode(ids)))
    steps = sorted({k for _, k in chosen if k is not None})
    line = mismatch_line(run_dir, steps[-1] if step is None and steps else step)
    if line:
        print(line)
    for c in scan.corruptions:
        print(f"CORRUPT    {c} (records before it are intact and were read)")
    return 0


MISMATCH_PARTS = ("lag0", "stale", "quant", "noise")
"""The decomposition of asyncrl/learner/mismatch.py, in the order ``mismatch_line`` prints it."""


def mismatch_line(run_dir: Path, step: int | None) -> str:
    """The behaviour-vs-learner log-prob gap of learner step ``step`` taken apart (its metrics record is
    version ``step + 1``), or "" when the run did not measure it at that step."""
    if step is None or not RunDir(run_dir).metrics.is_file():
        return ""
    from asyncrl.metrics.writer import read_metrics

    rec = next((r for r in read_metrics(run_dir) if r.get("step") == step + 1 and "mismatch/noise" in r), None)
    if rec is None:
        return ""
    parts = [f"{p} {rec[f'mismatch/{p}']:.2e}" for p in MISMATCH_PARTS if rec.get(f"mismatch/{p}") is not None]
    return f"=== log-prob gap at step {step} (mean |nats| per token): " + ", ".join(parts)


def print_alarms(run_dir: Path) -> None:
    """The run's training-health alarms (step, name, message) before its samples."""
    from asyncrl.metrics.health_log import alarms_report

    print(alarms_report(run_dir))
