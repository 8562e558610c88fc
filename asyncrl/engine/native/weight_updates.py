"""The native engine's weight updates: handed over and applied at a step boundary, or streamed in buckets.

Owns: ``WeightUpdates``, the part of ``NativeEngine`` (asyncrl/engine/native/engine.py, whose threading model
applies) that takes new weights: ``update_weights`` (any thread: recorded, applied by the engine thread at its
next step boundary, ``_apply_pending_weights``), ``load_stream`` (the calling thread loads a version as its
buckets arrive, holding the step boundary) and ``take_delta_failure``.

Must never: load weights while a forward runs (every load holds ``_step_lock``), or leave a version half
loaded (the loaders are all or nothing: ``asyncrl.engine.native.weights``).
"""

from __future__ import annotations

import itertools
import logging
import threading
from collections.abc import Iterable
from typing import Any

import torch

from asyncrl.engine.base import EngineClosedError
from asyncrl.engine.native.static_step import StaticStep
from asyncrl.engine.native.swap_state import SwapState
from asyncrl.engine.native.weights import apply_weights, check_weights, stream_weights
from asyncrl.quant import PublishedDelta, QuantError

log = logging.getLogger("asyncrl.engine.native.engine")


class WeightUpdates:
    """Mixed into ``NativeEngine``, whose ``__init__`` sets these attributes."""

    quant_format: str
    _model: torch.nn.Module | None
    _lock: threading.Lock
    _wake: threading.Condition
    _step_lock: threading.Lock
    _closed: bool
    _version: int
    _pending_weights: list[tuple[int, Any]]
    _delta_failed: bool
    _swap: SwapState
    _static: StaticStep | None

    def update_weights(self, version: int, weights: Any) -> None:
        """Record weights for ``version``; they are swapped in at the next step boundary.

        ``weights``: a ``PublishedWeights`` from ``asyncrl.quant.publish`` in this engine's format, a
        ``PublishedDelta`` from the version handed over before it (``asyncrl.quant.make_delta``), or a plain
        state dict (fp32 engine: loaded as is; quantized engine: quantized here). If several full updates
        arrive before a boundary only the newest is applied; deltas queued after it are applied in order.
        ``version`` must exceed every earlier one.
        """
        if not isinstance(version, int) or isinstance(version, bool):
            raise ValueError(f"version must be an int, got {version!r}")
        with self._lock:
            model = self._model
        if model is None:
            raise EngineClosedError("engine is closed; build a new one")
        check_weights(weights, self.quant_format, model)
        with self._lock:
            if self._closed:
                raise EngineClosedError("engine is closed; build a new one")
            latest = self._pending_weights[-1][0] if self._pending_weights else self._version
            if version <= latest:
                raise ValueError(
                    f"weight version {version} is not newer than {latest}; versions must increase"
                )
            if isinstance(weights, PublishedDelta):
                if weights.base_version != latest:
                    raise ValueError(f"a delta from version {weights.base_version} cannot follow version {latest}; "
                                     "fetch the version whole")
                self._pending_weights.append((version, weights))
            else:
                self._pending_weights = [(version, weights)]
            self._wake.notify_all()

    def load_stream(self, version: int, buckets: Iterable[Any]) -> Any:
        """Load ``version`` as its buckets arrive (``buckets``: a ``WeightClient.stream``), on the calling thread,
        at a step boundary: the first bucket is received while the engine decodes, then the load waits for the step
        in progress and no forward runs until it ends (a token is never drawn from half a version), so the receive
        buffers held are one bucket's instead of a model's. On any error (a check, a torn transfer) the weights are
        the version before, bit for bit, and it propagates. Returns the ``asyncrl.quant.LoadedVersion``. Weights
        handed to ``update_weights`` must be applied first."""
        if not isinstance(version, int) or isinstance(version, bool):
            raise ValueError(f"version must be an int, got {version!r}")
        rest = iter(buckets)
        first = next(rest, None)  # taken before the boundary: a version of one bucket stops decoding only to load
        if first is not None:
            rest = itertools.chain([first], rest)
            del first
        with self._step_lock:
            with self._lock:
                if self._closed or self._model is None:
                    raise EngineClosedError("engine is closed; build a new one")
                if self._pending_weights:
                    raise ValueError("weights handed to update_weights are not applied yet; stream the next version "
                                     "after the engine's next step")
                if version <= self._version:
                    raise ValueError(f"weight version {version} is not newer than {self._version}; versions must "
                                     "increase")
            loaded = stream_weights(self._model, rest, version)
            self._version = version
            self._swap.loaded(self._model, loaded, self._static)
        return loaded

    def take_delta_failure(self) -> bool:
        """True once after a delta failed to apply (the engine kept its version; fetch the next one whole)."""
        with self._lock:
            failed, self._delta_failed = self._delta_failed, False
        return failed

    def _apply_pending_weights(self) -> None:
        """Engine thread, under ``_step_lock``, at a step boundary: load the updates handed over, in order (a
        full one's error propagates; a delta that fails leaves the version before and is reported once by
        ``take_delta_failure``)."""
        with self._lock:
            updates, self._pending_weights = self._pending_weights, []
        for version, weights in updates:
            if self._model is None:
                break
            if isinstance(weights, PublishedDelta):
                try:
                    apply_weights(self._model, weights, self.quant_format, version)
                except QuantError as e:  # the model is unchanged: keep serving, and ask for the version whole
                    log.error("could not apply the delta to weights v%d (keeping v%d): %s", version,
                              self._version, e)
                    with self._lock:
                        self._delta_failed = True
                    break
            else:
                apply_weights(self._model, weights, self.quant_format, version)
            self._version = version
            self._swap.loaded(self._model, weights, self._static)
