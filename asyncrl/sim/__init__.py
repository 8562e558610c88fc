"""The scale simulator: a discrete-event model of one asyncrl job, calibrated from a real run's folder.

What it is for: predicting samples/s and the staleness histogram for worker counts, eta and cluster
shapes that cannot be run here, from stage times measured on a run that can. The model's controller is
the system's own code (``StalenessGate``, ``GroupBuffer``, ``BatchAssembler`` and the admission step
``asyncrl.controller.admission.admit_and_assign``), so admission in the model cannot drift from the
controller's; everything else (learner, workers, weight sync, CPU sharing) is a stage-time model.

Modules, lowest first (none imports one above it):

* ``kernel``: the event kernel (clock, timers, processor-sharing servers), standard library only;
* ``params``: ``Params`` (one job), ``Result``, the steady-window figures (``window_rate``);
* ``worker`` and ``model``: the job on the kernel; ``simulate(Params) -> Result``;
* ``calibrate``: ``measure`` a run folder, ``calibrate`` its stage times into ``Params``, ``pool_params``;
* ``cluster``: GPU cluster shapes from public figures (``cluster_params``);
* ``predict`` and ``extrapolate``: the tables of ``scripts/simulate_scale.py`` (the command line, which
  also runs the real validation grid).

Never: parses a command line, starts a process or a socket, or is imported by the rest of ``asyncrl``
(the system does not depend on its model; ``tests/unit/test_layout.py`` checks it). This ``__init__``
exports the model only, so importing it loads neither torch, numpy nor zmq.
"""

from asyncrl.sim.kernel import Proc, Server, Sim
from asyncrl.sim.model import simulate
from asyncrl.sim.params import Params, Result, warmup_steps, window_rate, window_staleness

__all__ = ["Params", "Proc", "Result", "Server", "Sim", "simulate", "warmup_steps", "window_rate",
           "window_staleness"]
