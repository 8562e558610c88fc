"""The native engine's engine thread: step boundaries, the live batch, and the results of finished samples.

Owns: ``StepLoop``, the half of ``NativeEngine`` (``asyncrl.engine.native.engine``) that the engine thread runs:
``step`` (one step boundary plus at most one forward), ``generate`` and ``poll`` (the loops around it),
``wait`` / ``has_work`` (whether a step has anything to do), and the live batch ``_active`` (row ``r`` of the
K/V cache is ``_active[r]``): admission (``_join``), a row leaving (``_remove_row``, the last row moved into its
place), the choice of decode path per step (the static step, or the eager reference with forward AQN noise),
overlap (a static step left in flight, ``InFlight``, read after the next one is launched), and the per-token
record of behaviour log-prob and policy version.

Must never: hold ``_lock`` while a forward runs (other threads record intent under it and must never wait on
the model), touch the model, the K/V cache or ``_active`` outside ``_step_lock``, or build anything the engine's
options decide (``asyncrl.engine.native.build`` does, at construction).

Invariants: at a step boundary the order is (read the step in flight unless nothing changes) -> weights ->
aborts -> (stop if paused or closed) -> admit queued requests -> one forward + sample; a step is launched ahead of
the one in flight only on the same rows, none of whose token in flight is its last by length; every token
recorded carries the version whose weights drew it (fixed when its step was launched); every request submitted
is yielded exactly once.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import deque
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any

from asyncrl.engine.base import GenRequest, GenResult
from asyncrl.engine.native.forward import eager_forward, static_forward, static_forward_ahead
from asyncrl.engine.native.rows import Seq, split_aborted, take_admissible
from asyncrl.engine.native.static_step import StaticStep
from asyncrl.engine.native.weight_updates import WeightUpdates

log = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class InFlight:
    """A static step launched and its device-to-host copy started, its results not read yet."""

    static: StaticStep
    slot: int
    """``StaticStep.fetch_wait``'s slot."""
    rows: int
    """Live rows ``0..rows-1`` it sampled for (the batch does not change while it is in flight)."""
    version: int
    """The weights it ran: every token it sampled carries this version."""


