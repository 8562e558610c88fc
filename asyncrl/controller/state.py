"""A controller state on disk: what ``ControllerCore.state_dict`` holds, as checksummed JSON.

Owns: reading a saved state (``read_state``) and the JSON form of the one non-JSON value in it, a
streamed ``FinishedSample`` (hex of its msgpack encoding). Never: decides which state to resume from
(``asyncrl.controller.recovery``) or writes one (``ControllerCore.save``).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import protocols as P
from asyncrl.rundir.files import read_checksummed_json


def read_state(path: Path) -> dict[str, Any]:
    """A saved controller state; ``ChecksumError`` (a ValueError) if the file is damaged."""
    return read_checksummed_json(path, object_hook=from_jsonable)


def jsonable(obj: Any) -> Any:
    if isinstance(obj, P.FinishedSample):
        return {"__finished_sample__": P.encode(obj).hex()}
    raise TypeError(f"cannot checkpoint {type(obj).__name__}")


def from_jsonable(d: dict) -> Any:
    if "__finished_sample__" in d:
        return P.decode(bytes.fromhex(d["__finished_sample__"]), P.FinishedSample)
    return d
