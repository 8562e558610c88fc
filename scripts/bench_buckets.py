#!/usr/bin/env python
"""Bucketed weight sync against one-piece sync, whole versions and deltas, on consecutive versions of a model
being trained (``scripts/bench_weightsync.py --bucket-mb MB`` runs it).

Versions: the model trained as ``scripts/bench_delta.py`` trains it (``asyncrl.bench.weightsync.Trainer``:
real AdamW steps at the recipe's learning rate on the task's own data; ``--model tiny`` or ``smollm2``,
``--runs full,lora``). Every training version is synced four ways, each with its own chain of published
versions on one ``WeightServer`` and its own actor in a worker child process (tcp loopback), in an order
that rotates per version:

* ``piece``: ``publish``, then the worker fetches the version in one piece and loads it (``load_published``);
* ``bucket``: ``publish_streamed`` (the learner quantises tensor by tensor and serves each bucket as soon as its
  bytes are there) while the worker streams it bucket by bucket into its actor (``load_buckets``);
* ``piece_delta`` / ``bucket_delta``: the same, as a delta from the version the actor holds.

Each is timed end to end, from the learner starting to quantise to the worker's actor holding the version
(``time.monotonic``, the same clock in both processes): what overlapping quantisation, send and load buys is in
it. Beside each: the bytes sent, the most received bytes the worker held at once (one piece: the version;
bucketed: ``WeightClient.live``'s peak), the record a bucketed load keeps to undo itself (``undo``), and a
memcpy of the version's bytes. After every version the four actors must hold the same bytes (checked).

Run: ``python scripts/bench_weightsync.py --bucket-mb 64 [--model tiny|smollm2] [--formats int8] [--runs full]
[--versions N] [--quick|--smoke] [--json PATH]``.
"""

from __future__ import annotations

import os

os.environ.setdefault("OMP_NUM_THREADS", "1")
os.environ.setdefault("MKL_NUM_THREADS", "1")

import copy  # noqa: E402
import statistics  # noqa: E402
import sys  # noqa: E402
import time  # noqa: E402

from asyncrl.bench.measure import load_average_stats  # noqa: E402
from asyncrl.bench.models import load_fp32  # noqa: E402
from asyncrl.bench.report import parser, print_table, write_json  # noqa: E402
from asyncrl.bench.runs import exit_on_sigterm  # noqa: E402
from asyncrl.bench.weightsync import Trainer, WorkerChild, memcpy_s, sync_run_args  # noqa: E402

WAYS = ("piece", "bucket", "piece_delta", "bucket_delta")
ANNOUNCE_WAIT_S = 5.0


def _worker(conn, model_name: str, formats: list[str], bucket_bytes: int) -> None:
    """The worker side: one actor per (format, way), each synced by its own way."""
    import torch

    from asyncrl.quant import apply_delta, load_buckets, load_published, quantize_model
    from asyncrl.transport import WeightClient, WeightFetchError
    from asyncrl.transport.buckets import LiveBytes
    from asyncrl.transport.publication import from_wire

    torch.set_num_threads(1)
    base = load_fp32(model_name)
    actors = {(f, w): quantize_model(copy.deepcopy(base), f) for f in formats for w in WAYS}
    del base
    client = WeightClient(*conn.recv(), identity=b"bench-buckets-worker")
    conn.send("ready")
    held: dict[tuple[str, str], tuple[int, str]] = {}
    while (req := conn.recv()) is not None:
        if req == "compare":
            for f in formats:
                a = actors[(f, WAYS[0])].state_dict()
                for w in WAYS[1:]:
                    b = actors[(f, w)].state_dict()
                    if not all(torch.equal(a[k].reshape(-1).view(torch.uint8), b[k].reshape(-1).view(torch.uint8))
                               for k in a):
                        conn.send(f"{f}: the {w} actor differs from the {WAYS[0]} one")
                        break
                else:
                    continue
                break
            else:
                conn.send("same")
            continue
        way, version, fmt = req
        actor = actors[(fmt, way)]
        base_v, base_sum = held.get((fmt, way), (-1, "")) if way.endswith("delta") else (-1, "")
        if way.startswith("piece"):
            ann, frames = client.fetch(version, timeout_s=600.0, fmt=fmt, base_version=base_v, base_checksum=base_sum)
            got = from_wire(ann, frames)
            (apply_delta if base_v >= 0 else load_published)(actor, got)
            out = {"bytes": sum(memoryview(b).nbytes for b in frames), "recv_peak": 0, "undo": 0, "buckets": 1}
            live = LiveBytes()
            for b in frames:
                live.track(b)
            out["recv_peak"] = live.now
            checksum = ann.checksum
            del got, frames
        else:
            client.live.reset_peak()
            deadline = time.monotonic() + ANNOUNCE_WAIT_S
            while time.monotonic() < deadline:  # as a worker does: it fetches the version once it is announced
                ann = client.poll_announce(0.05, fmt)  # (when its publication begins)
                if ann is not None and ann.version >= version:
                    break
            while True:  # an announcement PUB dropped (a slow joiner): ask until the server has the version
                try:
                    stream = client.stream(version, timeout_s=600.0, fmt=fmt, base_version=base_v,
                                           base_checksum=base_sum, bucket_bytes=bucket_bytes)
                    break
                except WeightFetchError as e:
                    if "not served" not in str(e):
                        raise
                    time.sleep(0.001)
            with stream:
                loaded = load_buckets(actor, stream, version=version)
            out = {"bytes": loaded.stream_bytes, "recv_peak": client.live.peak, "undo": loaded.undo_bytes,
                   "buckets": loaded.buckets}
            checksum = loaded.checksum
        out["t_end"] = time.monotonic()
        held[(fmt, way)] = (version, checksum)
        conn.send(out)
    client.close()


