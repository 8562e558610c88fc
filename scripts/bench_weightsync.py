#!/usr/bin/env python
"""Whole weight-sync cost per policy version, stage by stage, next to a plain memory copy of the same bytes.

One version travels the path a training run uses (workers/learner/process.py -> workers/generator/process.py):

1. gather   -- ``asyncrl.learner.full_state_dict`` of an FSDP2-sharded fp32 model (world size 1,
               one-rank gloo group in this process: the learner's own code path, DTensor parameters
               and all; at world size 1 the "all-gather" is a local copy, so this is a lower bound of
               the multi-rank cost);
2. quantize -- ``asyncrl.quant.publish`` (quantize-on-send, XXH3 digest per tensor, checksum), into
               a `BufferPool` per format as the learner's publisher keeps (buffers of versions no
               longer served are reused);
3. send     -- ``WeightServer`` (this process) -> ``WeightClient.fetch`` in a child process over tcp
               loopback, timed in the child from the request to the last byte;
4. load     -- in the child: ``asyncrl.transport.publication.from_wire`` (views of the frames) and
               ``asyncrl.quant.load_published`` (verifies digests and checksum, copies into the
               ``quantize_model``-converted actor, refreshes the quantised linears).

Beside it, ``memcpy``: ``np.copyto`` of the published buffers into preallocated ones (the same
bytes, once), the floor any transport could approach on one machine. Key columns:
``total_vs_memcpy`` (whole sync time / memcpy time) and ``bytes_vs_fp32``.

Models: a seeded random Qwen2 of ~22M parameters with the proportions of Qwen2-0.5B (the one
bench_quant.py builds) and the embedded tiny char-level Qwen2 (asyncrl.models). Each stage is timed
--repeats times in rotating format order; the table shows the median of each stage and the median
of the per-repeat totals (the machine is shared). The headline ratios (int8 / fp32 total, int8 /
memcpy, nvfp4 / int8 quantize) are taken per repeat, then summarised (median, min, max, spread), next
to the load average seen during the repeats. One torch thread in both processes.

Run: ``python scripts/bench_weightsync.py [--quick|--smoke] [--formats fp32,bf16,int8,nvfp4]
[--models qwen2-22m,tiny] [--json PATH]``. ``--delta`` runs ``scripts/bench_delta.py`` instead (whole vs delta
sync on consecutive versions of SmolLM2 being trained; its own options). ``--bucket-mb MB`` runs
``scripts/bench_buckets.py`` instead (one piece vs buckets of MB MiB, whole versions and deltas, side by side on
consecutive versions of a model being trained, ``--model tiny|smollm2``; its own options).
"""

from __future__ import annotations

import os

os.environ.setdefault("OMP_NUM_THREADS", "1")
os.environ.setdefault("MKL_NUM_THREADS", "1")

import copy  # noqa: E402
import statistics  # noqa: E402
import sys  # noqa: E402
import time  # noqa: E402
from pathlib import Path  # noqa: E402

from asyncrl.bench.measure import load_average_stats, print_ratio, ratio_stats  # noqa: E402
from asyncrl.bench.models import build_qwen2_22m, load_fp32  # noqa: E402
from asyncrl.bench.report import comma_list, parser, print_table, write_json  # noqa: E402
from asyncrl.bench.runs import exit_on_sigterm  # noqa: E402
from asyncrl.bench.weightsync import WorkerChild  # noqa: E402

FORMATS = ("fp32", "bf16", "int8", "nvfp4")
# fp32 models, the same in the parent and the child (seeded, or read from disk)
MODELS = {"qwen2-22m": build_qwen2_22m, "tiny": lambda: load_fp32("tiny").eval()}
STAGES = ("gather_s", "quantize_s", "send_s", "unpack_s", "load_s")


