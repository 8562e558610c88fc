"""The native engine's weight state: the version it serves, updates handed over and not applied yet, a failed delta.

Owns: ``WeightUpdates``, which a ``NativeEngine`` (engine.py, whose threading model applies) holds as ``weights``:
``record`` (any thread, under the engine's ``_lock``: an update checked and queued), ``apply_pending`` (the engine
thread loads it at its next step boundary), ``stream`` (a version loaded as its buckets arrive, the boundary held),
``take_delta_failure``, and the loaded version's ``SwapState``.

Must never: load weights while a forward runs (the engine calls ``apply_pending`` and ``stream`` holding its
``_step_lock``), or leave a version half loaded (the loaders are all or nothing: ``asyncrl.engine.native.weights``).
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Iterable
from typing import Any

import torch

from asyncrl.engine.native.static_step import StaticStep
from asyncrl.engine.native.swap_state import SwapState
from asyncrl.engine.native.weights import apply_weights, stream_weights
from asyncrl.quant import PublishedDelta, QuantError

log = logging.getLogger(__name__)


class WeightUpdates:
    """The weights of one ``NativeEngine`` of ``quant_format``; ``lock`` is the engine's ``_lock``, which guards
    ``pending`` and ``delta_failed`` (``version`` and ``swap`` change on the engine thread only)."""

    def __init__(self, model: torch.nn.Module, quant_format: str, version: int, lock: threading.Lock) -> None:
        self.quant_format = quant_format
        self.version = int(version)  # of the weights the next forward uses (pending updates not counted)
        # updates not yet applied, in order: a full version replaces them all, a delta (its base the one
        # before it) is applied after them
        self.pending: list[tuple[int, Any]] = []
        self.delta_failed = False  # a delta did not apply: the holder must fetch a version whole
        self.swap = SwapState(model)  # forward AQN and graph addresses, kept across weight loads
        self._lock = lock

    def record(self, version: int, weights: Any) -> None:
        """Under the engine's lock: queue ``weights`` (checked against the model) for ``version``, which must be
        newer than every version before it; a delta must follow the version it was made from."""
        latest = self.pending[-1][0] if self.pending else self.version
        if version <= latest:
            raise ValueError(f"weight version {version} is not newer than {latest}; versions must increase")
        if isinstance(weights, PublishedDelta):
            if weights.base_version != latest:
                raise ValueError(f"a delta from version {weights.base_version} cannot follow version {latest}; "
                                 "fetch the version whole")
            self.pending.append((version, weights))
        else:
            self.pending = [(version, weights)]

    def take_delta_failure(self) -> bool:
        """True once after a delta failed to apply (the engine kept its version; fetch the next one whole)."""
        with self._lock:
            failed, self.delta_failed = self.delta_failed, False
        return failed

    def apply_pending(self, model: torch.nn.Module | None, static: StaticStep | None) -> None:
        """Engine thread, at a step boundary: load the updates handed over, in order (a full one's error
        propagates; a delta that fails leaves the version before and is reported once by ``take_delta_failure``)."""
        with self._lock:
            updates, self.pending = self.pending, []
        for version, weights in updates:
            if model is None:
                break
            if isinstance(weights, PublishedDelta):
                try:
                    apply_weights(model, weights, self.quant_format, version)
                except QuantError as e:  # the model is unchanged: keep serving, and ask for the version whole
                    log.error("could not apply the delta to weights v%d (keeping v%d): %s", version, self.version, e)
                    with self._lock:
                        self.delta_failed = True
                    break
            else:
                apply_weights(model, weights, self.quant_format, version)
            self.version = version
            self.swap.loaded(model, weights, static)

    def stream(self, model: torch.nn.Module, version: int, buckets: Iterable[Any], static: StaticStep | None) -> Any:
        """Engine's step boundary held: load ``version`` from ``buckets`` as they arrive (all or nothing)."""
        with self._lock:
            if self.pending:
                raise ValueError("weights handed to update_weights are not applied yet; stream the next version "
                                 "after the engine's next step")
            if version <= self.version:
                raise ValueError(f"weight version {version} is not newer than {self.version}; versions must increase")
        loaded = stream_weights(model, buckets, version)
        self.version = version
        self.swap.loaded(model, loaded, static)
        return loaded
