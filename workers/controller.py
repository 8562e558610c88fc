"""Controller process: ``python -m workers.controller --run-dir RUN --model-dir DIR``.

Binds the control ROUTER (workers and the learner: handshakes, work requests, batches, versions,
heartbeats) and the sample PULL socket, and drives ``asyncrl.controller.core.ControllerCore`` from one
event loop. Writes ``controller.json`` (its addresses) into the run folder as soon as it listens, so
the launcher and ``asyncrl worker`` can find it; metrics go to ``metrics.jsonl`` / TensorBoard, and each
row through the training-health watch (``health.jsonl``; a ``learner.stop_on`` alarm ends training).
Only here: argv, sockets, signals. Malformed frames are counted by the channels and the loop goes on.
"""

from __future__ import annotations

import argparse
import json
import logging
import signal
import sys
import time
from pathlib import Path

import zmq

import protocols as P
from asyncrl.config.loader import read_run_config
from asyncrl.controller.core import ControllerCore, ModelInfo
from asyncrl.controller.outbox import PeerOutbox
from asyncrl.controller.recovery import bind_first, lost_log_message, previous_ports, resume_point
from asyncrl.log import LogLostError
from asyncrl.models.prepare import model_id
from asyncrl.rundir import RunDir
from asyncrl.rundir.files import DiskFullError, atomic_write_text
from asyncrl.transport import (
    ChannelPoller,
    ZmqChannel,
    advertised,
    auth_metrics,
    check_bind_security,
    server_curve,
)
from workers.run_setup import SETUP_REQUEST, announce, setup_reply

log = logging.getLogger("asyncrl.controller")

