#!/usr/bin/env python
"""Delta weight sync against whole-version sync, on consecutive versions of a model being trained.

Versions: SmolLM2-135M-Instruct (``--model smollm2``, the default; ``tiny`` for a smoke run) trained by AdamW
steps at the signed-sums recipe's learning rates (full fine-tuning 2e-5; LoRA rank 16, alpha 32, 2e-4 on every
attention and MLP projection, published merged as the learner publishes it), on a supervised loss over the
task's own questions with their answers (``-7 - 9 = -16``, through the chat template). These are real gradient
steps of the recipe's size on the task's data, not the RL loss: what matters here is how far one optimiser
step moves each weight against the quantization step.

For every version v >= 1 and format, the learner side (this process) publishes v whole and as a delta from
v - 1 (``asyncrl.quant.make_delta``) on a ``WeightServer``; a worker child process holds two converted actors
at v - 1 and, in an order that alternates per version, syncs one by fetching v whole (``load_published``)
and the other by fetching the delta (``apply_delta``), each timed from the request to the refreshed
model, over tcp loopback. Beside them, ``np.copyto`` of the same bytes (memcpy). After every version both
actors must hold the same bytes (the child checks it).

Layouts (``--layouts``): ``plain`` quantizes the decoder projections and keeps the output head and the token
embedding in full precision (the default run); ``emb`` also quantizes the head and holds the embedding as int8
row codes (``quant.lm_head=true quant.embedding=true``; with SmolLM2's tied embedding and int8 they are one
table). Under full fine-tuning the fp32 embedding is what a ``plain`` delta carries.

Reported per (run, layout, format): changed fraction of the published elements, MB whole / delta, bytes delta /
whole, the learner's seconds to make the delta (``diff_s``, beside the publication), a worker's seconds to sync
whole / by delta (median over versions) and their ratio, and each against a memcpy of its bytes.

Run: ``python scripts/bench_delta.py [--quick|--smoke] [--runs full,lora] [--formats int8,nvfp4]
[--layouts plain,emb] [--versions N] [--json PATH]``; ``scripts/bench_weightsync.py --delta`` runs it too.
"""

from __future__ import annotations

import os

os.environ.setdefault("OMP_NUM_THREADS", "1")
os.environ.setdefault("MKL_NUM_THREADS", "1")

import copy  # noqa: E402
import statistics  # noqa: E402
import sys  # noqa: E402
import time  # noqa: E402

from asyncrl.bench.models import load_fp32  # noqa: E402
from asyncrl.bench.report import parser, print_table, write_json  # noqa: E402
from asyncrl.bench.runs import exit_on_sigterm  # noqa: E402
from asyncrl.bench.weightsync import RUNS, Trainer, WorkerChild, memcpy_s, sync_run_args  # noqa: E402

DEFAULT_FORMATS = "int8,nvfp4"  # a W8A8 and a 4-bit format, the two the delta matters most for
LAYOUTS = {"plain": {}, "emb": {"head": True, "embedding": True}}
"""What is quantized besides the decoder projections: publish()'s and quantize_model()'s keywords."""


def _worker(conn, model_name: str, formats: list[str], layouts: list[str]) -> None:
    """The worker side: two actors per format at the same version, one synced whole, one by deltas."""
    import torch

    from asyncrl.quant import apply_delta, load_published, quantize_model
    from asyncrl.transport import WeightClient
    from asyncrl.transport.publication import from_wire

    torch.set_num_threads(1)
    base = load_fp32(model_name)
    actors = {(f, lay, how): quantize_model(copy.deepcopy(base), f, **LAYOUTS[lay])
              for f in formats for lay in layouts for how in ("whole", "delta")}
    del base
    clients = {lay: WeightClient(*addr, identity=f"bench-delta-{lay}".encode()) for lay, addr in conn.recv().items()}
    conn.send("ready")
    held: dict[tuple[str, str], tuple[int, str]] = {}
    while (req := conn.recv()) is not None:
        version, fmt, lay, order = req
        out = {}
        for how in order:
            base_v, base_sum = held[(fmt, lay)] if how == "delta" and (fmt, lay) in held else (-1, "")
            t0 = time.perf_counter()
            ann, frames = clients[lay].fetch(version, timeout_s=300.0, fmt=fmt, base_version=base_v,
                                             base_checksum=base_sum)
            got = from_wire(ann, frames)
            (apply_delta if how == "delta" and base_v >= 0 else load_published)(actors[(fmt, lay, how)], got)
            out[f"{how}_s"] = time.perf_counter() - t0
            out[f"{how}_bytes"] = sum(memoryview(b).nbytes for b in frames)
            out[f"{how}_kind"] = type(ann).__name__
        held[(fmt, lay)] = (version, ann.checksum)
        a, b = actors[(fmt, lay, "whole")].state_dict(), actors[(fmt, lay, "delta")].state_dict()
        out["same_bytes"] = all(torch.equal(a[k].reshape(-1).view(torch.uint8), b[k].reshape(-1).view(torch.uint8))
                                for k in a)
        conn.send(out)
    for client in clients.values():
        client.close()


