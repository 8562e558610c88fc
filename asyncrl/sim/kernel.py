"""The event kernel of the scale simulator: a clock, a timer heap and processor-sharing servers.

Owns: ``Sim`` (time and timers), ``Proc`` (an operating-system process: at most one core, or a resource
such as a network link that takes none) and ``Server`` (a thread serving jobs by processor sharing).
Never: knows anything about asyncrl (``asyncrl/sim/model.py`` builds the job's model on it), reads the
wall clock, or imports outside the standard library.
Invariant: work is conserved: a job of ``w`` units on a server whose share of a core is ``s`` with ``n``
jobs finishes after ``w * cost(n) / s`` seconds while nothing changes; any change (a job arriving or
leaving, a process becoming busy or idle) reapportions the rates at that instant.
"""

from __future__ import annotations

import heapq
import itertools
from collections.abc import Callable


# ----------------------------------------------------------------------------------------- kernel
class Sim:
    """Clock, timers and processor-sharing servers. ``cores`` None: every process has its own device."""

    def __init__(self, cores: float | None) -> None:
        self.now = 0.0
        self.cores = cores
        self._heap: list[tuple[float, int, Callable[..., None], tuple]] = []
        self._seq = itertools.count()
        self.procs: list[Proc] = []

    def at(self, delay: float, fn: Callable[..., None], *args: object) -> None:
        heapq.heappush(self._heap, (self.now + max(0.0, delay), next(self._seq), fn, args))

    def run(self, stop: Callable[[], bool], max_time: float = float("inf")) -> None:
        while self._heap and not stop():
            t, _, fn, args = heapq.heappop(self._heap)
            if t > max_time:
                break
            self.now = t
            fn(*args)

    def proc(self, name: str, cpu: bool = True) -> Proc:
        """A process; ``cpu=False``: a resource of its own (a network link) that takes no core."""
        p = Proc(self, name, cpu)
        self.procs.append(p)
        return p

    def changed(self, server: Server, mutate: Callable[[], None]) -> None:
        """Apply ``mutate`` to ``server`` at ``now``, then rerate whatever its change affects."""
        busy_before = server.proc.busy
        shared = self.cores is not None
        touched = [s for p in self.procs for s in p.servers] if shared else server.proc.servers
        for s in touched:
            s.advance(self.now)
        mutate()
        if shared and busy_before != server.proc.busy:
            for s in touched:
                s.rerate()
        else:
            for s in server.proc.servers:
                s.rerate()

    def share(self, proc: Proc) -> float:
        """The fraction of a core (or device) ``proc`` gets now."""
        if self.cores is None or not proc.cpu:
            return 1.0
        busy = sum(1 for p in self.procs if p.cpu and p.busy)
        return min(1.0, self.cores / max(1, busy))


class Proc:
    """An operating-system process: at most one core, shared by its busy threads (servers)."""

    def __init__(self, sim: Sim, name: str, cpu: bool = True) -> None:
        self.sim, self.name, self.cpu = sim, name, cpu
        self.servers: list[Server] = []

    @property
    def busy(self) -> bool:
        return any(s.active for s in self.servers)

    def server(self, name: str, cost: Callable[[int], float] | None = None, *, shares_core: bool = True) -> Server:
        s = Server(self, name, cost, shares_core)
        self.servers.append(s)
        return s


class Server:
    """A thread that serves jobs by processor sharing. A job is a number of work units; with ``n`` jobs
    active each advances one unit per ``cost(n)`` seconds of a whole core (default ``cost(n) = n``: CPU
    seconds shared equally; an engine: ``a + c * n`` seconds per decode step that advances all ``n``)."""

    def __init__(self, proc: Proc, name: str, cost: Callable[[int], float] | None, shares_core: bool) -> None:
        self.proc, self.name, self.shares_core = proc, name, shares_core
        self.cost = cost or float
        self.jobs: list[tuple[float, int, Callable[[], None]]] = []  # (target virtual work, seq, on done)
        self.v = 0.0  # work units every active job has received so far
        self.t = 0.0
        self.rate = 0.0
        self.epoch = 0
        self.paused = False
        self.busy_s = 0.0
        self._seq = itertools.count()

    @property
    def active(self) -> bool:
        return bool(self.jobs) and not self.paused

    def advance(self, now: float) -> None:
        dt = now - self.t
        if dt > 0:
            self.v += self.rate * dt
            if self.active:
                self.busy_s += dt
        self.t = now

    def submit(self, work: float, done: Callable[[], None]) -> None:
        sim = self.proc.sim
        sim.changed(self, lambda: heapq.heappush(self.jobs, (self.v + max(work, 0.0), next(self._seq), done)))

    def pause(self, paused: bool) -> None:
        def flip() -> None:
            self.paused = paused
        self.proc.sim.changed(self, flip)

    def rerate(self) -> None:
        sim = self.proc.sim
        self.epoch += 1
        if not self.active:
            self.rate = 0.0
            return
        share = sim.share(self.proc)
        if self.shares_core:
            share /= sum(1 for s in self.proc.servers if s.active and s.shares_core)
        self.rate = share / self.cost(len(self.jobs))
        left = max(0.0, self.jobs[0][0] - self.v)
        sim.at(left / self.rate, self._complete, self.epoch)

    def _complete(self, epoch: int) -> None:
        if epoch != self.epoch:
            return  # rerated since this completion was scheduled
        sim = self.proc.sim
        done: list[Callable[[], None]] = []

        def pop() -> None:  # the job this event was scheduled for is due; so is any within rounding of it
            due = self.jobs[0][0] + 1e-9 * max(1.0, abs(self.jobs[0][0]))
            self.v = max(self.v, self.jobs[0][0])
            while self.jobs and self.jobs[0][0] <= due:
                done.append(heapq.heappop(self.jobs)[2])
        sim.changed(self, pop)
        for fn in done:
            fn()