def bench_run(run: str, model_name: str, formats: list[str], n_versions: int, batch: int,
              bucket_bytes: int) -> list[dict]:
    from asyncrl.quant import BufferPool, make_delta, publish
    from asyncrl.transport import WeightServer
    from asyncrl.transport.publication import delta_to_wire, publish_streamed, to_wire

    trainer = Trainer.for_run(run, model_name)
    server = WeightServer(keep_versions=8, bucket_bytes=bucket_bytes)
    raw: list[dict] = []
    prev: dict[tuple[str, str], object] = {}
    pools = {(f, w): BufferPool() for f in formats for w in WAYS}  # one per chain, as the learner keeps one per format
    version = 0
    try:
        with WorkerChild(_worker, (model_name, formats, bucket_bytes),
                         (server.announce_address, server.fetch_address), 1800) as child:
            for t, loss, sd in trainer.versions(model_name, n_versions, batch):
                for fmt in formats:
                    for way in WAYS[t % len(WAYS):] + WAYS[:t % len(WAYS)]:
                        version += 1
                        base = prev.get((fmt, way)) if way.endswith("delta") else None
                        t0 = time.monotonic()
                        if way.startswith("piece"):
                            pub = publish(sd, fmt, version=version, pool=pools[(fmt, way)])
                            delta = None if base is None else make_delta(base, pub)  # type: ignore[arg-type]
                            server.publish(*to_wire(pub), *(delta_to_wire(delta) if delta else (None, None)))
                            got = child.ask((way, version, fmt))
                        else:
                            child.conn.send((way, version, fmt))  # the worker asks while the learner quantises
                            pub, delta = publish_streamed(server, sd, fmt, version=version, prev=base,  # type: ignore[arg-type]
                                                          pool=pools[(fmt, way)])
                            if not child.conn.poll(child.timeout_s):
                                raise RuntimeError(f"the worker child did not sync version {version}")
                            got = child.conn.recv()
                        prev[(fmt, way)] = pub
                        if t == 0:  # every actor's first version (no delta yet): a warm-up, not reported
                            continue
                        raw.append({"run": run, "format": fmt, "way": way, "version": t, "loss": loss,
                                    "whole_bytes": pub.total_bytes(), "bytes": got["bytes"],
                                    "sync_s": got["t_end"] - t0, "recv_peak": got["recv_peak"], "undo": got["undo"],
                                    "buckets": got["buckets"], "memcpy_s": memcpy_s(pub.total_bytes()),
                                    "load_avg": os.getloadavg()[0]})
                verdict = child.ask("compare")
                if verdict != "same":
                    raise RuntimeError(f"version {t}: {verdict}")
    finally:
        server.close()
    return raw


