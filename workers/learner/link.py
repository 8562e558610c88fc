"""Rank 0's batch sources: the link to the controller (``ControllerSource``: batches in, versions out,
checkpoints acknowledged, and rejoining) and a trajectory log replayed (``ReplaySource``, ``asyncrl replay``).

Owns: the learner's registration (a ``Hello`` naming its version and weight server), the batch request
loop, checkpoint acknowledgements, and what happens when the controller restarts under a live learner:
the learner says Hello again at its current version (when the controller answers ``not_learner``, or
while a batch request goes unanswered for ``PROBE_S``), and goes on if the controller welcomes it. If
the controller refuses it (it resumed from an older checkpoint than this learner's state) or stays
silent for ``CONTROLLER_SILENT_S``, the learner stops with ``lost`` set to one line that says what to
restart, instead of a traceback or an endless wait.
Never: trains, publishes weights or touches torch (``workers/learner/process.py``).

Invariant: the learner trains only on batches the controller logged for the step it asks for; a
duplicate of an earlier batch (a request sent again while its answer was on the way) is dropped.
"""

from __future__ import annotations

import logging
import math
import threading
import time
from pathlib import Path

import zmq

import protocols as P
from asyncrl.transport import (
    ChannelTimeout,
    WeightServer,
    ZmqChannel,
    advertised,
    client_curve,
    end_context,
    private_context,
)

log = logging.getLogger("asyncrl.learner")

# Timeouts (seconds): each bounds a wait for a peer that may be gone; a reachable peer ends it at once.
WELCOME_TIMEOUT_S = 120.0
"""How long rank 0 waits for the controller's Welcome after its Hello."""
STOP_CHECK_S = 1.0
"""While waiting for a batch, how often rank 0 checks whether it was asked to stop (SIGTERM)."""
PROBE_S = 5.0
"""A batch request unanswered this long: say Hello again (a controller that restarted never saw the
request; a live one answers with a Welcome and the learner asks again)."""
CONTROLLER_SILENT_S = 300.0
"""No message at all from the controller for this long, Hellos included: it is gone, the learner stops."""
ACK_RECV_S = 0.5
"""Longest single wait for a message while rank 0 awaits a checkpoint acknowledgement."""
CHECKPOINT_ACK_TIMEOUT_S = 60.0
"""A periodic checkpoint waits this long for the controller to save its state of the same version;
without the acknowledgement the learner skips that checkpoint (the previous one stays the resume point)."""
FINAL_ACK_TIMEOUT_S = 15.0
"""The same for the final checkpoint on the way out (the controller may already be gone)."""
FINAL_SEND_TIMEOUT_S = 2.0
"""On the way out, how long the final checkpoint request may wait to leave (a controller that is gone)."""
FLUSH_S = 5.0
"""On exit, the longest wait for the last message to the controller (the final version) to leave; it
returns as soon as it has (``end_context``)."""


