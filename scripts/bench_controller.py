#!/usr/bin/env python
"""Controller throughput with 1, 4 and 16 generation workers on loopback: samples/s accepted and memory.

The controller is the REAL one: ``python -m workers.controller --run-dir RUN --model-dir DIR`` (the
process ``asyncrl train`` starts), with its real scoring (the task's verifier on the decoded text),
advantages, staleness gate, trajectory log (fsync every 64 records, the default) and metrics file.
Around it, synthetic peers that speak the real protocol over tcp loopback, each its own process:

* N workers: Hello -> Welcome; WorkRequest(credits) -> RolloutAssignment | NoWork (then wait
  ``retry_after_s``, as the real worker does); every assigned sample is pushed back AT ONCE as a
  FinishedSample with random token ids (``--response-tokens`` of them), so this measures the
  controller, not generation. Each worker learns new versions from the learner's weight
  announcements (a real WeightServer/WeightClient pair; nothing is fetched) and reports its version
  in a Heartbeat as soon as it changes (the controller assigns a group only to a worker whose
  reported version is at least the group's admission version), plus every ``rollout.heartbeat_s``.
* one learner: Hello(role=learner, weights_* capabilities of its WeightServer) -> Welcome; then
  BatchRequest(k) -> TrainBatch; it announces version k+1 and sends VersionUpdate(k+1) at once (no
  training), so the staleness gate keeps opening as fast as the controller can fill batches.

Measured over a window after a warm-up: samples/s accepted by the controller (its own counters
``controller/samples/accepted`` + ``controller/samples/completed``, i.e. every result recorded into
its group, from metrics.jsonl against its ``time/wall_s``), samples/s the
learner received in TrainBatches, and the controller's resident memory (VmRSS of its PID, sampled
every 0.2 s: at idle before any peer, and the peak). Key column: ``vs_1_worker`` (accepted samples/s
over the 1-worker run of the same invocation). All processes share the machine's cores: with 16
workers the synthetic workers compete with the controller for CPU, which is part of what is measured.

Run: ``python scripts/bench_controller.py [--quick|--smoke] [--workers 1,4,16] [--json PATH]``.
"""

from __future__ import annotations

import json
import multiprocessing as mp
import os
import queue
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from asyncrl.bench.models import model_folder
from asyncrl.bench.report import ROOT, parser, print_table, write_json
from asyncrl.bench.runs import exit_on_sigterm, proc_status_bytes
from asyncrl.rundir import RunDir

FMT = "int8"


# ------------------------------------------------------------------------------------ synthetic peers
def _learner(control: str, stop_after_s: float, out) -> None:
    """Synthetic learner: asks for batches, announces a new version after each, records arrivals."""
    import zmq

    import protocols as P
    from asyncrl.transport import WeightServer, ZmqChannel

    server = WeightServer("tcp://127.0.0.1:0", "tcp://127.0.0.1:0")

    def announce(v: int) -> None:
        spec = P.TensorSpec(name="bench.version", dtype="int32", shape=(1,), nbytes=4)
        server.publish(P.WeightAnnounce(version=v, fmt=FMT, manifest=[spec], checksum="", total_bytes=4),
                       [v.to_bytes(4, "little")])

    announce(0)
    ctl = ZmqChannel.connect(zmq.DEALER, control, name="bench-learner", identity=b"learner")
    ctl.send(P.Hello(protocol_version=P.PROTOCOL_VERSION, role="learner", peer_id="learner", version=0,
                     capabilities={"weights_announce": server.announce_address,
                                   "weights_fetch": server.fetch_address}))
    env = ctl.recv(60.0)
    if env is None or not isinstance(env.msg, P.Welcome):
        raise SystemExit(f"controller did not welcome the learner: {env}")
    arrivals: list[tuple[float, int]] = []
    t_end = time.monotonic() + stop_after_s
    step = 0
    while time.monotonic() < t_end:
        ctl.send(P.BatchRequest(step=step))
        batch = None
        while batch is None and time.monotonic() < t_end + 30:
            env = ctl.recv(1.0)
            if env is not None and isinstance(env.msg, P.TrainBatch):
                batch = env.msg
            elif env is not None and isinstance(env.msg, P.Error):
                raise SystemExit(f"controller refused batch {step}: {env.msg.message}")
        if batch is None:
            break
        arrivals.append((time.monotonic(), len(batch.samples)))
        step += 1
        announce(step)
        ctl.send(P.VersionUpdate(version=step, metrics={}))
    ctl.send(P.VersionUpdate(version=step, done=True))
    time.sleep(0.3)
    ctl.close()
    server.close()
    out.put({"arrivals": arrivals, "steps": step})


