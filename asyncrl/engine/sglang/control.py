"""The SGLang engine's ordered control channel: typed operations and the thread that applies them.

Owns: the control operations (``Control`` without arguments, ``WeightUpdate`` with a version and its
payload), ``ControlChannel`` -- the part of ``SGLangEngine`` that applies them one by one, in the order
they were recorded, on its *control* thread (so pause -> update -> resume reach SGLang in that order).

Must never: record an operation (``SGLangEngine``'s any-thread methods do that, under ``_lock``), send a
``/generate`` call, hold ``_lock`` during an HTTP call, or end on an error of one operation (the error is
queued for the engine thread, which raises it from ``generate``/``poll``; the channel carries on).

Mid-generation weight updates (SGLang 0.5.23): ``/pause_generation`` ``mode="in_place"`` (running
requests keep their KV cache), ``/begin_weight_update``, ``/update_weights_from_tensor`` chunks (last one
with ``weight_version``), ``/end_weight_update``, ``/continue_generation``. A token sampled before the
pause carries the old version; its K/V is computed by the new weights, as in the native engine. A
checkpoint folder goes through ``/update_weights_from_disk``; a caller's own pause is kept (no
pause/continue around it).
"""

from __future__ import annotations

import enum
import threading
import time
from abc import ABC, abstractmethod
from collections import deque
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from asyncrl.engine.sglang.http import SGLangError, SGLangHTTP, SGLangRequestError
from asyncrl.engine.sglang.requests import Pending
from asyncrl.engine.sglang.weights import TensorUpdate, disk_body, tensor_bodies


class Control(enum.Enum):
    """A control operation without arguments, applied by the control thread in the order recorded."""

    PAUSE = "pause"  # /pause_generation in place
    RESUME = "resume"  # /continue_generation
    RESUME_FOR_CLOSE = "resume_for_close"  # /continue_generation only if a caller had paused
    ABORT = "abort"  # /abort_request for every in-flight sample whose abort was asked for
    FLUSH = "flush"  # /flush_cache (a refusal while requests run is ignored)
    STOP = "stop"  # end the control thread (close)


@dataclass(frozen=True, slots=True)
class WeightUpdate:
    """The control operation that moves the server to ``version`` (pause, load ``payload``, resume)."""

    version: int
    payload: TensorUpdate | Path


ControlOp = Control | WeightUpdate


class ControlChannel(ABC):
    """Applies the operations in ``_controls`` to the server (see module docstring); ``SGLangEngine``
    builds on it, sets the state declared below in its ``__init__`` and runs ``_control_loop`` on its
    control thread. ``_pump`` (the engine's dispatch) runs after every operation, under ``_lock``."""

    http: SGLangHTTP
    server_info: dict[str, Any]
    max_chunk_bytes: int
    abort_retry_s: float
    _lock: threading.Lock
    _cond: threading.Condition
    _controls: deque[ControlOp]
    _aborts: set[str]  # in flight, abort wanted, result not back yet
    _inflight: dict[str, Pending]  # sample id -> sent request
    _errors: deque[BaseException]
    _closed: bool
    _paused: bool  # what callers asked for
    _updates: int  # weight updates queued or being applied: dispatch is held until they are done
    _version: int

    @abstractmethod
    def _pump(self) -> None:
        """Under ``_lock``: send queued requests while there is room and nothing holds dispatch."""

    def _control_loop(self) -> None:
        while True:
            with self._lock:
                while not self._controls:
                    if self._aborts and not self._closed:
                        break  # re-send pending aborts (SGLang ignores one for a rid it has not seen yet)
                    self._cond.wait(timeout=1.0)
                op = self._controls.popleft() if self._controls else Control.ABORT
            try:
                if op is Control.STOP:
                    return
                self._apply(op)
            except (SGLangError, ValueError) as exc:
                with self._lock:
                    self._errors.append(exc)
                    self._cond.notify_all()
            finally:
                with self._lock:
                    if isinstance(op, WeightUpdate):
                        self._updates -= 1
                    self._pump()
            if op is Control.ABORT:
                time.sleep(self.abort_retry_s)

    def _apply(self, op: ControlOp) -> None:
        if isinstance(op, WeightUpdate):
            self._apply_update(op.version, op.payload)
        elif op is Control.PAUSE:
            self.http.post("/pause_generation", {"mode": "in_place"})
        elif op is Control.RESUME or op is Control.RESUME_FOR_CLOSE:
            if op is Control.RESUME or self._paused:
                self.http.post("/continue_generation", {})
        elif op is Control.ABORT:
            with self._lock:
                rids = [self._inflight[s].rid for s in self._aborts if s in self._inflight]
            for rid in rids:
                self.http.post("/abort_request", {"rid": rid}, expect_json=False)
        elif op is Control.FLUSH:
            try:
                self.http.post("/flush_cache", {}, expect_json=False)
            except SGLangRequestError as exc:
                if exc.status != 400:
                    raise

    def _apply_update(self, version: int, payload: TensorUpdate | Path) -> None:
        user_paused = self._paused
        if not user_paused:
            self.http.post("/pause_generation", {"mode": "in_place"})
        try:
            if isinstance(payload, Path):
                self.http.post("/update_weights_from_disk", disk_body(payload, version))
            else:
                tp_size = int(self.server_info.get("tp_size", 1) or 1)
                self.http.post("/begin_weight_update", {})
                try:
                    for body in tensor_bodies(payload, version, tp_size=tp_size, max_chunk_bytes=self.max_chunk_bytes):
                        self.http.post("/update_weights_from_tensor", body)
                finally:
                    self.http.post("/end_weight_update", {})
            self._version = version
        finally:
            if not user_paused:
                self.http.post("/continue_generation", {})