def _worker(conn, model_name: str, formats: list[str]) -> None:
    """The child: a generation worker's side of the sync (fetch, rebuild, load), timed per version."""
    import torch

    from asyncrl.quant import load_published, quantize_model
    from asyncrl.quant.held import forget_held
    from asyncrl.transport import WeightClient
    from asyncrl.transport.publication import from_wire

    torch.set_num_threads(1)
    base = MODELS[model_name]()
    actors = {f: quantize_model(copy.deepcopy(base), f) for f in formats}
    announce_addr, fetch_addr = conn.recv()
    client = WeightClient(announce_addr, fetch_addr, identity=b"bench-worker")
    conn.send("ready")
    while True:
        req = conn.recv()
        if req is None:
            break
        version, fmt = req
        t0 = time.perf_counter()
        ann, buffers = client.fetch(version, timeout_s=120.0, fmt=fmt)
        t1 = time.perf_counter()
        pub = from_wire(ann, buffers)
        # every version here repeats the same weights: a load would skip every tensor the actor holds already
        # (asyncrl.quant.held); forget what it holds, so that each load is the full one a trained version needs
        forget_held(actors[fmt])
        t2 = time.perf_counter()
        load_published(actors[fmt], pub)
        t3 = time.perf_counter()
        conn.send({"send_s": t1 - t0, "unpack_s": t2 - t1, "load_s": t3 - t2,
                   "received_bytes": sum(memoryview(b).nbytes for b in buffers)})
    client.close()


def memcpy_seconds(buffers: list, repeats: int) -> float:
    """Best time to copy the published bytes once into preallocated buffers (np.copyto)."""
    import numpy as np

    src = [np.frombuffer(memoryview(b).cast("B"), dtype=np.uint8) for b in buffers]
    dst = [np.empty_like(a) for a in src]
    best = float("inf")
    for _ in range(max(3, repeats)):
        t0 = time.perf_counter()
        for d, a in zip(dst, src, strict=True):
            np.copyto(d, a)
        best = min(best, time.perf_counter() - t0)
    return best


def bench_model(model_name: str, formats: list[str], repeats: int) -> tuple[list[dict], list[dict]]:
    from asyncrl.learner import full_state_dict, init_distributed, shard_model
    from asyncrl.quant import BufferPool, publish
    from asyncrl.transport import WeightServer
    from asyncrl.transport.publication import to_wire

    info = init_distributed()
    base = MODELS[model_name]()
    n_params = sum(p.numel() for p in base.parameters())
    learner = shard_model(copy.deepcopy(base), info)
    del base
    server = WeightServer("tcp://127.0.0.1:0", "tcp://127.0.0.1:0", keep_versions=2)
    raw: list[dict] = []
    try:
        with WorkerChild(_worker, (model_name, formats), (server.announce_address, server.fetch_address),
                         600) as child:
            pools = {f: BufferPool() for f in formats}  # one per format, as the learner's publisher keeps
            version = 0
            for rep in range(repeats + 1):  # repeat 0 warms every path up and is not reported
                order = formats[rep % len(formats):] + formats[: rep % len(formats)]
                for fmt in order:
                    version += 1
                    t0 = time.perf_counter()
                    sd = full_state_dict(learner)
                    t1 = time.perf_counter()
                    pub = publish(sd, fmt, version=version, pool=pools[fmt])
                    t2 = time.perf_counter()
                    announce, buffers = to_wire(pub)
                    server.publish(announce, buffers)
                    t3 = time.perf_counter()
                    child_t = child.ask((version, fmt))
                    assert child_t["received_bytes"] == pub.total_bytes()
                    if rep == 0:
                        continue
                    raw.append({"model": model_name, "format": fmt, "repeat": rep, "params": n_params,
                                "bytes": pub.total_bytes(), "gather_s": t1 - t0, "quantize_s": t2 - t1,
                                "serve_s": t3 - t2, **{k: child_t[k] for k in ("send_s", "unpack_s", "load_s")},
                                "memcpy_s": memcpy_seconds(buffers, 3)})
                    del sd
                if rep:
                    raw[-1]["load_avg"] = os.getloadavg()[0]
    finally:
        server.close()
    del learner
    for r in raw:
        r["total_s"] = sum(r[k] for k in STAGES) + r["serve_s"]
    rows = []
    fp32_bytes = next((r["bytes"] for r in raw if r["format"] == "fp32"), None)
    for fmt in formats:
        rs = [r for r in raw if r["format"] == fmt]
        med = {k: statistics.median(r[k] for r in rs) for k in (*STAGES, "serve_s", "memcpy_s")}
        total = statistics.median(sum(r[k] for k in STAGES) + r["serve_s"] for r in rs)
        rows.append({"model": model_name, "params_M": n_params / 1e6, "format": fmt, "MB": rs[0]["bytes"] / 1e6,
                     "bytes_vs_fp32": rs[0]["bytes"] / fp32_bytes if fp32_bytes else float("nan"),
                     **{k: med[k] for k in STAGES}, "total_s": total, "memcpy_s": med["memcpy_s"],
                     "total_vs_memcpy": total / med["memcpy_s"], "send_vs_memcpy": med["send_s"] / med["memcpy_s"]})
    return rows, raw


