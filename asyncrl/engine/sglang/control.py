"""The SGLang engine's ordered control channel: typed operations and the thread that applies them.

Owns: the control operations (``Control`` without arguments, ``WeightUpdate`` with a version and its payload)
and ``ControlChannel``, which an ``SGLangEngine`` holds as ``control``: the operations not yet applied, the
caller's pause, the updates that hold dispatch, the versions, the aborts wanted, and the *control* thread that
applies the operations in the order recorded (so pause -> update -> resume reach SGLang in that order).

Must never: be used without the engine's lock (its recording methods run under it; the thread takes it),
send a ``/generate`` call, hold the lock during an HTTP call, or end on an error of one operation (the
error is queued for the engine thread, which raises it from ``generate``/``poll``; the channel carries on).

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
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from asyncrl.engine.sglang.http import SGLangError, SGLangHTTP, SGLangRequestError
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


class ControlChannel:
    """The ordered control channel of one ``SGLangEngine`` (see module docstring). ``cond`` is the engine's
    condition, whose lock guards every field here; ``errors`` is the engine's queue of errors for its thread;
    ``dispatch`` (the engine's, under the lock) runs after every operation."""

    def __init__(self, http: SGLangHTTP, cond: threading.Condition, *, version: int, tp_size: int,
                 max_chunk_bytes: int, abort_retry_s: float, errors: deque[BaseException],
                 dispatch: Callable[[], None]) -> None:
        self.http, self.tp_size = http, tp_size
        self.max_chunk_bytes, self.abort_retry_s = max_chunk_bytes, abort_retry_s
        self._cond, self._errors, self._dispatch = cond, errors, dispatch
        self.ops: deque[ControlOp] = deque()
        self.aborts: dict[str, str] = {}  # sample id -> rid: in flight, abort wanted, result not back yet
        self.version = self.latest_version = version  # served by the server; newest recorded
        self.paused = False  # what callers asked for
        self.updates = 0  # weight updates queued or being applied: dispatch is held until they are done
        self.thread = threading.Thread(target=self._loop, name="sglang-control", daemon=True)
        self.thread.start()

    # ------------------------------------------------------- recording (any thread, under the engine's lock)

    def push(self, *ops: ControlOp) -> None:
        self.ops.extend(ops)
        self._cond.notify_all()

    def update(self, version: int, payload: TensorUpdate | Path) -> None:
        """Move to ``version`` after what was recorded before; an update still waiting is dropped for it."""
        if version <= self.latest_version:
            raise ValueError(f"weight version {version} is not newer than {self.latest_version}")
        kept: deque[ControlOp] = deque(c for c in self.ops if not isinstance(c, WeightUpdate))
        self.updates -= len(self.ops) - len(kept)
        self.ops = kept
        self.updates += 1
        self.latest_version = version
        self.push(WeightUpdate(version, payload))

    def abort(self, rids: dict[str, str]) -> None:
        """Abort these in-flight samples (sample id -> rid) at the server; re-sent until their results return."""
        if rids.keys() - self.aborts.keys():
            self.aborts |= rids
            self.push(Control.ABORT)

    def set_paused(self, paused: bool) -> None:
        if paused != self.paused:
            self.paused = paused
            self.push(Control.PAUSE if paused else Control.RESUME)

    # ------------------------------------------------------- the control thread

    def _loop(self) -> None:
        while True:
            with self._cond:
                while not self.ops and not self.aborts:  # re-send pending aborts (SGLang ignores one for a
                    self._cond.wait(timeout=1.0)  # rid it has not seen yet)
                op = self.ops.popleft() if self.ops else Control.ABORT
            try:
                if op is Control.STOP:
                    return
                self._apply(op)
            except (SGLangError, ValueError) as exc:
                with self._cond:
                    self._errors.append(exc)
                    self._cond.notify_all()
            finally:
                with self._cond:
                    if isinstance(op, WeightUpdate):
                        self.updates -= 1
                    self._dispatch()
            if op is Control.ABORT:
                time.sleep(self.abort_retry_s)

    def _apply(self, op: ControlOp) -> None:
        if isinstance(op, WeightUpdate):
            self._apply_update(op.version, op.payload)
        elif op is Control.PAUSE:
            self.http.post("/pause_generation", {"mode": "in_place"})
        elif op is Control.RESUME or op is Control.RESUME_FOR_CLOSE:
            if op is Control.RESUME or self.paused:
                self.http.post("/continue_generation", {})
        elif op is Control.ABORT:
            with self._cond:
                rids = list(self.aborts.values())
            for rid in rids:
                self.http.post("/abort_request", {"rid": rid}, expect_json=False)
        elif op is Control.FLUSH:
            try:
                self.http.post("/flush_cache", {}, expect_json=False)
            except SGLangRequestError as exc:
                if exc.status != 400:
                    raise

    def _apply_update(self, version: int, payload: TensorUpdate | Path) -> None:
        user_paused = self.paused
        if not user_paused:
            self.http.post("/pause_generation", {"mode": "in_place"})
        try:
            if isinstance(payload, Path):
                self.http.post("/update_weights_from_disk", disk_body(payload, version))
            else:
                self.http.post("/begin_weight_update", {})
                try:
                    for body in tensor_bodies(payload, version, tp_size=self.tp_size,
                                              max_chunk_bytes=self.max_chunk_bytes):
                        self.http.post("/update_weights_from_tensor", body)
                finally:
                    self.http.post("/end_weight_update", {})
            self.version = version
        finally:
            if not user_paused:
                self.http.post("/continue_generation", {})
