"""Controller process: ``python -m workers.controller --run-dir RUN --model-dir DIR``.

Binds the control ROUTER (workers and the learner: handshakes, work requests, batches, versions,
heartbeats) and the sample PULL socket, and drives ``asyncrl.controller.core.ControllerCore`` from one
event loop. Writes ``controller.json`` (its addresses) into the run folder as soon as it listens, so
the launcher and ``asyncrl worker`` can find it. Only here: argv, sockets, signals, and building what the
core is given (its scorer, the model description, the ``RunSetup`` a learner asks for, and the ``RunReport``:
``metrics.jsonl`` / TensorBoard and the training-health watch). The loop (``serve``) only moves messages
between the sockets and the core. Malformed frames are counted by the channels and the loop goes on.
"""

from __future__ import annotations

import argparse
import json
import logging
import signal
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import zmq

from asyncrl.controller.core import ControllerCore, ModelInfo
from asyncrl.controller.outbox import PeerOutbox
from asyncrl.controller.recovery import bind_first, lost_log_message, previous_ports, resume_point
from asyncrl.log import LogLostError
from asyncrl.models.prepare import model_id
from asyncrl.rundir import RunDir
from asyncrl.rundir.files import DiskFullError, atomic_write_text
from asyncrl.transport import (
    ChannelPoller,
    Envelope,
    ZmqChannel,
    advertised,
    auth_metrics,
    check_bind_security,
    server_curve,
)
from workers.run_config import read_run_config
from workers.run_setup import announce, setup_reply

log = logging.getLogger("asyncrl.controller")

POLL_S = 0.05
"""Longest one loop turn waits for a message before it runs the timers below (a lower bound on how
promptly a quiet controller notices a dead worker, not a throughput limit: messages wake it at once)."""
TIMERS_EVERY_S = 0.2
"""How often ``ControllerCore.poll`` runs: worker liveness (``rollout.dead_after_s``), group deadlines,
the time budget. Finer than any of those settings, coarse enough to cost nothing."""
MAX_MESSAGE_BYTES = 256 * 2**20
"""zmq reads a whole message before asyncrl sees it: the most a peer can make the controller hold."""
BURST = 256
"""Messages taken from one socket per loop turn before the other socket is served (fairness)."""


