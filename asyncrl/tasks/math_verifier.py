"""Math answer checking with math-verify, safe to call from any thread.

Owns: how a reference answer and a model response are parsed and compared (``math_verify.parse``
and ``math_verify.verify``), and how that runs off the main thread.

The threading problem: math-verify bounds every parse and comparison with ``signal.alarm``
(``math_verify/utils.py::timeout``), and Python only lets the main thread install a signal
handler. Called from another thread with a timeout it raises ``ValueError("...doesn't support
threaded environment...")``; with ``parsing_timeout=None`` / ``timeout_seconds=None`` it runs
but nothing bounds it, and model output does hang it: ``verify(parse("$5$"), parse("9^9^9^9"))``
spins in sympy until killed. So this module offers three isolation modes:

- ``"inline"``: grade in the calling thread. On the main thread math-verify's own alarms bound it;
  on any other thread the alarms are switched off (no bound at all: only for trusted, short text).
  Note that math-verify's alarm also cancels any other ``SIGALRM`` timer of the process.
- ``"process"``: grade in one child process started with the ``spawn`` method (safe when the
  parent has threads, unlike ``fork``). The child runs each job on its own main thread, where the
  alarms work; the parent additionally waits at most ``6 * timeout_s + 2`` seconds (two parses and
  up to four comparisons), and if the child is stuck where no signal reaches it, terminates and
  restarts it and scores 0. Costs one process start (about a second, importing sympy) on first use
  and an IPC round trip per grade.
- ``"auto"`` (default): ``"inline"`` on the main thread, ``"process"`` elsewhere.

Must never: import math-verify or sympy at module import (they take about a second), fork, or
let one pathological response stop the controller.

Invariants: ``grade`` returns exactly 0.0 or 1.0. The reference answer is parsed as LaTeX inside
``$...$`` unless it already contains ``$`` or ``\\boxed``; the response with math-verify's default
extraction (LaTeX, ``\\boxed{}`` first, then plain expressions).
"""

from __future__ import annotations

import functools
import multiprocessing
import multiprocessing.pool
import threading
import weakref
from typing import Any, Literal, get_args

Isolation = Literal["auto", "inline", "process"]
ISOLATIONS: tuple[str, ...] = get_args(Isolation)


@functools.lru_cache(maxsize=4096)
def _parse_gold(gold: str, timeout_s: int | None) -> list[Any]:
    from math_verify import parse

    text = gold if ("$" in gold or "\\boxed" in gold) else f"${gold}$"
    return parse(text, parsing_timeout=timeout_s)


def gold_parses(gold: str, timeout_s: int | None = 5) -> bool:
    """Whether math-verify makes a mathematical object of a reference answer (when it cannot, it keeps only
    the raw string, and almost every response scores 0)."""
    return any(not isinstance(x, str) for x in _parse_gold(gold, timeout_s))


def grade_inline(gold: str, response: str, timeout_s: int | None) -> float:
    """Grade in this thread; ``timeout_s=None`` disables math-verify's alarms (any thread)."""
    from math_verify import parse, verify

    gold_parsed = _parse_gold(gold, timeout_s)
    pred = parse(response, parsing_timeout=timeout_s)
    if not gold_parsed or not pred:
        return 0.0
    return 1.0 if verify(gold_parsed, pred, timeout_seconds=timeout_s) else 0.0


def _warm_child() -> int:
    import math_verify  # noqa: F401  (pays the sympy import once, before any deadline runs)

    return multiprocessing.current_process().pid or 0


def _on_main_thread() -> bool:
    return threading.current_thread() is threading.main_thread()


class ChildProcess:
    """One ``spawn``-ed worker process that runs picklable calls on its main thread, with a hard
    deadline after which it is terminated and replaced. Thread-safe."""

    def __init__(self, start_timeout_s: float = 120.0, warm: Any = _warm_child) -> None:
        self.start_timeout_s = start_timeout_s
        self._warm = warm
        self._lock = threading.Lock()
        self._pool: multiprocessing.pool.Pool | None = None
        self._generation = 0
        self.restarts = 0
        self._finalizer: weakref.finalize | None = None

    def _ensure(self) -> tuple[multiprocessing.pool.Pool, int]:
        with self._lock:
            if self._pool is None:
                pool = multiprocessing.get_context("spawn").Pool(processes=1)
                pool.apply_async(self._warm).get(self.start_timeout_s)
                self._pool = pool
                self._finalizer = weakref.finalize(self, pool.terminate)
            return self._pool, self._generation

    def pid(self) -> int:
        pool, _ = self._ensure()
        return pool.apply(_warm_child)

    def call(self, fn: Any, args: tuple, timeout_s: float) -> Any:
        """Run ``fn(*args)`` in the child; ``TimeoutError`` (child replaced) past ``timeout_s``."""
        pool, generation = self._ensure()
        try:
            return pool.apply_async(fn, args).get(timeout_s)
        except multiprocessing.TimeoutError:
            self._restart(generation)
            raise TimeoutError(f"child process gave no answer within {timeout_s:.1f}s") from None

    def _restart(self, generation: int) -> None:
        with self._lock:
            if generation != self._generation or self._pool is None:
                return  # another thread already replaced it
            self._stop_locked()
            self._generation += 1
            self.restarts += 1

    def close(self) -> None:
        with self._lock:
            self._stop_locked()

    def _stop_locked(self) -> None:
        """Under ``_lock``: end the child process, if there is one (the next call starts a new one)."""
        if self._pool is not None:
            self._pool.terminate()
            self._pool.join()
            if self._finalizer is not None:
                self._finalizer.detach()
            self._pool = None


class MathVerifyGrader:
    """``grade(gold, response) -> 1.0 | 0.0`` with math-verify, from any thread.

    Args:
        timeout_s: math-verify's per-parse / per-comparison bound, in whole seconds.
        isolation: ``"auto"``, ``"inline"`` or ``"process"`` (module docstring).
    """

    def __init__(self, timeout_s: int = 5, isolation: Isolation = "auto") -> None:
        if isolation not in ISOLATIONS:
            raise ValueError(f"isolation must be one of {ISOLATIONS}, got {isolation!r}")
        if not isinstance(timeout_s, int) or timeout_s < 1:
            raise ValueError(f"timeout_s must be a whole number of seconds >= 1, got {timeout_s!r}")
        self.timeout_s = timeout_s
        self.isolation = isolation
        self.hard_timeout_s = 6.0 * timeout_s + 2.0
        self._child = ChildProcess()
        self.timeouts = 0

    def grade(self, gold: str, response: str) -> float:
        mode = self.isolation
        if mode == "auto":
            mode = "inline" if _on_main_thread() else "process"
        if mode == "inline":
            return grade_inline(gold, response, self.timeout_s if _on_main_thread() else None)
        try:
            return self._child.call(grade_inline, (gold, response, self.timeout_s), self.hard_timeout_s)
        except TimeoutError:
            self.timeouts += 1
            return 0.0

    def close(self) -> None:
        """Stop the child process, if one was started (it also stops at interpreter exit)."""
        self._child.close()

    def __getstate__(self) -> dict[str, Any]:
        return {"timeout_s": self.timeout_s, "isolation": self.isolation}

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__init__(**state)  # type: ignore[misc]