POLL_S = 0.05
"""Longest one loop turn waits for a message before it runs the timers below (a lower bound on how
promptly a quiet controller notices a dead worker, not a throughput limit: messages wake it at once)."""
TIMERS_EVERY_S = 0.2
"""How often ``ControllerCore.poll`` runs: worker liveness (``rollout.dead_after_s``), group deadlines,
the time budget. Finer than any of those settings, coarse enough to cost nothing."""
DONE_GRACE_S = 15.0
"""After the learner's last version, how long the controller keeps serving so that workers can hand
back their groups and say Goodbye; it exits earlier once every worker has left."""
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

    from asyncrl.controller.scoring import build_scorer
    from asyncrl.metrics import MetricsWriter
    from asyncrl.metrics.health_log import HealthWatch

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
                          publish_formats=formats)
    if resume_state is not None:
        core.version.set(resume_version)
        core.load_state(resume_state)
        log.info("resumed at version %d, dataset position %d", resume_version, core.cursor)
    else:  # version 0 is a checkpoint too: a run stopped before its first learner checkpoint resumes from here
        core.save(core.checkpoint_path(0))
    atomic_write_text(paths.controller_address, json.dumps({"control": advertised(ctl.address, adv),
                                                             "samples": advertised(pull.address, adv)}))
    log.info("controller listening on %s (samples on %s)", ctl.address, pull.address)
    setup = setup_reply(run_dir, model_dir, formats)
    if args.announce:
        announce(json.loads(paths.controller_address.read_text()), run_dir)
    writer = MetricsWriter(run_dir, purge_step=resume_version + 1 if resume_state is not None else None)
    health = HealthWatch(run_dir, cfg.health, cfg.learner.stop_on,
                         resume_step=resume_version if resume_state is not None else None)
    poller = ChannelPoller([ctl, pull])
    weights_counters: dict[str, float] = {}
    outbox = PeerOutbox(ctl.send, on_drop=lambda peer: core.drop_peer(peer))  # no peer can stall the loop
    t0 = time.monotonic()
    last_poll = 0.0
    samples_at_last = 0
    t_last = t0
    try:
        while not stop["flag"]:
            ready = poller.wait(POLL_S)
            replies = []
            if pull in ready:
                for _ in range(BURST):  # drain a burst, then serve control
                    env = pull.recv(0.0)
                    if env is None:
                        break
                    if isinstance(env.msg, P.FinishedSample):
                        replies += core.on_sample(env.msg)
                    else:
                        core.counters["samples/unexpected_message"] += 1
            if ctl in ready:
                for _ in range(BURST):
                    env = ctl.recv(0.0)
                    if env is None:
                        break
                    peer = env.sender()
                    if outbox.muted(peer):  # dropped for not reading its replies: ignored, counted
                        core.counters["control/muted_peer_message"] += 1
                        continue
                    if (isinstance(env.msg, P.Hello) and env.msg.role == "client"
                            and env.msg.capabilities.get("request") == SETUP_REQUEST):
                        # `asyncrl learner`: where the run folder and the model are (before it loads anything)
                        refused = P.check_hello(env.msg)  # a peer older than the protocol floor
                        replies.append((peer, refused if refused is not None else P.Welcome(
                            protocol_version=P.PROTOCOL_VERSION, server_id="controller", run=setup)))
                        continue
                    if isinstance(env.msg, P.VersionUpdate) and peer == core.learner_peer:  # a refused learner's: not logged
                        weights_counters.update({k: v for k, v in env.msg.metrics.items()  # the weight server's counters
                                                 if k.startswith("transport/weights")})
                        now = time.monotonic()
                        m = dict(env.msg.metrics) | _flag_marks(env.msg) | core.metrics() | _transport_metrics(ctl, pull)
                        m["throughput/samples_per_s"] = (core.samples_logged - samples_at_last) / max(1e-9, now - t_last)
                        samples_at_last, t_last = core.samples_logged, now
                        m["time/wall_s"] = now - t0
                        writer.log(env.msg.version, m)
                        if (health.observe(env.msg.version, m, quarantined=core.quarantine.reasons())
                                and core.stop_reason is None):
                            core.stop_reason = health.stop_reason  # learner.stop_on: ends like time_budget_s
                    replies += core.handle(peer, env.msg)
            if time.monotonic() - last_poll > TIMERS_EVERY_S:
                replies += core.poll()
                last_poll = time.monotonic()
            if core.learner_peer is not None:
                outbox.protected.add(core.learner_peer)
            for peer, msg in replies:
                outbox.put(peer, msg)
            outbox.flush()
            core.counters.update(outbox.counters)
            outbox.counters.clear()
            if core.done and not core.workers:
                break
            if core.done and time.monotonic() - core.done_at > DONE_GRACE_S:
                break
    except DiskFullError as e:  # the log and the last checkpoint stay intact; resume once there is space
        log.error("%s", e)
        raise SystemExit(f"controller: {e}") from None
    except LogLostError as e:  # training on would log samples nowhere
        log.error("%s", lost_log_message(e, run_dir))
        raise SystemExit(f"controller: {lost_log_message(e, run_dir)}") from None
    finally:
        summary = {"max_consumed_staleness": core.max_consumed_staleness, "samples_logged": core.samples_logged,
                   **core.metrics(), **_transport_metrics(ctl, pull), **weights_counters}
        try:  # atomic: a full disk leaves the old file (or none), never an empty one
            if core.log.lost is None:  # a lost log: no end-of-run facts that count samples it does not hold
                core.log.flush()  # LogLostError if it was lost since the last flush
                atomic_write_text(paths.controller_final, json.dumps(summary, indent=2))
                core.save(paths.controller_final_checkpoint)
        except DiskFullError as e:
            log.error("%s", e)
            raise SystemExit(f"controller: {e}") from None
        except LogLostError as e:
            log.error("%s", lost_log_message(e, run_dir))
            raise SystemExit(f"controller: {lost_log_message(e, run_dir)}") from None
        finally:
            core.close()
            writer.close()
            health.close()
            ctl.close()
            pull.close()
    return 0


def _flag_marks(msg: P.VersionUpdate) -> dict[str, float]:
    """The control flags of a version update as marks in its metrics.jsonl record (``done`` marks the final
    record, which plots skip); the message itself carries them as typed fields."""
    return {name: 1.0 for name in ("checkpoint", "done") if getattr(msg, name)}


def _transport_metrics(ctl: ZmqChannel, pull: ZmqChannel) -> dict[str, float]:
    return ctl.stats.as_metrics("transport/control") | pull.stats.as_metrics("transport/samples") | auth_metrics()


if __name__ == "__main__":
    sys.exit(main())
