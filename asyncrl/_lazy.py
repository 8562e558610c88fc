"""Package attributes imported on first use (PEP 562 ``__getattr__``), so importing a package
costs nothing until a name of it is used: ``asyncrl.algo``, ``asyncrl.learner`` and
``asyncrl.models`` export their torch side this way, and a process that never touches it (the
controller, the launcher) never loads torch."""

from __future__ import annotations

import importlib
import sys
from collections.abc import Callable, Mapping
from typing import Any


def lazy_exports(package: str, homes: Mapping[str, tuple[str, ...]]) -> Callable[[str], Any]:
    """A module ``__getattr__`` for ``package``: ``homes`` maps a submodule to the names it exports;
    the first use of a name imports its submodule and keeps the value on the package."""
    home = {name: module for module, names in homes.items() for name in names}

    def __getattr__(name: str) -> Any:
        module = home.get(name)
        if module is None:
            raise AttributeError(f"module {package!r} has no attribute {name!r}")
        value = getattr(importlib.import_module(f"{package}.{module}"), name)
        setattr(sys.modules[package], name, value)
        return value

    return __getattr__