class ControllerSource:
    """Rank 0's link to the controller: batches in, versions out, checkpoints acknowledged."""

    def __init__(self, address: str, server: WeightServer, version: int, stop: threading.Event, transport) -> None:
        self.stop = stop
        self.address = address
        self.lost = ""  # why this learner cannot go on with this controller (it stops, and exits with 1)
        self._ctx = private_context()  # its own, so that close() can wait until the last message left
        self.ctl = ZmqChannel.connect(zmq.DEALER, address, name="learner-ctl", identity=b"learner",
                                      curve=client_curve(transport), context=self._ctx)
        adv = transport.advertise_host
        self._weights = {"weights_announce": advertised(server.announce_address, adv),
                         "weights_fetch": advertised(server.fetch_address, adv)}
        self.ctl.send(self._hello(version))
        env = self.ctl.recv(WELCOME_TIMEOUT_S)
        if env is None:
            raise SystemExit(f"learner: no answer from a controller at {address} within {WELCOME_TIMEOUT_S:.0f} s; "
                             "start `asyncrl controller` first and pass the address it prints")
        if isinstance(env.msg, P.Reject):
            raise SystemExit(f"learner: the controller at {address} refused this learner: {env.msg.reason}")
        if not isinstance(env.msg, P.Welcome):
            raise SystemExit(f"learner: the controller at {address} did not welcome the learner: {env.msg!r}")
        if (why := P.version_refusal(env.msg.protocol_version, f"the controller at {address}")) is not None:
            raise SystemExit(f"learner: {why}")

    def _hello(self, version: int) -> P.Hello:
        return P.Hello(protocol_version=P.PROTOCOL_VERSION, role="learner", peer_id="learner", version=version,
                       capabilities=self._weights)

    def _lose(self, why: str) -> None:
        self.lost = why
        self.stop.set()  # every rank stops at this step (a collective decision in the learner's loop)

    def next_batch(self, step: int) -> P.TrainBatch | None:
        self.ctl.send(P.BatchRequest(step=step))
        heard = probed = time.monotonic()
        while not self.stop.is_set():
            env = self.ctl.recv(STOP_CHECK_S)
            now = time.monotonic()
            if env is None:
                if now - heard > CONTROLLER_SILENT_S:
                    self._lose(f"no answer from the controller at {self.address} for {CONTROLLER_SILENT_S:.0f} s; "
                               "restart it with `asyncrl controller resume=RUN_DIR`, then this learner with "
                               f"`asyncrl learner controller=ADDR` (it resumes from the run's newest checkpoint)")
                elif now - probed > PROBE_S:
                    self.ctl.send(self._hello(step))
                    probed = now
                continue
            heard, msg = now, env.msg
            if isinstance(msg, P.TrainBatch):
                if msg.step == step:
                    return msg
                if msg.step < step:  # an answer to a request sent again while the first answer was on the way
                    log.info("dropped a second copy of batch %d", msg.step)
                    continue
                raise RuntimeError(f"controller sent batch {msg.step} for request {step}")
            if isinstance(msg, P.Welcome):  # (re)registered: this controller may not have the request
                self.ctl.send(P.BatchRequest(step=step))
            elif isinstance(msg, P.Reject):
                self._lose(f"the controller at {self.address} refused this learner: {msg.reason}")
            elif isinstance(msg, P.Error) and msg.code == "not_learner":
                log.warning("the controller does not know this learner (it restarted); joining it again at "
                            "version %d", step)
                self.ctl.send(self._hello(step))
            elif isinstance(msg, P.Error):
                raise RuntimeError(f"controller refused batch {step}: {msg.message}")
            elif isinstance(msg, P.Shutdown):  # learner.time_budget_s spent: finish as at total_steps
                log.info("controller ends training before step %d: %s", step, msg.reason)
                return None
        return None

    def report(self, version: int, metrics: dict[str, float], *, checkpoint: bool = False,
               done: bool = False) -> bool:
        """Announce ``version``. With ``checkpoint``, the controller saves its state for this version
        and acknowledges; returns whether it did (the learner checkpoints only then). ``done``: training
        is finished."""
        self.ctl.send(self._update(version, finite_metrics(metrics), checkpoint=checkpoint, done=done))
        return self._await_ack(version, CHECKPOINT_ACK_TIMEOUT_S) if checkpoint else False

    def _update(self, version: int, metrics: dict[str, float], *, checkpoint: bool, done: bool) -> P.VersionUpdate:
        return P.VersionUpdate(version=version, metrics=metrics, checkpoint=checkpoint, done=done)

    def _await_ack(self, version: int, timeout_s: float) -> bool:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            env = self.ctl.recv(ACK_RECV_S)
            if (env is not None and isinstance(env.msg, P.VersionUpdate) and env.msg.version == version
                    and env.msg.checkpointed):
                return True
            if env is not None and isinstance(env.msg, P.Error) and env.msg.code == "not_learner":
                self.ctl.send(self._hello(version))  # a controller that restarted: join it again, no checkpoint now
                break
        log.warning("controller did not acknowledge the checkpoint of version %d", version)
        return False

    def sync_checkpoint(self, version: int, timeout_s: float = FINAL_ACK_TIMEOUT_S) -> bool:
        """On the way out: ask the controller to save its state for ``version``; False if it cannot."""
        if self.lost:  # a controller that refused this learner holds no state of its version
            return False
        try:
            self.ctl.send(self._update(version, {}, checkpoint=True, done=False), timeout_s=FINAL_SEND_TIMEOUT_S)
        except ChannelTimeout:
            return False
        return self._await_ack(version, timeout_s)

    def close(self) -> None:
        self.ctl.close(linger_s=FLUSH_S)
        end_context(self._ctx)  # returns once the last message (the final version) has left


def finite_metrics(metrics: dict) -> dict[str, float]:
    return {k: float(v) for k, v in metrics.items() if isinstance(v, (int, float)) and math.isfinite(float(v))}


class ReplaySource:
    """Batches from a trajectory log (``asyncrl replay``); metrics go to this run's own metrics.jsonl."""

    def __init__(self, log_dir: Path, run_dir: Path, model_id: str, stop: threading.Event,
                 salvage: bool = False, steps: int | None = None) -> None:
        from asyncrl.log.replay import load_replay_batches
        from asyncrl.metrics import MetricsWriter

        self.batches = load_replay_batches(log_dir, model_id=model_id, salvage=salvage, steps=steps)
        self.writer = MetricsWriter(run_dir)
        self.stop = stop

    def next_batch(self, step: int) -> P.TrainBatch | None:
        if self.stop.is_set() or step >= len(self.batches):
            return None
        return self.batches[step]

    def report(self, version: int, metrics: dict[str, float], *, checkpoint: bool = False,
               done: bool = False) -> bool:
        self.writer.log(version, finite_metrics(metrics) | ({"done": 1.0} if done else {}))  # done marks the final record
        return checkpoint

    def sync_checkpoint(self, version: int, timeout_s: float = FINAL_ACK_TIMEOUT_S) -> bool:
        return True

    def close(self) -> None:
        self.writer.close()
