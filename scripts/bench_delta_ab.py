#!/usr/bin/env python
"""A worker's weight sync, whole and by delta, in the code of a reference commit against the working tree, side
by side in one process.

The reference commit's ``asyncrl`` package is extracted (``git archive``) into a temporary folder and imported
as ``asyncrl_ref`` (every ``asyncrl`` name in it renamed, its custom ops included), next to this tree's
``asyncrl``. Consecutive versions of SmolLM2-135M-Instruct being trained (``asyncrl.bench.weightsync.Trainer``,
the recipe's full fine-tuning or LoRA steps, as ``scripts/bench_delta.py`` makes them) are published once (this
tree's ``publish`` and ``make_delta``) and turned into received frames (writable buffers, as a zmq frame is);
four converted actors, a whole and a delta one per code, each start at version 0 and take versions 1..N, each
version whole and as a delta, the two codes interleaved and their order alternating. No transport: the times
are the worker's side only (rebuilding the publication from its frames and loading it). After every version
all four actors must hold the same bytes, compute caches included (checked).

Reported per (run, format): median [min, max] ms of each (code, whole|delta) over ``--rounds`` x N versions, and
the median of the per-version ratios new / reference.

Run: ``python scripts/bench_delta_ab.py --ref COMMIT [--runs lora,full] [--formats int8,nvfp4] [--versions 3]
[--rounds 4]`` (about 1-2 minutes per run and format on a 2-core CPU).
"""

from __future__ import annotations

import os

os.environ.setdefault("OMP_NUM_THREADS", "1")
os.environ.setdefault("MKL_NUM_THREADS", "1")

import argparse  # noqa: E402
import collections  # noqa: E402
import copy  # noqa: E402
import importlib  # noqa: E402
import io  # noqa: E402
import re  # noqa: E402
import statistics  # noqa: E402
import subprocess  # noqa: E402
import sys  # noqa: E402
import tarfile  # noqa: E402
import tempfile  # noqa: E402
import time  # noqa: E402
from pathlib import Path  # noqa: E402

REPO = Path(__file__).resolve().parent.parent


def extract_ref(ref: str, into: Path) -> str:
    """``asyncrl`` of commit ``ref`` as the package ``asyncrl_ref`` under ``into``; the commit's full hash."""
    full = subprocess.run(["git", "rev-parse", ref], cwd=REPO, check=True, capture_output=True, text=True).stdout.strip()
    blob = subprocess.run(["git", "archive", full, "asyncrl"], cwd=REPO, check=True, capture_output=True).stdout
    word = re.compile(r"\basyncrl\b")
    with tarfile.open(fileobj=io.BytesIO(blob)) as tar:
        for m in tar.getmembers():
            if not m.isfile():
                continue
            dest = into / ("asyncrl_ref" + m.name[len("asyncrl"):])
            dest.parent.mkdir(parents=True, exist_ok=True)
            data = tar.extractfile(m).read()  # type: ignore[union-attr]
            if m.name.endswith(".py"):
                data = word.sub("asyncrl_ref", data.decode()).encode()
            dest.write_bytes(data)
    return full


def run_one(run: str, fmt: str, n_versions: int, rounds: int, batch: int) -> dict:
    import torch

    from asyncrl.bench.models import load_fp32
    from asyncrl.bench.weightsync import Trainer
    from asyncrl.quant import make_delta, publish
    from asyncrl.transport.publication import delta_to_wire, to_wire

    codes = {"ref": (importlib.import_module("asyncrl_ref.quant"),
                     importlib.import_module("asyncrl_ref.transport.publication").from_wire),
             "new": (importlib.import_module("asyncrl.quant"),
                     importlib.import_module("asyncrl.transport.publication").from_wire)}
    trainer = Trainer.for_run(run, "smollm2")
    pubs = []
    for v, _, sd in trainer.versions("smollm2", n_versions, batch):
        pub = publish(sd, fmt, version=v)
        pubs.append(type(pub)(version=pub.version, fmt=pub.fmt, tensors={k: t.clone() for k, t in pub.tensors.items()},
                              manifest=pub.manifest, checksum=pub.checksum))
    deltas = [make_delta(a, b) for a, b in zip(pubs, pubs[1:], strict=False)]
    del trainer
    fp32 = load_fp32("smollm2")  # the actors' skeleton (the trainer's model carries its LoRA hooks)
    actors = {(k, how): codes[k][0].quantize_model(copy.deepcopy(fp32), fmt) for k in codes for how in ("whole", "delta")}
    del fp32

    def frames(x):
        hdr, fr = delta_to_wire(x) if hasattr(x, "parts") else to_wire(x)
        return hdr, [bytearray(f) for f in fr]

    first = frames(pubs[0])
    times: dict[tuple[str, str], list[float]] = collections.defaultdict(list)
    for r in range(rounds):
        for (k, _), m in actors.items():
            codes[k][0].load_published(m, codes[k][1](*first))
        for i in range(1, len(pubs)):
            whole, delta = frames(pubs[i]), frames(deltas[i - 1])
            pair = ("ref", "new") if (r + i) % 2 else ("new", "ref")
            for how in ("whole", "delta"):
                for k in pair:
                    q, from_wire = codes[k]
                    t0 = time.perf_counter()
                    if how == "whole":
                        q.load_published(actors[(k, how)], from_wire(*whole))
                    else:
                        q.apply_delta(actors[(k, how)], from_wire(*delta))
                    times[(k, how)].append(time.perf_counter() - t0)
            ref = {n: t for n, t in actors[("ref", "whole")].named_buffers()} | actors[("ref", "whole")].state_dict()
            for key, m in actors.items():
                got = {n: t for n, t in m.named_buffers()} | m.state_dict()
                if got.keys() != ref.keys() or not all(
                        torch.equal(ref[n].reshape(-1).view(torch.uint8), got[n].reshape(-1).view(torch.uint8))
                        for n in ref):
                    raise RuntimeError(f"{run} {fmt} v{i}: {key} differs from the reference's whole load")
    out = {"run": run, "format": fmt, "syncs": len(times[("ref", "whole")])}
    for (k, how), ts in times.items():
        out[f"{k}_{how}_ms"] = [round(statistics.median(ts) * 1e3, 1), round(min(ts) * 1e3, 1), round(max(ts) * 1e3, 1)]
    for how in ("whole", "delta"):
        out[f"new_vs_ref_{how}"] = round(statistics.median(
            n / o for n, o in zip(times[("new", how)], times[("ref", how)], strict=True)), 2)
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--ref", required=True, help="the reference commit")
    p.add_argument("--runs", default="lora,full")
    p.add_argument("--formats", default="int8,nvfp4")
    p.add_argument("--versions", type=int, default=3)
    p.add_argument("--rounds", type=int, default=4)
    p.add_argument("--batch", type=int, default=16)
    args = p.parse_args(argv)
    import torch

    torch.set_num_threads(1)
    with tempfile.TemporaryDirectory() as tmp:
        full = extract_ref(args.ref, Path(tmp))
        sys.path.insert(0, tmp)
        print(f"reference {full[:12]} against the working tree; ms median [min, max] per sync, worker side only",
              flush=True)
        for run in [r for r in args.runs.split(",") if r]:
            for fmt in [f for f in args.formats.split(",") if f]:
                row = run_one(run, fmt, args.versions, args.rounds, args.batch)
                print(row, flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
