"""Starting a test's FSDP2 worker program at a given world size the way torchrun would, without torchrun.

Owns: the torchrun-style environment of each rank (``RANK``, ``LOCAL_RANK``, ``WORLD_SIZE``, ``MASTER_ADDR``,
``MASTER_PORT`` on a free loopback port; none of them at world size 1, where the learner forms its one-process
group itself), and reading back the ``OUT/result.json`` that rank 0 of such a program writes.
Never: kills a process (every rank is started through the ``procs`` fixture, which ends exactly those PIDs)
or sets a variable of the test process itself.

Used by the FSDP2 tests (``test_fsdp_learner.py``, ``test_fsdp_families.py``), which are their own worker
programs: ``python THE_TEST.py OUT ...``. They clear any inherited torchrun variable with the
``no_inherited_torchrun_env`` fixture (``tests/integration/conftest.py``), so that a world-size-1 rank
never joins someone else's group.
"""

from __future__ import annotations

import json
import socket
import subprocess
from pathlib import Path
from typing import Any

TORCHRUN_VARS = ("RANK", "LOCAL_RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")


def free_port() -> int:
    """A TCP port on 127.0.0.1 that was free a moment ago (the group's rendezvous port)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def launch_ranks(procs: Any, script: str | Path, out: Path, world_size: int, *args: str) -> list[subprocess.Popen]:
    """Start ``python SCRIPT OUT *ARGS`` once per rank, one thread each, through ``procs`` (tracked by PID).

    ``out`` is created; every rank gets it as its first argument (rank 0 writes ``OUT/result.json``)."""
    out.mkdir(parents=True, exist_ok=True)
    port = free_port()
    children = []
    for rank in range(world_size):
        env = {"OMP_NUM_THREADS": "1"}
        if world_size > 1:
            env.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world_size), MASTER_ADDR="127.0.0.1",
                       MASTER_PORT=str(port))
        children.append(procs.python(str(script), str(out), *args, env=env))
    return children


def wait_ranks(children: list[subprocess.Popen], out: Path, timeout_s: float) -> dict[str, Any]:
    """Wait for every rank to exit 0 (an assertion names the PID that did not) and return rank 0's
    ``OUT/result.json``."""
    for child in children:
        assert child.wait(timeout=timeout_s) == 0, f"worker pid {child.pid} failed"
    return json.loads((out / "result.json").read_text())