def headline_ratios(raw: list[dict], models: list[str], formats: list[str]) -> dict:
    """Per-round ratios (a round = one repeat, every format synced once, in rotating order), as
    ``{(model, label): (ratio_stats, aim)}``: int8 / fp32 total, int8 total / memcpy of its bytes,
    nvfp4 / int8 quantize stage."""
    out = {}
    for m in models:
        by = {(r["format"], r["repeat"]): r for r in raw if r["model"] == m}
        reps = sorted({rep for (_, rep) in by})

        def series(fmt: str, key: str, by: dict = by, reps: list = reps) -> list[float]:
            return [by[(fmt, rep)][key] for rep in reps]

        if "int8" in formats:
            out[(m, "int8 total / fp32 total")] = (ratio_stats(series("int8", "total_s"),
                                                               series("fp32", "total_s")), "<= 0.4")
            out[(m, "int8 total / memcpy of its bytes")] = (ratio_stats(
                series("int8", "total_s"), series("int8", "memcpy_s")), "<= 20")
        if "int8" in formats and "nvfp4" in formats:
            out[(m, "nvfp4 quantize / int8 quantize")] = (ratio_stats(
                series("nvfp4", "quantize_s"), series("int8", "quantize_s")), "<= 2")
    return out


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    # --bucket-mb: one piece vs buckets, whole and delta; --delta: whole vs delta sync on consecutive versions of a
    # model being trained. Either becomes that script (same process, its own options; --delta dropped).
    instead = "bench_buckets" if any(a.split("=")[0] == "--bucket-mb" for a in argv) else "bench_delta"
    if instead == "bench_buckets" or "--delta" in argv:
        script = str(Path(__file__).with_name(f"{instead}.py"))
        os.execv(sys.executable, [sys.executable, script, *(a for a in argv if a != "--delta")])
    p = parser("bench_weightsync", __doc__, smoke=True)
    p.add_argument("--formats", default=",".join(FORMATS), help="comma list (default: %(default)s)")
    p.add_argument("--models", default=None, help=f"comma list of {', '.join(MODELS)} (default: both; --smoke: tiny)")
    p.add_argument("--repeats", type=int, default=None, help="timed repeats per format (default 7, quick 3, "
                                                                  "smoke 1)")
    args = p.parse_args(argv)
    exit_on_sigterm()
    import torch

    from asyncrl.learner import close_distributed
    from asyncrl.learner.memory import bound_malloc_retention
    from asyncrl.quant import FORMATS as ALL

    torch.set_num_threads(1)
    bound_malloc_retention()  # the learner process's allocator settings (workers/learner/process.py), where publish runs
    formats = comma_list(args.formats, "--formats", ALL)
    if "fp32" not in formats:
        formats.insert(0, "fp32")  # the bytes_vs_fp32 baseline
    models = comma_list(args.models or ("tiny" if args.smoke else ",".join(MODELS)), "--models", tuple(MODELS))
    repeats = args.repeats or (1 if args.smoke else 3 if args.quick else 7)
    rows, raw = [], []
    try:
        for m in models:
            r, x = bench_model(m, formats, repeats)
            rows += r
            raw += x
            print(f"  {m}: done ({len(x)} timed syncs)", flush=True)
    finally:
        close_distributed()
    ratios = headline_ratios(raw, models, formats)
    print_table(
        f"weight sync per version: gather (FSDP2 full state dict) + quantize + send (tcp loopback, child process) "
        f"+ load (from_wire + load_published); median of {repeats}", rows,
        ["model", "params_M", "format", "MB", "bytes_vs_fp32", *STAGES, "total_s", "memcpy_s", "total_vs_memcpy",
         "send_vs_memcpy"])
    for (m, label), (st, aim) in ratios.items():
        print_ratio(f"{m}: {label} (aim {aim})", st)
    load = load_average_stats([r["load_avg"] for r in raw if "load_avg" in r])
    print(f"load average during the rounds: {load['load_median']:.2f} (max {load['load_max']:.2f}) on "
          f"{int(load['cpus'])} cpus", flush=True)
    write_json(args.json, "bench_weightsync", {"sync": rows, "raw": raw}, args, repeats=repeats,
               formats=formats, models=models, load=load,
               ratios={f"{m}: {label}": {**st, "aim": aim} for (m, label), (st, aim) in ratios.items()})
    return 0


if __name__ == "__main__":
    sys.exit(main())