class StepLoop:
    """The engine-thread half of ``NativeEngine``; the state it reads is made by ``NativeEngine.__init__``."""

    max_batch_size: int
    max_prefill_tokens: int
    weights: WeightUpdates
    _runner: Any
    _static: StaticStep | None
    _model: Any
    _lock: threading.Lock
    _wake: threading.Condition
    _step_lock: threading.Lock
    _inbox: deque[Seq]
    _live_ids: set[str]
    _aborts: set[str]
    _paused: bool
    _closed: bool
    _active: list[Seq]
    _eager_notice: bool
    _prewarm: bool
    _overlap: bool
    _inflight: InFlight | None
    _ready: list[GenResult]

    submit: Callable[[Sequence[GenRequest]], None]  # NativeEngine's control surface (engine.py)

    def has_work(self) -> bool:
        """True while any submitted request has not been yielded yet."""
        with self._lock:
            return bool(self._live_ids)

    def wait(self, timeout: float | None = None) -> bool:
        """Block until ``step()`` has something to do (or ``timeout`` s pass); return whether it has."""
        with self._wake:
            return self._wake.wait_for(self._runnable, timeout)

    def generate(self, requests: Sequence[GenRequest] = ()) -> Iterator[GenResult]:
        """Submit ``requests``, then step and yield each result as it finishes until no request is live.

        Also yields requests submitted meanwhile from other threads. While paused it blocks (it does not
        return) until resumed, aborted or closed. Stopping the iteration early leaves live requests in the
        engine; the next ``generate``/``step`` continues them.
        """
        if requests:
            self.submit(requests)
        while self.has_work():
            self.wait()
            yield from self.step()

    def poll(self, timeout: float) -> list[GenResult]:
        """Wait up to ``timeout`` s for something to do, then run one ``step``; ``[]`` if there was nothing."""
        if self.wait(timeout):
            return self.step()
        return []

    def step(self) -> list[GenResult]:
        """One step boundary plus at most one forward: returns the samples that finished in it.

        With ``overlap`` on, a step whose rows all go on is left in flight: its results are read by the next
        call, after that call has launched the step after it. Anything that changes the batch or the weights, or a
        row whose token in flight is its last, first reads the step in flight; if that finished samples, the call
        returns them and launches nothing (the next call's boundary sees what the caller did with them). A row
        that stopped on a stop token is only seen after the next step is launched: it comes back one call later.

        If loading a pending weight update fails (e.g. a publication whose bytes do not match its
        checksum), the error propagates from here and nothing else is consumed: the engine keeps serving
        the previous version and the next ``step`` carries on.
        """
        with self._step_lock:
            with self._lock:
                quiet = not (self.weights.pending or self._aborts or self._closed or self._paused) and not (
                    self._inbox and len(self._active) < self.max_batch_size)
            if self._inflight is not None and not (quiet and self._goes_on()):
                self._drain(self._ready)
                if self._ready:  # finished samples come back before the next boundary, as they would without overlap
                    finished, self._ready = self._ready, []
                    return finished
            self.weights.apply_pending(self._model, self._static)
            self._keep_warm()
            finished, self._ready = self._ready, []
            with self._lock:
                aborts, self._aborts = self._aborts, set()
                closed, paused = self._closed, self._paused
                if aborts or closed:
                    self._inbox, gone = split_aborted(self._inbox, aborts, closed)
                    finished += [self._result(s, "abort", locked=True) for s in gone]
            if self._inflight is not None and (aborts or closed or paused or not self._goes_on()):
                self._drain(finished)  # what raced in after the check above
            for row in reversed(range(len(self._active))):
                s = self._active[row]
                if closed or s.req.sample_id in aborts:
                    finished.append(self._result(s, "abort"))
                    self._remove_row(row)
            if closed or paused:
                return finished
            with self._lock:  # pop queued requests that fit the batch and the prefill-token budget
                admitted = take_admissible(self._inbox, len(self._active), self.max_batch_size,
                                           self.max_prefill_tokens)
            if self._active or admitted:
                self._forward_and_sample(admitted, finished)
            return finished

    # ----------------------------------------------------------------- internals (engine thread)

    def _runnable(self) -> bool:
        """Under ``_lock``: is there anything for ``step`` to do?"""
        if self._closed or self._aborts or self.weights.pending or self._inflight is not None:
            return True
        return not self._paused and bool(self._inbox or self._active)

    def _keep_warm(self) -> None:
        """With ``prewarm`` on: rebuild, here at the boundary, every bucket runner a weight load dropped (one that
        moved a parameter), so the steps after it build nothing."""
        st = self._static
        if self._prewarm and st is not None and not st.graphs.runners and self._runner.cache.kv is not None:
            log.info("rebuilding the decode step's bucket runners")
            st.build_all()

    def _goes_on(self) -> bool:
        """Can the next step be launched before this one's results are read? The static path (no forward AQN),
        device rows current, and no row's token in flight is its last by length (a stop token is seen later)."""
        st = self._static
        return (st is not None and not st.dirty and self.weights.swap.forward_aqn() is None
                and all(len(s.response) + 1 < s.limit for s in self._active))

    def _forward_and_sample(self, admitted: list[Seq], finished: list[GenResult]) -> None:
        assert self._runner is not None
        if self._inflight is not None:
            if not admitted and self._goes_on():
                self._step_ahead(finished)
                return
            self._drain(finished)
            if not (self._active or admitted):
                return
        aqn = self.weights.swap.forward_aqn()
        n = len(self._active) + len(admitted)
        if self._static is not None and aqn is None:
            slot = static_forward(self._static, self._runner, self._active, admitted, self._join)
            flight = InFlight(self._static, slot, n, self.weights.version)
            if self._overlap and self._goes_on():  # read during the next step, after it is launched
                self._inflight = flight
                return
            self._finish(self._record_flight(flight), finished)
            return
        if self._static is not None:
            if not self._eager_notice:
                log.info("forward AQN noise runs on the eager decode path (no static step, no CUDA graphs)")
                self._eager_notice = True
            self._static.dirty = True
        tokens, behav = eager_forward(self._runner, self._active, admitted, self._join, aqn)
        self._finish(self._record(tokens, behav, self.weights.version), finished)

    def _step_ahead(self, finished: list[GenResult]) -> None:
        """Launch the next step of the same rows, then read the one in flight; if a row stopped in it, read the
        step just launched too (the rows that went on keep its tokens) and let the finished rows leave."""
        prev = self._inflight
        assert prev is not None and self._static is not None
        slot = static_forward_ahead(self._static, self._runner, self._active)
        self._inflight = InFlight(self._static, slot, prev.rows, self.weights.version)
        done = self._record_flight(prev)
        if done:
            cur, self._inflight = self._inflight, None
            done += self._record_flight(cur, skip={row for row, _ in done})
        self._finish(done, finished)

    def _drain(self, into: list[GenResult]) -> None:
        """Read the step in flight, record its tokens, and let the rows it finished leave (results ``into``)."""
        flight, self._inflight = self._inflight, None
        if flight is not None:
            self._finish(self._record_flight(flight), into)

    def _record_flight(self, flight: InFlight, skip: set[int] | frozenset[int] = frozenset()) -> list[tuple[int, str]]:
        tokens, behav = flight.static.fetch_wait(flight.slot, flight.rows)
        return self._record(tokens, behav, flight.version, skip)

    def _record(self, tokens: list[int], behav: list[float], version: int,
                skip: set[int] | frozenset[int] = frozenset()) -> list[tuple[int, str]]:
        """Append each live row's sampled token (its log-prob, ``version``); the rows it finishes, with why."""
        now = time.monotonic()
        done: list[tuple[int, str]] = []
        for row, s in enumerate(self._active):
            if row in skip:
                continue
            reason = s.record(tokens[row], behav[row], version, now)
            if reason is not None:
                done.append((row, reason))
        return done

    def _finish(self, done: list[tuple[int, str]], finished: list[GenResult]) -> None:
        for row, reason in sorted(done, reverse=True):
            finished.append(self._result(self._active[row], reason))
            self._remove_row(row)

    def _join(self, admitted: list[Seq]) -> int:
        """Append ``admitted`` to the live rows (their cache rows start at the returned index)."""
        assert self._runner is not None
        now = time.monotonic()
        for s in admitted:
            s.t_admit = now
        row0 = len(self._active)
        self._active.extend(admitted)
        # only admission raises what a row can reach (the cache never shrinks, so a row leaving changes nothing)
        self._runner.cache.need_len = max(len(s.req.prompt_ids) + s.limit for s in self._active)
        return row0

    def _remove_row(self, row: int) -> None:
        last = len(self._active) - 1
        if row != last:
            if self._runner is not None:
                self._runner.cache.move_row(last, row, self._active[last].cache_len)
            self._active[row] = self._active[last]
        self._active.pop()
        if self._static is not None:
            self._static.dirty = True

    def _result(self, s: Seq, reason: str, *, locked: bool = False) -> GenResult:
        """Build the result and forget the id; ``locked`` says the caller already holds ``_lock``."""
        now = time.monotonic()
        if locked:
            self._discard_live(s.req.sample_id)
        else:
            with self._lock:
                self._discard_live(s.req.sample_id)
        return s.result(reason, now)

    def _discard_live(self, sample_id: str) -> None:
        self._live_ids.discard(sample_id)
        self._aborts.discard(sample_id)
