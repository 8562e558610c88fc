"""The end-of-run summary: ``run_dir/summary.json`` and the short block the launcher prints.

Owns: the required keys of a summary and their validation, the JSON file (pretty, sorted keys, strict
JSON: non-finite numbers become ``null``), and the human-readable rendering.
Never: computes any of the numbers itself (the launcher passes them in) or drops a key it was given.
"""

from __future__ import annotations

import json
import math
import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from asyncrl.rundir import RunDir

REQUIRED_KEYS = (
    "final_train_reward",
    "eval_accuracy",
    "learner_steps",
    "wall_seconds",
    "max_consumed_staleness",
    "samples_logged",
    "state_dict_sha256",
)

# (key, label, format) for the printed block, in this order; other keys follow, sorted.
_LAYOUT = (
    ("final_train_reward", "final train reward (sampled)", "{:.3f}"),
    ("eval_accuracy", "eval accuracy (greedy)", "{:.3f}"),
    ("learner_steps", "learner steps", "{:d}"),
    ("wall_seconds", "wall time", "{:.1f} s"),
    ("max_consumed_staleness", "max consumed staleness", "{:d}"),
    ("samples_logged", "samples logged", "{:d}"),
    ("state_dict_sha256", "state dict sha256", "{}"),
)


def validate_summary(summary: Mapping[str, Any]) -> None:
    """ValueError naming every missing required key (and any key that is not a string)."""
    if not isinstance(summary, Mapping):
        raise ValueError(f"summary must be a dict, got {type(summary).__name__}")
    bad = [k for k in summary if not isinstance(k, str)]
    if bad:
        raise ValueError(f"summary keys must be strings; got {bad!r}")
    missing = [k for k in REQUIRED_KEYS if k not in summary]
    if missing:
        raise ValueError(
            f"summary is missing required key(s) {', '.join(missing)}; "
            f"the launcher must pass all of {', '.join(REQUIRED_KEYS)}"
        )


def _jsonable(value: Any) -> Any:
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if isinstance(value, Mapping):
        return {str(k): _jsonable(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_jsonable(v) for v in value]
    if isinstance(value, (str, int, float, bool)) or value is None:
        return value
    if isinstance(value, os.PathLike):
        return os.fspath(value)
    if hasattr(value, "item"):  # numpy scalars, 0-d tensors
        return _jsonable(value.item())
    raise ValueError(
        f"summary value {value!r} of type {type(value).__name__} is not JSON-serialisable; "
        "pass numbers, strings, lists or dicts"
    )


def write_summary(run_dir: str | Path, summary: Mapping[str, Any]) -> Path:
    """Validates ``summary`` and writes ``run_dir/summary.json`` atomically; returns its path."""
    validate_summary(summary)
    run_dir = Path(run_dir)
    run_dir.mkdir(parents=True, exist_ok=True)
    path = RunDir(run_dir).summary
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(_jsonable(summary), indent=2, sort_keys=True, allow_nan=False) + "\n")
    os.replace(tmp, path)
    return path


def _fmt(value: Any, spec: str) -> str:
    if value is None or (isinstance(value, float) and not math.isfinite(value)):
        return "n/a"
    if spec == "{:d}" and isinstance(value, float) and value.is_integer():
        value = int(value)
    try:
        return spec.format(value)
    except (ValueError, TypeError):
        return str(value)


def format_summary(summary: Mapping[str, Any]) -> str:
    """A short aligned block, required keys first, then the extra keys sorted. Validates first."""
    validate_summary(summary)
    rows = [(label, _fmt(summary[key], spec)) for key, label, spec in _LAYOUT]
    known = {k for k, _, _ in _LAYOUT}
    for key in sorted(k for k in summary if k not in known):
        v = summary[key]
        rows.append((key, _fmt(v, "{:.4g}") if isinstance(v, float) else str(v)))
    width = max(len(label) for label, _ in rows)
    lines = ["run summary", "-" * (width + 2 + 24)]
    lines += [f"{label:<{width}}  {value}" for label, value in rows]
    return "\n".join(lines)