def model_info(cfg, model_dir: Path) -> ModelInfo:
    """What joining workers learn about the model: its ``config.json`` as saved (a native worker
    builds it with ``AutoConfig.for_model``, which fills transformers' defaults), EOS ids, id and
    folder. Read as JSON: transformers' config classes would load torch into the controller."""
    text = (Path(model_dir) / "config.json").read_text()
    eos = json.loads(text).get("eos_token_id")
    eos_ids = eos if isinstance(eos, list) else ([] if eos is None else [eos])
    return ModelInfo(config_json=text, eos_token_ids=tuple(int(t) for t in eos_ids),
                     model_id=model_id(cfg, model_dir), model_dir=str(Path(model_dir).resolve()))


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="workers/controller.py")
    ap.add_argument("--run-dir", required=True)
    ap.add_argument("--model-dir", required=True)
    ap.add_argument("--publish-formats", default="")
    ap.add_argument("--announce", action="store_true", help="print the addresses and the other roles' commands")
    ap.add_argument("--tokenizer-class", default="", help="the model folder's tokenizer class as AutoTokenizer "
                    "picks it (``asyncrl controller`` and ``asyncrl train`` pass it): loaded by name, without torch")
    args = ap.parse_args(argv)
    logging.basicConfig(level="INFO", format="%(asctime)s %(name)s %(message)s")
    run_dir, model_dir = Path(args.run_dir), Path(args.model_dir)
    paths = RunDir(run_dir)
    from asyncrl.rundir.lock import RunFolderInUse, hold_run_lock

    try:
        hold_run_lock(run_dir)  # one controller appends to a run's log (kept for the life of the process)
    except RunFolderInUse as e:
        raise SystemExit(f"controller: {e}") from None
    cfg = read_run_config(run_dir)
    host = cfg.transport.host
    curve = server_curve(cfg.transport)
    try:
        check_bind_security(f"tcp://{host}:{cfg.transport.port}", keys=curve is not None,
                            insecure=cfg.transport.insecure)
    except ValueError as e:
        raise SystemExit(str(e)) from None
    stop = {"flag": False}
    signal.signal(signal.SIGTERM, lambda *_: stop.update(flag=True))
    signal.signal(signal.SIGINT, lambda *_: stop.update(flag=True))

    from asyncrl.controller.report import RunReport
    from asyncrl.metrics import MetricsWriter
    from asyncrl.metrics.health_log import HealthWatch
    from asyncrl.tasks.scoring import build_scorer

    limit = MAX_MESSAGE_BYTES
    # resumed: the previous controller's ports first, where the learner and workers still running look for it
    old = previous_ports(paths.controller_address) if cfg.resume else (0, 0)
    ctl = bind_first(lambda a: ZmqChannel.bind(zmq.ROUTER, a, name="controller", reply_errors=True, curve=curve,
                                               max_message_bytes=limit),
                     host, [p for p in (old[0],) if p and not cfg.transport.port] + [cfg.transport.port], "control")
    pull = bind_first(lambda a: ZmqChannel.bind(zmq.PULL, a, name="samples", hwm=10_000, curve=curve,
                                                max_message_bytes=limit), host, [p for p in (old[1],) if p] + [0], "samples")
    adv = cfg.transport.advertise_host
    formats = [f for f in args.publish_formats.split(",") if f] or [cfg.quant.fmt]
    try:
        resume_state, resume_version = resume_point(run_dir, salvage=cfg.log.salvage) if cfg.resume else (None, 0)
    except ValueError as e:  # a log it cannot cut back, corrupt log/state: one line that says what to do
        raise SystemExit(f"controller: {e}") from None
    core = ControllerCore(cfg, run_dir=run_dir, scorer=build_scorer(cfg, model_dir, tokenizer_class=args.tokenizer_class),
                          model=model_info(cfg, model_dir), samples_address=advertised(pull.address, adv),
                          publish_formats=formats, setup=setup_reply(run_dir, model_dir, formats))
    if resume_state is not None:
        core.version.set(resume_version)
        core.load_state(resume_state)
        log.info("resumed at version %d, dataset position %d", resume_version, core.cursor)
    else:  # version 0 is a checkpoint too: a run stopped before its first learner checkpoint resumes from here
        core.save(core.checkpoint_path(0))
    atomic_write_text(paths.controller_address, json.dumps({"control": advertised(ctl.address, adv),
                                                             "samples": advertised(pull.address, adv)}))
    log.info("controller listening on %s (samples on %s)", ctl.address, pull.address)
    if args.announce:
        announce(json.loads(paths.controller_address.read_text()), run_dir)
    resumed = resume_version if resume_state is not None else None
    core.report = RunReport(MetricsWriter(run_dir, purge_step=None if resumed is None else resumed + 1),
                            HealthWatch(run_dir, cfg.health, cfg.learner.stop_on, resume_step=resumed),
                            transport=lambda: _transport_metrics(ctl, pull))  # its clock starts with the loop
    try:
        serve(core, ctl, pull, stop)
    except (DiskFullError, LogLostError) as e:  # a full disk leaves the log and the last checkpoint intact
        message = lost_log_message(e, run_dir) if isinstance(e, LogLostError) else str(e)
        log.error("%s", message)
        raise SystemExit(f"controller: {message}") from None
    return 0


def serve(core: ControllerCore, ctl: ZmqChannel, pull: ZmqChannel, stop: dict[str, bool]) -> None:
    """The event loop: messages from both sockets into ``core``, its replies out through a ``PeerOutbox``, its
    timers every ``TIMERS_EVERY_S``, until a signal or ``core.finished()``; then the end-of-run files
    (``core.finish``) and every socket closed."""
    poller = ChannelPoller([ctl, pull])
    outbox = PeerOutbox(ctl.send, on_drop=core.members.drop_peer)  # no peer can stall the loop
    last_poll = 0.0
    try:
        while not stop["flag"] and not core.finished():
            ready = poller.wait(POLL_S)
            replies = []
            if pull in ready:
                for env in _burst(pull):  # a burst of samples, then control
                    replies += core.on_sample(env.msg)
            if ctl in ready:
                for env in _burst(ctl):
                    if outbox.muted(env.sender()):  # dropped for not reading its replies: ignored, counted
                        core.counters["control/muted_peer_message"] += 1
                    else:
                        replies += core.handle(env.sender(), env.msg)
            if time.monotonic() - last_poll > TIMERS_EVERY_S:
                replies += core.poll()
                last_poll = time.monotonic()
            if core.members.learner_peer is not None:
                outbox.protected.add(core.members.learner_peer)
            for peer, msg in replies:
                outbox.put(peer, msg)
            outbox.flush()
            core.counters.update(outbox.counters)
            outbox.counters.clear()
    finally:
        try:
            core.finish()
        finally:
            core.close()
            ctl.close()
            pull.close()


def _burst(ch: ZmqChannel) -> Iterator[Envelope]:
    """Up to ``BURST`` messages waiting on ``ch`` (then the other socket is served)."""
    for _ in range(BURST):
        if (env := ch.recv(0.0)) is None:
            return
        yield env


def _transport_metrics(ctl: ZmqChannel, pull: ZmqChannel) -> dict[str, float]:
    return ctl.stats.as_metrics("transport/control") | pull.stats.as_metrics("transport/samples") | auth_metrics()


if __name__ == "__main__":
    sys.exit(main())
