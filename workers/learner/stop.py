"""How a learner is asked to stop, and what it says when it has.

Owns: ``StopRequest``, the event every part of a learner rank reads to stop at the next step (set by SIGTERM or
SIGINT, which it names, or by rank 0's controller link when the controller is lost), and ``stopped_line``, the
one line rank 0 logs last after a stop that a signal asked for: the version, and the checkpoint a learner
started again resumes from (docs/cluster.md, "Recovery").
Never: installs a handler itself (``workers/learner/process.py`` does, for its rank) or touches torch.
"""

from __future__ import annotations

import signal
import threading
from pathlib import Path

from asyncrl.rundir.paths import learner_checkpoint_name


class StopRequest(threading.Event):
    """Set when the learner is asked to stop (SIGTERM, SIGINT) or must stop (its controller is lost);
    ``signal_name`` names the signal that asked, if one did."""

    signal_name = ""

    def on_signal(self, signum: int, _frame=None) -> None:
        self.signal_name = self.signal_name or signal.Signals(signum).name
        self.set()


def stopped_line(signal_name: str, version: int, saved: bool, checkpoints: Path) -> str:
    """What a learner stopped by a signal says last: the version, and the checkpoint it resumes from."""
    from asyncrl.rundir.checkpoints import learner_checkpoints

    head = f"learner stopped as asked ({signal_name}) at version {version}"
    if saved:
        return (f"{head}: checkpoint {checkpoints / learner_checkpoint_name(version)}; started again, the learner "
                "resumes from it")
    newest = next(iter(learner_checkpoints(checkpoints)), None)
    return (f"{head}: no checkpoint of it (the controller did not save its state of that version); started again, "
            f"the learner resumes from {newest[1] if newest is not None else 'the start of the run'}")
