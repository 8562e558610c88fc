"""A run folder's configuration: reading it back (``read_run_config``), and what a resume
(``asyncrl train|controller resume=RUN [key=value ...]``) starts from: the run's own configuration, plus the
few overrides a resume accepts.

Owns: ``RESUME_KEYS`` (the overrides a resume applies: the one a damaged log's error recommends,
``log.salvage``, and the ones that only say where the run's files are now), the checks that such an
override only moves files (a moved dataset holds the same bytes, a moved model folder keeps its name
and the old place holds no model any more), and the refusal of a finished run (``RunFinished``,
before anything in its folder changes).
Never: applies another override (those are ignored with the message a resume has always printed); writes
to the run folder (the caller saves the returned configuration); imports torch or zmq.

Invariant: every path of the returned configuration is absolute (``asyncrl.config.paths``).
"""

from __future__ import annotations

import filecmp
import json
from collections.abc import Callable, Sequence
from pathlib import Path

from asyncrl.config.loader import apply_overrides, config_from_dict
from asyncrl.config.paths import resolve_paths
from asyncrl.config.schema import TrainConfig
from asyncrl.rundir import RunDir

RESUME_KEYS: dict[str, str] = {
    "log.salvage": "resume a log with interior damage: skip the damaged records and say which",
    "task.path": "the run's training data file, moved",
    "task.eval_path": "the run's evaluation data file, moved",
    "model.path": "the run's model folder, moved (same folder name; the old place holds no model)",
}
"""The overrides a resume applies, and what each may say."""


def read_run_config(run_dir: str | Path) -> TrainConfig:
    path = RunDir(Path(run_dir)).config
    if not path.is_file():
        raise ValueError(f"{run_dir} is not an asyncrl run folder (no config.json); pass runs/<name>")
    return config_from_dict(json.loads(path.read_text()))


class RunFinished(Exception):
    """The run folder holds a finished run: a resume has nothing to do (the command exits 0)."""


def check_resumable(run_dir: Path) -> None:
    """``ValueError`` when ``run_dir`` is not a run folder; ``RunFinished`` when its learner finished
    (``learner_final.json`` exists). Reads only: a launcher calls it before it takes the folder's lock."""
    paths = RunDir(run_dir)
    if not paths.config.is_file():
        raise ValueError(f"{run_dir} is not an asyncrl run folder (no config.json); pass resume=runs/<name>")
    if not paths.learner_final.is_file():
        return
    try:
        version = json.loads(paths.learner_final.read_text()).get("version", "?")
    except (OSError, ValueError):
        version = "?"
    raise RunFinished(f"{run_dir} already finished (learner version {version}, learner_final.json); nothing to "
                      f"resume and nothing was changed. Its results are in {run_dir} (summary.json, model/); to "
                      f"train on, start a new run, or retrain from its log: asyncrl replay run={run_dir}")


def resume_config(run_dir: Path, overrides: Sequence[str], *, command: str = "train",
                  say: Callable[[str], None] = print) -> TrainConfig:
    """The configuration to resume ``run_dir`` with: its ``config.json`` with the ``RESUME_KEYS``
    overrides applied (checked), every path absolute, ``resume`` set. Other overrides are ignored
    and named. ``RunFinished`` for a finished run; ``ValueError`` naming the fix for a bad override."""
    run_dir = Path(run_dir).resolve()
    check_resumable(run_dir)
    cfg = read_run_config(run_dir)  # a resumed run keeps its own configuration
    rest = [o for o in overrides if not o.startswith("resume=")]
    accepted = [o for o in rest if "=" in o and o.split("=", 1)[0].lstrip("+~") in RESUME_KEYS]
    ignored = [o for o in rest if o not in accepted]
    if ignored:
        say(f"asyncrl {command}: resume keeps the run's configuration; ignoring {ignored}")
    resolve_paths(cfg)  # a run written before task.eval_path was stored absolute
    if accepted:
        new = apply_overrides(cfg, [o.lstrip("+~") for o in accepted])
        resolve_paths(new)
        for key in sorted({o.split("=", 1)[0].lstrip("+~") for o in accepted}):
            old_value, new_value = _get(cfg, key), _get(new, key)
            if old_value == new_value:
                continue
            if key != "log.salvage":
                _check_moved(key, old_value, new_value)
            say(f"asyncrl {command}: resume with {key}={new_value} (was {old_value!r}): {RESUME_KEYS[key]}")
        cfg = new
    cfg.resume = str(run_dir)
    return cfg


def _get(cfg: TrainConfig, key: str):
    section, _, leaf = key.rpartition(".")
    return getattr(getattr(cfg, section), leaf)


def _check_moved(key: str, old: str, new: str) -> None:
    """``ValueError`` unless ``new`` is ``old``'s files at another place (see the module docstring)."""
    if not new:
        raise ValueError(f"{key}= is empty; a resume may point {key} at the run's moved files, not drop them")
    old_p, new_p = Path(old) if old else None, Path(new)
    if key == "model.path":
        if not (new_p / "config.json").is_file():
            raise ValueError(f"model.path={new} holds no model (no config.json); point it at the run's moved "
                             "model folder")
        if old_p is not None and (old_p / "config.json").is_file():
            raise ValueError(f"model.path={new}: the run's model folder {old} is still there; a resume keeps the "
                             "run's model (resume without model.path, or start a new run for another model)")
        if old_p is not None and new_p.name != old_p.name:
            raise ValueError(f"model.path={new}: keep the folder name {old_p.name!r} (the trajectory log names the "
                             f"model by it); rename the folder to {new_p.parent / old_p.name}")
        return
    if not new_p.exists():
        raise ValueError(f"{key}={new} does not exist; point it at the run's moved file")
    if old_p is not None and old_p.exists() and not _same_data(old_p, new_p):
        raise ValueError(f"{key}={new}: the run's {old} is still there and holds other data; a resume keeps the "
                         f"run's data (point {key} at a copy of it, or start a new run)")


def _same_data(a: Path, b: Path) -> bool:
    if a.is_file() and b.is_file():
        return filecmp.cmp(a, b, shallow=False)
    return a.resolve() == b.resolve()