def _worker(control: str, worker_id: str, response_tokens: int, vocab: int, out) -> None:
    """Synthetic generation worker: real protocol, no model; returns every sample as soon as assigned."""
    import numpy as np
    import zmq

    import protocols as P
    from asyncrl.transport import ChannelTimeout, WeightClient, ZmqChannel

    rng = np.random.default_rng(abs(hash(worker_id)) % 2**32)
    ctl = ZmqChannel.connect(zmq.DEALER, control, name=worker_id, identity=worker_id.encode())
    hello = P.Hello(protocol_version=P.PROTOCOL_VERSION, role="generator", peer_id=worker_id,
                    capabilities={"engine": "synthetic", "quant_format": FMT})
    welcome = None
    while welcome is None:
        ctl.send(hello)
        env = ctl.recv(2.0)
        if env is not None and isinstance(env.msg, P.Welcome):
            welcome = env.msg
        elif env is not None and isinstance(env.msg, P.Reject):
            raise SystemExit(f"rejected: {env.msg.reason}")
        else:
            time.sleep(0.2)
    setup = welcome.worker_setup()
    slots, heartbeat_s = setup.worker_slots, setup.heartbeat_s
    push = ZmqChannel.connect(zmq.PUSH, setup.samples_address, name=f"{worker_id}-samples")
    weights = WeightClient(setup.weights_announce, setup.weights_fetch)
    version = welcome.latest_version
    sent, last_hb, next_request = 0, 0.0, 0.0

    def heartbeat() -> None:
        ctl.send(P.Heartbeat(peer_id=worker_id, time=time.time(), version=version))

    heartbeat()
    done = False
    while not done:
        ann = weights.poll_announce(0.0, fmt=FMT)
        now = time.monotonic()
        if ann is not None and ann.version > version:
            version = ann.version
            heartbeat()
            last_hb = now
            next_request = 0.0  # new weights open the gate: ask at once, as the real worker does
        elif now - last_hb >= heartbeat_s:
            heartbeat()
            last_hb = now
        if now < next_request:
            time.sleep(min(0.01, next_request - now))
            continue
        ctl.send(P.WorkRequest(worker_id=worker_id, credits=slots))
        env = ctl.recv(0.5)
        while env is not None:
            msg = env.msg
            if isinstance(msg, P.RolloutAssignment):
                n = len(msg.sample_ids)
                resp = rng.integers(3, vocab, (n, response_tokens), dtype=np.int32)
                logp = -rng.random((n, response_tokens), dtype=np.float32)
                versions = P.Array.from_numpy(np.full(response_tokens, version, np.int32))
                for i, sid in enumerate(msg.sample_ids):
                    try:
                        push.send(P.FinishedSample(
                            sample_id=sid, group_id=msg.group_id, prompt_ids=msg.prompt_ids,
                            response_ids=P.Array.from_numpy(resp[i]), behav_logp=P.Array.from_numpy(logp[i]),
                            versions=versions, finish_reason="length", worker_id=worker_id, engine="synthetic",
                            quant_format=FMT, timings={"total_s": 0.0}), timeout_s=30.0)
                        sent += 1
                    except ChannelTimeout:
                        done = True
                        break
            elif isinstance(msg, P.NoWork):
                next_request = time.monotonic() + msg.retry_after_s
            elif isinstance(msg, P.Shutdown):
                done = True
            elif isinstance(msg, P.Error) and msg.code == "not_registered":
                ctl.send(hello)
            env = ctl.recv(0.0)  # several assignments may answer one request
    ctl.send(P.Goodbye(peer_id=worker_id, reason="bench finished"))
    time.sleep(0.2)
    for ch in (ctl, push, weights):
        ch.close()
    out.put({"worker": worker_id, "sent": sent})


