"""Where model folders live and how they are created safely.

Owns: the default models directory and the create-once-atomically function used by ``ensure_*``.

Must never: download anything. A model folder is either already complete on disk or built locally.

Invariants: a folder returned by ``ensure_folder`` is complete (every required file present), because it
is built in a temporary sibling folder and renamed into place; concurrent builders race harmlessly (the
first rename wins, the others discard their copy).
"""

from __future__ import annotations

import os
import shutil
import tempfile
from collections.abc import Callable, Sequence
from pathlib import Path

HF_REQUIRED_FILES = ("config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json")


def default_models_dir() -> Path:
    """``$ASYNCRL_MODELS_DIR`` if set, else ``~/.cache/asyncrl/models``."""
    env = os.environ.get("ASYNCRL_MODELS_DIR")
    return Path(env) if env else Path.home() / ".cache" / "asyncrl" / "models"


def is_complete(folder: Path, required: Sequence[str] = HF_REQUIRED_FILES) -> bool:
    return folder.is_dir() and all((folder / name).is_file() for name in required)


def ensure_folder(
    folder: Path, build: Callable[[Path], object], required: Sequence[str] = HF_REQUIRED_FILES
) -> Path:
    """Return ``folder``, first running ``build(tmp)`` and renaming ``tmp`` into place if it is missing.

    Raises ``ValueError`` if ``folder`` exists but is incomplete (a folder someone else put there).
    """
    folder = Path(folder).expanduser().resolve()
    if is_complete(folder, required):
        return folder
    if folder.exists() and any(folder.iterdir()):
        raise ValueError(
            f"{folder} exists but lacks some of {list(required)}; remove it or pass another folder"
        )
    folder.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{folder.name}.", dir=folder.parent))
    try:
        build(tmp)
        assert is_complete(tmp, required), f"builder left {sorted(p.name for p in tmp.iterdir())}"
        if folder.exists():  # an empty folder, or one another process completed meanwhile
            if is_complete(folder, required):
                return folder
            folder.rmdir()
        try:
            os.rename(tmp, folder)
        except OSError:
            if not is_complete(folder, required):
                raise
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)
    return folder