def summarize(raw: list[dict]) -> list[dict]:
    rows = []
    for run, fmt in dict.fromkeys((r["run"], r["format"]) for r in raw):
        rs = {w: [r for r in raw if (r["run"], r["format"], r["way"]) == (run, fmt, w)] for w in WAYS}

        def med(way: str, key: str, rs: dict = rs) -> float:
            return statistics.median(r[key] for r in rs[way])

        def ratio(a: str, b: str, key: str, rs: dict = rs) -> float:
            by = {r["version"]: r[key] for r in rs[b]}
            return statistics.median(r[key] / by[r["version"]] for r in rs[a] if by.get(r["version"]))

        row = {"run": run, "format": fmt, "versions": len(rs["piece"]), "whole_MB": med("piece", "whole_bytes") / 1e6}
        for w in WAYS:
            row[f"{w}_MB"] = med(w, "bytes") / 1e6
            row[f"{w}_s"] = med(w, "sync_s")
            row[f"{w}_recv_MB"] = med(w, "recv_peak") / 1e6
        row["buckets"] = med("bucket", "buckets")
        row["bucket_undo_MB"] = med("bucket", "undo") / 1e6
        row["bucket_delta_undo_MB"] = med("bucket_delta", "undo") / 1e6
        row["bucket_vs_piece_s"] = ratio("bucket", "piece", "sync_s")
        row["bucket_delta_vs_piece_delta_s"] = ratio("bucket_delta", "piece_delta", "sync_s")
        row["bucket_delta_vs_piece_s"] = ratio("bucket_delta", "piece", "sync_s")
        row["piece_vs_memcpy"] = statistics.median(r["sync_s"] / r["memcpy_s"] for r in rs["piece"])
        row["bucket_vs_memcpy"] = statistics.median(r["sync_s"] / r["memcpy_s"] for r in rs["bucket"])
        rows.append(row)
    return rows


def main(argv: list[str] | None = None) -> int:
    p = parser("bench_buckets", __doc__, smoke=True)
    p.add_argument("--bucket-mb", type=float, required=True, help="MiB per bucket (transport.bucket_mb)")
    sync_run_args(p, runs="full", formats="int8")
    args = p.parse_args(argv)
    exit_on_sigterm()
    import torch

    torch.set_num_threads(1)
    if not args.bucket_mb > 0:
        raise SystemExit(f"--bucket-mb must be > 0, got {args.bucket_mb}")
    bucket_bytes = int(args.bucket_mb * 2**20)
    model = args.model or ("tiny" if args.smoke else "smollm2")
    n = args.versions or (2 if args.smoke else 3 if args.quick else 6)
    formats = [f for f in args.formats.split(",") if f]
    raw = []
    for run in [r for r in args.runs.split(",") if r]:
        raw += bench_run(run, model, formats, n, 4 if args.smoke else args.batch, bucket_bytes)
        print(f"  {run}: done ({n} versions x {len(formats)} formats x {len(WAYS)} ways)", flush=True)
    rows = summarize(raw)
    from asyncrl.machine import describe

    print(f"machine: {describe()}", flush=True)
    print_table(
        f"weight sync per version, {model}, buckets of {args.bucket_mb:g} MiB vs one piece, whole and delta: seconds "
        f"from quantisation start to the worker holding the version, received MB held at once (median of {n})",
        rows, ["run", "format", "whole_MB", "piece_s", "bucket_s", "bucket_vs_piece_s", "piece_recv_MB",
               "bucket_recv_MB", "buckets", "bucket_undo_MB", "piece_delta_MB", "piece_delta_s", "bucket_delta_s",
               "bucket_delta_vs_piece_delta_s", "bucket_delta_recv_MB", "bucket_delta_undo_MB",
               "bucket_delta_vs_piece_s", "piece_vs_memcpy", "bucket_vs_memcpy"])
    load = load_average_stats([r["load_avg"] for r in raw])
    print(f"load average during the versions: {load['load_median']:.2f} (max {load['load_max']:.2f}) on "
          f"{int(load['cpus'])} cpus", flush=True)
    write_json(args.json, "bench_buckets", {"buckets": rows, "raw": raw}, args, model=model, versions=n,
               formats=formats, bucket_bytes=bucket_bytes, load=load)
    return 0


if __name__ == "__main__":
    sys.exit(main())
