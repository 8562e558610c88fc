"""Every path of a run folder, in one place: ``RunDir(root)`` has one property or method per entry.

Layout of ``runs/<run_name>/`` (path: what writes it; what reads it):

    .lock                                launcher, controller: the live job's flock, its PID; the next job
    config.json                          launcher, ``asyncrl controller``: resolved config; every role, replay
    controller.json                      controller, once it listens: its addresses; launcher, ``--announce``
    pids.json                            launcher: the PID of each child it started; operators, tests
    logs/<process>.log                   launcher: a child's stdout/stderr (also sglang-PID.log); operators
    trajectories/                        controller: the trajectory log; resume, ``asyncrl log``, replay
    metrics.jsonl                        controller (replay: learner): a line per step; launcher, plots
    tb/                                  the same writer: TensorBoard events; TensorBoard
    health.jsonl                         controller: training-health alarms; launcher, ``asyncrl log show``
    checkpoints/                         learner, controller: what a resume starts from; resume
    checkpoints/step_NNNNNNNN/           learner: its checkpoint of version N (``.tmp`` while saved); resume
    checkpoints/latest                   learner: names the newest complete step_ folder; ``load_checkpoint``
    checkpoints/controller-NNNNNNNN.json controller: its state at version N; resume, ``asyncrl log repair``
    checkpoints/controller-final.json    controller, at exit: its last state; ``asyncrl log repair``
    model/                               learner, at the end: the final policy, a HF folder; users, benchmarks
    learner_final.json                   learner, at the end: version, weights hash, final eval; summary
    controller_final.json                controller, at exit: its counters; summary, benchmarks
    plots/                               launcher, at the end: PNG plots of metrics.jsonl; operators
    summary.json                         launcher, at the end: the run's summary; benchmarks, scripts

What is inside a learner checkpoint folder is ``asyncrl.learner.checkpoint``'s (and its checksum
manifest ``asyncrl.rundir.checkpoints``'s); the segment names of the trajectory log are ``asyncrl.log``'s.
Code that works on a checkpoints folder given on its own (``save_checkpoint(root)``, ``choose_resume_point``)
takes the names below (``LATEST``, ``learner_checkpoint_name``, ...). Standard library only.
"""

from __future__ import annotations

import dataclasses
import re
from pathlib import Path

LATEST = "latest"
"""In a checkpoints folder: the text file naming the newest complete learner checkpoint."""
LEARNER_CHECKPOINT_RE = re.compile(r"^step_(\d{8})$")
"""The name of a complete learner checkpoint folder; group 1 is its version."""
CONTROLLER_STATES_GLOB = "controller-*.json"
"""Every controller state of a checkpoints folder (``controller-final.json`` included)."""
CONTROLLER_CHECKPOINT_RE = re.compile(r"^controller-(\d{8})\.json$")
"""The name of the controller state of one version; group 1 is its version (not ``controller-final.json``)."""


def learner_checkpoint_name(version: int) -> str:
    return f"step_{version:08d}"


def controller_checkpoint_name(version: int) -> str:
    return f"controller-{version:08d}.json"


@dataclasses.dataclass(frozen=True, slots=True)
class RunDir:
    """The paths of the run folder ``root`` (nothing is created or checked here)."""

    root: Path

    @property
    def lock(self) -> Path:
        return self.root / ".lock"

    @property
    def config(self) -> Path:
        return self.root / "config.json"

    @property
    def controller_address(self) -> Path:
        return self.root / "controller.json"

    @property
    def pids(self) -> Path:
        return self.root / "pids.json"

    @property
    def logs(self) -> Path:
        return self.root / "logs"

    def log_of(self, name: str) -> Path:
        """The stdout/stderr of the child process ``name`` (controller, learner, worker-0, ...)."""
        return self.logs / f"{name}.log"

    @property
    def trajectories(self) -> Path:
        return self.root / "trajectories"

    @property
    def metrics(self) -> Path:
        return self.root / "metrics.jsonl"

    @property
    def health(self) -> Path:
        return self.root / "health.jsonl"

    @property
    def tb(self) -> Path:
        return self.root / "tb"

    @property
    def checkpoints(self) -> Path:
        return self.root / "checkpoints"

    def learner_checkpoint(self, version: int) -> Path:
        return self.checkpoints / learner_checkpoint_name(version)

    @property
    def latest(self) -> Path:
        return self.checkpoints / LATEST

    def controller_checkpoint(self, version: int) -> Path:
        return self.checkpoints / controller_checkpoint_name(version)

    @property
    def controller_final_checkpoint(self) -> Path:
        return self.checkpoints / "controller-final.json"

    @property
    def model(self) -> Path:
        """The final policy exported as a Hugging Face folder."""
        return self.root / "model"

    @property
    def learner_final(self) -> Path:
        return self.root / "learner_final.json"

    @property
    def controller_final(self) -> Path:
        return self.root / "controller_final.json"

    @property
    def plots(self) -> Path:
        return self.root / "plots"

    @property
    def summary(self) -> Path:
        return self.root / "summary.json"
