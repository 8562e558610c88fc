"""Path keys of a run configuration: which keys name files or folders, and making them absolute.

Owns: ``PATH_KEYS`` (every key whose value is a file or folder on disk) and ``resolve_paths``, which
makes each of them absolute against the caller's working directory before ``config.json`` is written,
so the children (which run in that folder) and a later resume or replay started from anywhere else read
the same files.
Never: checks that a path exists (the task and model checks do, naming the key), or touches the disk.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

PATH_KEYS = ("runs_dir", "model.path", "model.cache_dir", "task.path", "task.eval_path", "transport.keys_dir")
"""Every key naming a file or folder (``sglang.python`` may be a command on PATH and is left as given)."""


def resolve_paths(cfg: Any, cwd: Path | None = None) -> None:
    """Make every non-empty ``PATH_KEYS`` value of ``cfg`` (a ``TrainConfig``) absolute against ``cwd``
    (default: the current folder), ``~`` expanded."""
    base = Path.cwd() if cwd is None else cwd
    for key in PATH_KEYS:
        section, _, leaf = key.rpartition(".")
        node = getattr(cfg, section) if section else cfg
        value = getattr(node, leaf)
        if value:
            setattr(node, leaf, str((base / Path(value).expanduser()).resolve()))
