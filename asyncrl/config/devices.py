"""The device grammar of every configuration key and command-line setting that names a device.

Owns: the one parser of device strings (``parse_device``) and its one refusal message: ``auto`` (a GPU
when one is visible, else the CPU), ``cpu``, ``cuda`` (any GPU) and, where a key allows pinning,
``cuda:N`` (GPU index N of the ones visible). ``rollout.device``, ``learner.device``, ``sglang.device``,
the worker's ``rollout.device=``, the engine factory's ``resolve_device`` and the launcher's GPU placement all
read device strings through it.
Never: imports torch or asks which GPUs exist (``asyncrl.engine.factory.resolve_device`` does that,
after parsing here).
"""

from __future__ import annotations

from dataclasses import dataclass

DEVICE_KINDS = ("auto", "cpu", "cuda")
"""The device words; ``cuda:N`` adds an index to ``cuda`` where the key allows it."""


@dataclass(frozen=True, slots=True)
class Device:
    """A parsed device: ``kind`` is one of ``DEVICE_KINDS``; ``index`` is N of ``cuda:N`` (else None)."""

    kind: str
    index: int | None = None

    @property
    def text(self) -> str:
        """The device as a string (``cuda:1``, ``auto``), as ``torch.device`` and ``parse_device`` take it."""
        return self.kind if self.index is None else f"{self.kind}:{self.index}"

    @property
    def pinned(self) -> bool:
        """``cuda:N``: the user chose the GPU, so nothing may reassign it (``CUDA_VISIBLE_DEVICES``)."""
        return self.index is not None

    @property
    def may_use_gpu(self) -> bool:
        """``auto`` or ``cuda`` without an index: a process that a launcher may give a GPU of its own."""
        return self.kind != "cpu" and self.index is None


def parse_device(value: str, *, key: str = "device", indexed: bool = True) -> Device:
    """``value`` as a ``Device``; ``ValueError`` naming ``key`` and every valid spelling otherwise.

    ``indexed=False`` for keys that take no ``cuda:N`` (``learner.device``: rank r uses ``cuda:LOCAL_RANK``;
    ``sglang.device``: the server's own placement)."""
    text = str(value)
    head, colon, index = text.partition(":")
    if head in DEVICE_KINDS and not colon:
        return Device(head)
    if indexed and head == "cuda" and index.isdigit():
        return Device("cuda", int(index))
    choices = "auto, cpu, cuda or cuda:N (N = GPU index)" if indexed else "auto, cpu or cuda"
    raise ValueError(f"{key}={text!r} is not a device; choose {choices}")