def bench_run(run: str, model_name: str, formats: list[str], layouts: list[str], n_versions: int,
              batch: int) -> list[dict]:
    from asyncrl.quant import BufferPool
    from asyncrl.transport import WeightServer

    trainer = Trainer.for_run(run, model_name)
    servers = {lay: WeightServer(keep_versions=2) for lay in layouts}  # a layout's versions on a server of its own
    raw: list[dict] = []
    try:
        with WorkerChild(_worker, (model_name, formats, layouts),
                         {lay: (s.announce_address, s.fetch_address) for lay, s in servers.items()}, 900) as child:
            pools = {(f, lay): BufferPool() for f in formats for lay in layouts}
            prev: dict = {}
            for v, loss, sd in trainer.versions(model_name, n_versions, batch):
                for fmt in formats:
                    for lay in layouts:
                        raw += sync_version(servers[lay], child, sd, fmt, lay, v, prev, pools[(fmt, lay)], run, loss)
    finally:
        for server in servers.values():
            server.close()
    return raw


def sync_version(server, child, sd: dict, fmt: str, lay: str, v: int, prev: dict, pool, run: str,
                 loss: float) -> list[dict]:
    """Version ``v`` published whole and as a delta from the previous one of (``fmt``, layout ``lay``), synced
    both ways by the child; its row."""
    from asyncrl.quant import make_delta, publish
    from asyncrl.transport.publication import delta_to_wire, to_wire

    pub = publish(sd, fmt, version=v, pool=pool, **LAYOUTS[lay])
    t0 = time.perf_counter()
    delta = make_delta(prev[(fmt, lay)], pub) if v else None
    diff_s = time.perf_counter() - t0
    server.publish(*to_wire(pub), *(delta_to_wire(delta) if delta is not None else (None, None)))
    got = child.ask((v, fmt, lay, ("whole", "delta") if v % 2 else ("delta", "whole")))
    if not got["same_bytes"]:
        raise RuntimeError(f"version {v} ({fmt}, {lay}): the actor synced by deltas differs from the whole one")
    prev[(fmt, lay)] = pub
    if delta is None:
        return []
    assert got["delta_kind"] == "WeightDelta" and got["delta_bytes"] == delta.total_bytes()
    return [{"run": run, "layout": lay, "format": fmt, "version": v, "loss": loss, "changed_frac": delta.changed_frac(),
             "whole_bytes": pub.total_bytes(), "delta_bytes": delta.total_bytes(), "whole_s": got["whole_s"],
             "delta_s": got["delta_s"], "diff_s": diff_s, "whole_memcpy_s": memcpy_s(pub.total_bytes()),
             "delta_memcpy_s": memcpy_s(delta.total_bytes()), "load_avg": os.getloadavg()[0]}]


def summarize(raw: list[dict]) -> list[dict]:
    rows = []
    for run, lay, fmt in dict.fromkeys((r["run"], r["layout"], r["format"]) for r in raw):
        rs = [r for r in raw if (r["run"], r["layout"], r["format"]) == (run, lay, fmt)]

        def med(key: str, rs: list[dict] = rs) -> float:
            return statistics.median(r[key] for r in rs)

        rows.append({"run": run, "layout": lay, "format": fmt, "versions": len(rs), "changed_frac": med("changed_frac"),
                     "whole_MB": med("whole_bytes") / 1e6, "delta_MB": med("delta_bytes") / 1e6,
                     "delta_vs_whole_bytes": statistics.median(r["delta_bytes"] / r["whole_bytes"] for r in rs),
                     "diff_s": med("diff_s"), "whole_s": med("whole_s"), "delta_s": med("delta_s"),
                     "delta_vs_whole_s": statistics.median(r["delta_s"] / r["whole_s"] for r in rs),
                     "whole_vs_memcpy": statistics.median(r["whole_s"] / r["whole_memcpy_s"] for r in rs),
                     "delta_vs_memcpy": statistics.median(r["delta_s"] / r["delta_memcpy_s"] for r in rs)})
    return rows


def main(argv: list[str] | None = None) -> int:
    p = parser("bench_delta", __doc__, smoke=True)
    sync_run_args(p, runs=",".join(RUNS), formats=DEFAULT_FORMATS)
    p.add_argument("--layouts", default=",".join(LAYOUTS),
                   help="comma list of plain (projections quantized), emb (the head and the embedding too) "
                        "(default: %(default)s)")
    args = p.parse_args(argv)
    exit_on_sigterm()
    import torch

    torch.set_num_threads(1)
    model = args.model or ("tiny" if args.smoke else "smollm2")
    n = args.versions or (2 if args.smoke else 3 if args.quick else 6)
    formats = [f for f in args.formats.split(",") if f]
    layouts = [lay for lay in args.layouts.split(",") if lay]
    if bad := [lay for lay in layouts if lay not in LAYOUTS]:
        raise SystemExit(f"unknown layout(s) {bad}; choose from {list(LAYOUTS)}")
    raw = []
    for run in [r for r in args.runs.split(",") if r]:
        raw += bench_run(run, model, formats, layouts, n, 4 if args.smoke else args.batch)
        print(f"  {run}: done ({n} versions x {len(formats)} formats)", flush=True)
    rows = summarize(raw)
    print_table(f"weight sync per version, {model}: whole vs delta from the version before (median of "
                f"{n} consecutive versions)", rows,
                ["run", "layout", "format", "changed_frac", "whole_MB", "delta_MB", "delta_vs_whole_bytes", "diff_s",
                 "whole_s", "delta_s", "delta_vs_whole_s", "whole_vs_memcpy", "delta_vs_memcpy"])
    write_json(args.json, "bench_delta", {"delta": rows, "raw": raw}, args, model=model, versions=n,
               formats=formats, layouts=layouts)
    return 0


if __name__ == "__main__":
    sys.exit(main())