# ------------------------------------------------------------------------------------ one measurement
def bench_workers(n_workers: int, duration_s: float, warmup_s: float, args, model_dir: Path, tmp: Path) -> dict:
    from asyncrl.config.loader import load_train_config, save_config
    from asyncrl.metrics import read_metrics

    run_dir = tmp / f"workers-{n_workers}"
    run_dir.mkdir()
    paths = RunDir(run_dir)
    cfg = load_train_config([f"rollout.eta={args.eta}", f"rollout.num_workers={n_workers}",
                             f"rollout.max_new_tokens={args.response_tokens}", f"quant.fmt={FMT}",
                             f"runs_dir={tmp}", f"run_name={run_dir.name}"])
    save_config(cfg, paths.config)
    env = dict(os.environ, OMP_NUM_THREADS="1", MKL_NUM_THREADS="1", TOKENIZERS_PARALLELISM="false",
               HF_HUB_OFFLINE="1", PYTHONPATH=str(ROOT))
    log = open(run_dir / "controller.log", "wb")  # noqa: SIM115 - closed below
    ctrl = subprocess.Popen([sys.executable, "-m", "workers.controller", "--run-dir", str(run_dir),
                             "--model-dir", str(model_dir), "--publish-formats", FMT],
                            cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT)
    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    procs = []
    try:
        deadline = time.monotonic() + 120
        while not paths.controller_address.exists():
            if ctrl.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"controller did not start: {(run_dir / 'controller.log').read_text()[-2000:]}")
            time.sleep(0.05)
        time.sleep(0.5)
        rss_idle = proc_status_bytes(ctrl.pid, "VmRSS")
        control = json.loads(paths.controller_address.read_text())["control"]
        vocab = int(json.loads((model_dir / "config.json").read_text())["vocab_size"])
        procs.append(ctx.Process(target=_learner, args=(control, warmup_s + duration_s, out)))
        procs += [ctx.Process(target=_worker, args=(control, f"synth-{i}", args.response_tokens, vocab, out))
                  for i in range(n_workers)]
        for p in procs:
            p.start()
        rss_peak, results = rss_idle, []
        t_stop = time.monotonic() + warmup_s + duration_s + 120
        while len(results) < len(procs) and time.monotonic() < t_stop:
            rss_peak = max(rss_peak, proc_status_bytes(ctrl.pid, "VmRSS"))
            try:
                results.append(out.get(timeout=0.2))
            except queue.Empty:
                pass
        ctrl.wait(timeout=60)
    finally:
        for p in procs:
            p.join(timeout=10)
            if p.is_alive():
                p.terminate()
        if ctrl.poll() is None:
            ctrl.terminate()
            ctrl.wait(timeout=30)
        log.close()
    learner = next(r for r in results if "arrivals" in r)
    sent = sum(r["sent"] for r in results if "sent" in r)
    arrivals = learner["arrivals"]
    t0 = arrivals[0][0] + warmup_s
    win = [(t, n) for t, n in arrivals if t >= t0]
    consumed = sum(n for _, n in win[1:]) / (win[-1][0] - win[0][0]) if len(win) > 1 else float("nan")
    # a result is taken in as "accepted" or, when it completes its group, "completed" (ResultStatus.accepted)
    recs = [r for r in read_metrics(run_dir) if "controller/samples/accepted" in r and "time/wall_s" in r]
    taken = [r["controller/samples/accepted"] + r.get("controller/samples/completed", 0.0) for r in recs]
    w0 = recs[0]["time/wall_s"] + warmup_s if recs else 0.0
    idx = [i for i, r in enumerate(recs) if r["time/wall_s"] >= w0]
    i0, i1 = (idx[0], idx[-1]) if idx else (0, 0)
    span = recs[i1]["time/wall_s"] - recs[i0]["time/wall_s"] if i1 > i0 else 0.0
    accepted = (taken[i1] - taken[i0]) / span if span > 0 else float("nan")
    final = json.loads(paths.controller_final.read_text())
    return {"workers": n_workers, "accepted_per_s": accepted, "consumed_per_s": consumed,
            "learner_steps": learner["steps"], "samples_sent": sent,
            "samples_logged": final.get("samples_logged"), "rss_idle_MB": rss_idle / 2**20,
            "rss_peak_MB": rss_peak / 2**20, "window_s": span,
            "rejected": final.get("transport/samples/rejected", 0.0)}


def main(argv: list[str] | None = None) -> int:
    p = parser("bench_controller", __doc__, smoke=True)
    p.add_argument("--workers", default=None, help="comma list of worker counts (default 1,4,16; smoke 1,4)")
    p.add_argument("--seconds", type=float, default=None, help="measured window per point (default 20, quick 8, "
                                                                  "smoke 2) after a warm-up of a quarter of it")
    p.add_argument("--response-tokens", type=int, default=8, help="fake response length (default %(default)s, "
                                                                   "= rollout.max_new_tokens)")
    p.add_argument("--eta", type=int, default=4, help="staleness bound of the run (default %(default)s)")
    args = p.parse_args(argv)
    exit_on_sigterm()
    seconds = args.seconds or (2.0 if args.smoke else 8.0 if args.quick else 20.0)
    counts = [int(x) for x in (args.workers or ("1,4" if args.smoke else "1,4,16")).split(",") if x]
    model_dir = model_folder("tiny")
    rows = []
    with tempfile.TemporaryDirectory(prefix="bench_controller-") as tmp:
        for n in counts:
            row = bench_workers(n, seconds, max(1.0, seconds / 4), args, Path(model_dir), Path(tmp))
            rows.append(row)
            print(f"  {n:2d} workers: {row['accepted_per_s']:.0f} samples/s accepted, "
                  f"peak RSS {row['rss_peak_MB']:.0f} MB", flush=True)
    base = rows[0]["accepted_per_s"]
    for r in rows:
        r["vs_1_worker" if counts[0] == 1 else f"vs_{counts[0]}_workers"] = r["accepted_per_s"] / base
    key = "vs_1_worker" if counts[0] == 1 else f"vs_{counts[0]}_workers"
    print_table(
        f"real controller, synthetic workers answering at once ({args.response_tokens}-token responses, eta={args.eta}, "
        f"tcp loopback, {seconds:.0f} s window)", rows,
        ["workers", "accepted_per_s", key, "consumed_per_s", "learner_steps", "rss_idle_MB", "rss_peak_MB",
         "samples_logged", "rejected"])
    write_json(args.json, "bench_controller", {"controller": rows}, args, seconds=seconds,
               response_tokens=args.response_tokens, eta=args.eta, fmt=FMT)
    return 0


if __name__ == "__main__":
    sys.exit(main())
