"""Version sources, clocks and sample ids for the control layer.

Owns: the ``VersionSource`` protocol the staleness gate reads, a small mutable ``ManualVersion``
source, the ``Clock`` type, and the deterministic id scheme for groups and samples.

Must never: import anything outside the standard library, read the wall clock or a learner by
itself (both are injected), or produce an id that depends on timing or on which worker ran what.

Invariants:
- A version is the integer policy version: the number of learner steps completed. Sources are
  read, never written, by the control layer; ``ManualVersion`` only moves forward.
- Ids are deterministic: the n-th group a ``GroupBuffer`` admits is ``g{n}`` and sample ``i`` of a
  group is ``f"{group_id}/{i}"``. A resumed run continues the numbering from its checkpoint, so
  an id names one sample for the whole life of a run (also across worker deaths and reissues:
  a reissued sample keeps its id, which is what makes exactly-once accounting possible).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Protocol, runtime_checkable

Clock = Callable[[], float]
"""Monotonic seconds (``time.monotonic`` in production, a fake in tests)."""


@runtime_checkable
class VersionSource(Protocol):
    """Anything with an integer ``version`` attribute or property (AReaL's ``VersionProvider``)."""

    @property
    def version(self) -> int: ...


VersionLike = VersionSource | Callable[[], int]
"""Either an object with ``.version`` or a zero-argument callable returning the version."""


def version_reader(source: VersionLike) -> Callable[[], int]:
    """Normalise a ``VersionLike`` to a zero-argument function returning an ``int``."""
    if isinstance(source, VersionSource):
        return lambda: int(source.version)
    if callable(source):
        return lambda: int(source())
    raise TypeError(
        f"version source must have a .version attribute or be callable, got {type(source).__name__}"
    )


class ManualVersion:
    """A version source moved by hand: the controller sets it when the learner reports a new
    version; tests drive it directly."""

    def __init__(self, version: int = 0) -> None:
        if version < 0:
            raise ValueError(f"version must be >= 0, got {version}")
        self._version = int(version)

    @property
    def version(self) -> int:
        return self._version

    def set(self, version: int) -> None:
        """Move to ``version``; versions never go back (a learner cannot un-train)."""
        if version < self._version:
            raise ValueError(
                f"version went back from {self._version} to {version}; a learner version only "
                "increases (resume the controller and the learner from the same checkpoint)"
            )
        self._version = int(version)

    def advance(self, steps: int = 1) -> int:
        self.set(self._version + steps)
        return self._version


def make_group_id(seq: int) -> str:
    """Id of the ``seq``-th admitted group (0-based): ``g{seq}``."""
    if seq < 0:
        raise ValueError(f"group sequence number must be >= 0, got {seq}")
    return f"g{seq}"


def make_sample_id(group_id: str, index: int) -> str:
    """Id of member ``index`` of a group: ``f"{group_id}/{index}"``."""
    return f"{group_id}/{index}"


def parse_sample_id(sample_id: str) -> tuple[int, int] | None:
    """``"g12/3" -> (12, 3)``; ``None`` when the string is not an id this scheme makes."""
    group_id, sep, index = sample_id.partition("/")
    if not sep or not group_id.startswith("g"):
        return None
    seq_text = group_id[1:]
    if not (seq_text.isascii() and seq_text.isdigit() and index.isascii() and index.isdigit()):
        return None
    if make_group_id(int(seq_text)) != group_id or str(int(index)) != index:
        return None  # non-canonical spellings such as "g01/2" or "g1/02" name no sample
    return int(seq_text), int(index)
