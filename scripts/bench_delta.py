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

Reported per (run, format): changed fraction of the published elements, MB whole / delta, bytes delta /
whole, the learner's seconds to make the delta (``diff_s``, beside the publication), a worker's seconds to sync
whole / by delta (median over versions) and their ratio, and each against a memcpy of its bytes.

Run: ``python scripts/bench_delta.py [--quick|--smoke] [--runs full,lora] [--formats int8,nvfp4]
[--versions N] [--json PATH]``; ``scripts/bench_weightsync.py --delta`` runs it too.
"""

from __future__ import annotations

import os

os.environ.setdefault("OMP_NUM_THREADS", "1")
os.environ.setdefault("MKL_NUM_THREADS", "1")

import copy  # noqa: E402
import random  # noqa: E402
import statistics  # noqa: E402
import sys  # noqa: E402
import time  # noqa: E402
from pathlib import Path  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from scripts import benchlib  # noqa: E402

RUNS = {"full": {"lr": 2e-5, "rank": 0}, "lora": {"lr": 2e-4, "rank": 16, "alpha": 32.0}}
DEFAULT_FORMATS = "int8,nvfp4"  # a W8A8 and a 4-bit format, the two the delta matters most for
TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def model_folder(name: str) -> Path:
    from asyncrl.models import ensure_tiny_model
    from asyncrl.models.smollm2 import ensure_smollm2

    if name == "smollm2":
        return ensure_smollm2()
    if name == "tiny":
        return ensure_tiny_model(benchlib.ROOT / ".cache" / "models" / "tiny-qwen2-char-seed0", seed=0)
    raise ValueError(f"unknown model {name!r}; choose smollm2 or tiny")


def load(name: str):
    import torch
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(str(model_folder(name)), dtype=torch.float32)


def task_batch(name: str, n: int, seed: int):
    """Token ids [n, T] and a loss mask of ``n`` signed-sum questions with their answers."""
    import torch
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(model_folder(name)))
    rng = random.Random(seed)
    rows = []
    for _ in range(n):
        a, b, neg = rng.randint(-9, 9), rng.randint(0, 9), rng.random() < 0.5
        q = f"{a} {'-' if neg else '+'} {b} ="
        ans = str(a - b if neg else a + b)
        if getattr(tok, "chat_template", None):
            prompt = tok.apply_chat_template([{"role": "user", "content": q}], tokenize=False, add_generation_prompt=True)
        else:
            prompt = q
        p_ids, a_ids = tok(prompt)["input_ids"], tok(ans, add_special_tokens=False)["input_ids"]
        rows.append((p_ids, a_ids))
    width = max(len(p) + len(a) for p, a in rows)
    pad = tok.pad_token_id or 0
    ids = torch.full((n, width), pad, dtype=torch.long)
    mask = torch.zeros((n, width), dtype=torch.bool)
    for i, (p, a) in enumerate(rows):
        ids[i, : len(p) + len(a)] = torch.tensor(p + a)
        mask[i, len(p): len(p) + len(a)] = True
    return ids, mask


class Trainer:
    """AdamW on the whole model (``rank`` 0) or on LoRA factors of every projection, merged for publication."""

    def __init__(self, model, lr: float, rank: int = 0, alpha: float = 32.0) -> None:
        import torch

        self.model, self.rank, self.scale = model, rank, alpha / max(rank, 1)
        self.lora: dict[str, tuple] = {}
        if rank:
            for p in model.parameters():
                p.requires_grad_(False)
            g = torch.Generator().manual_seed(0)
            for name, mod in model.named_modules():
                if name.rsplit(".", 1)[-1] in TARGETS:
                    a = (torch.randn(rank, mod.in_features, generator=g) / mod.in_features ** 0.5).requires_grad_()
                    b = torch.zeros(mod.out_features, rank, requires_grad=True)
                    self.lora[name] = (mod, a, b)
                    mod.register_forward_hook(lambda m, x, y, a=a, b=b: y + (x[0] @ a.t() @ b.t()) * self.scale)
            params = [t for _, a, b in self.lora.values() for t in (a, b)]
        else:
            params = list(model.parameters())
        self.opt = torch.optim.AdamW(params, lr=lr, weight_decay=0.0)

    def step(self, ids, mask) -> float:
        import torch.nn.functional as F

        logits = self.model(input_ids=ids).logits[:, :-1]
        target, m = ids[:, 1:], mask[:, 1:]
        loss = F.cross_entropy(logits[m], target[m])
        self.opt.zero_grad(set_to_none=True)
        loss.backward()
        self.opt.step()
        return float(loss)

    def state_dict(self) -> dict:
        """What the learner publishes: the merged weights (``W + scale * B @ A`` for LoRA)."""
        import torch

        sd = {k: v.detach() for k, v in self.model.state_dict().items()}
        with torch.no_grad():
            for name, (mod, a, b) in self.lora.items():
                sd[f"{name}.weight"] = mod.weight + (b @ a) * self.scale
        return sd


def _worker(conn, model_name: str, formats: list[str]) -> None:
    """The worker side: two actors per format at the same version, one synced whole, one by deltas."""
    import torch

    from asyncrl.quant import apply_delta, load_published, quantize_model
    from asyncrl.transport import WeightClient
    from asyncrl.transport.publication import from_wire

    torch.set_num_threads(1)
    base = load(model_name)
    actors = {(f, how): quantize_model(copy.deepcopy(base), f) for f in formats for how in ("whole", "delta")}
    del base
    client = WeightClient(*conn.recv(), identity=b"bench-delta-worker")
    conn.send("ready")
    held: dict[str, tuple[int, str]] = {}
    while (req := conn.recv()) is not None:
        version, fmt, order = req
        out = {}
        for how in order:
            base_v, base_sum = held[fmt] if how == "delta" and fmt in held else (-1, "")
            t0 = time.perf_counter()
            ann, frames = client.fetch(version, timeout_s=300.0, fmt=fmt, base_version=base_v, base_checksum=base_sum)
            got = from_wire(ann, frames)
            (apply_delta if how == "delta" and base_v >= 0 else load_published)(actors[(fmt, how)], got)
            out[f"{how}_s"] = time.perf_counter() - t0
            out[f"{how}_bytes"] = sum(memoryview(b).nbytes for b in frames)
            out[f"{how}_kind"] = type(ann).__name__
        held[fmt] = (version, ann.checksum)
        a, b = actors[(fmt, "whole")].state_dict(), actors[(fmt, "delta")].state_dict()
        out["same_bytes"] = all(torch.equal(a[k].reshape(-1).view(torch.uint8), b[k].reshape(-1).view(torch.uint8))
                                for k in a)
        conn.send(out)
    client.close()


def memcpy_s(nbytes: int) -> float:
    """Best of 3 ``np.copyto`` of ``nbytes`` into a preallocated buffer."""
    import numpy as np

    src, dst = np.ones(max(1, nbytes), np.uint8), np.empty(max(1, nbytes), np.uint8)
    best = float("inf")
    for _ in range(3):
        t0 = time.perf_counter()
        np.copyto(dst, src)
        best = min(best, time.perf_counter() - t0)
    return best


def bench_run(run: str, model_name: str, formats: list[str], n_versions: int, batch: int) -> list[dict]:
    from asyncrl.quant import BufferPool
    from asyncrl.transport import WeightServer

    spec = RUNS[run]
    trainer = Trainer(load(model_name), spec["lr"], spec["rank"], spec.get("alpha", 32.0))
    server = WeightServer(keep_versions=2)
    raw: list[dict] = []
    try:
        with benchlib.WorkerChild(_worker, (model_name, formats), (server.announce_address, server.fetch_address),
                                  900) as child:
            pools = {f: BufferPool() for f in formats}
            prev: dict = {}
            loss = 0.0
            for v in range(n_versions + 1):
                if v:
                    ids, mask = task_batch(model_name, batch, seed=v)
                    loss = trainer.step(ids, mask)
                sd = trainer.state_dict()
                for fmt in formats:
                    raw += sync_version(server, child, sd, fmt, v, prev, pools[fmt], run, loss)
    finally:
        server.close()
    return raw


def sync_version(server, child, sd: dict, fmt: str, v: int, prev: dict, pool, run: str, loss: float) -> list[dict]:
    """Version ``v`` published whole and as a delta from ``prev[fmt]``, synced both ways by the child; its row."""
    from asyncrl.quant import make_delta, publish
    from asyncrl.transport.publication import delta_to_wire, to_wire

    pub = publish(sd, fmt, version=v, pool=pool)
    t0 = time.perf_counter()
    delta = make_delta(prev[fmt], pub) if v else None
    diff_s = time.perf_counter() - t0
    server.publish(*to_wire(pub), *(delta_to_wire(delta) if delta is not None else (None, None)))
    got = child.ask((v, fmt, ("whole", "delta") if v % 2 else ("delta", "whole")))
    if not got["same_bytes"]:
        raise RuntimeError(f"version {v} ({fmt}): the actor synced by deltas differs from the whole one")
    prev[fmt] = pub
    if delta is None:
        return []
    assert got["delta_kind"] == "WeightDelta" and got["delta_bytes"] == delta.total_bytes()
    return [{"run": run, "format": fmt, "version": v, "loss": loss, "changed_frac": delta.changed_frac(),
             "whole_bytes": pub.total_bytes(), "delta_bytes": delta.total_bytes(), "whole_s": got["whole_s"],
             "delta_s": got["delta_s"], "diff_s": diff_s, "whole_memcpy_s": memcpy_s(pub.total_bytes()),
             "delta_memcpy_s": memcpy_s(delta.total_bytes()), "load_avg": os.getloadavg()[0]}]


def summarize(raw: list[dict]) -> list[dict]:
    rows = []
    for run, fmt in dict.fromkeys((r["run"], r["format"]) for r in raw):
        rs = [r for r in raw if (r["run"], r["format"]) == (run, fmt)]

        def med(key: str, rs: list[dict] = rs) -> float:
            return statistics.median(r[key] for r in rs)

        rows.append({"run": run, "format": fmt, "versions": len(rs), "changed_frac": med("changed_frac"),
                     "whole_MB": med("whole_bytes") / 1e6, "delta_MB": med("delta_bytes") / 1e6,
                     "delta_vs_whole_bytes": statistics.median(r["delta_bytes"] / r["whole_bytes"] for r in rs),
                     "diff_s": med("diff_s"), "whole_s": med("whole_s"), "delta_s": med("delta_s"),
                     "delta_vs_whole_s": statistics.median(r["delta_s"] / r["whole_s"] for r in rs),
                     "whole_vs_memcpy": statistics.median(r["whole_s"] / r["whole_memcpy_s"] for r in rs),
                     "delta_vs_memcpy": statistics.median(r["delta_s"] / r["delta_memcpy_s"] for r in rs)})
    return rows


def main(argv: list[str] | None = None) -> int:
    p = benchlib.parser("bench_delta", __doc__.split("\n\n")[0], smoke=True)
    p.epilog = __doc__.split("\n\n", 1)[1]
    benchlib.sync_run_args(p, runs=",".join(RUNS), formats=DEFAULT_FORMATS)
    args = p.parse_args(argv)
    benchlib.exit_on_sigterm()
    import torch

    torch.set_num_threads(1)
    model = args.model or ("tiny" if args.smoke else "smollm2")
    n = args.versions or (2 if args.smoke else 3 if args.quick else 6)
    formats = [f for f in args.formats.split(",") if f]
    raw = []
    for run in [r for r in args.runs.split(",") if r]:
        if run not in RUNS:
            raise SystemExit(f"unknown run {run!r}; choose from {sorted(RUNS)}")
        raw += bench_run(run, model, formats, n, 4 if args.smoke else args.batch)
        print(f"  {run}: done ({n} versions x {len(formats)} formats)", flush=True)
    rows = summarize(raw)
    benchlib.print_table(f"weight sync per version, {model}: whole vs delta from the version before (median of "
                         f"{n} consecutive versions)", rows,
                         ["run", "format", "changed_frac", "whole_MB", "delta_MB", "delta_vs_whole_bytes", "diff_s",
                          "whole_s", "delta_s", "delta_vs_whole_s", "whole_vs_memcpy", "delta_vs_memcpy"])
    benchlib.write_json(args.json, "bench_delta", {"delta": rows, "raw": raw}, args, model=model, versions=n,
                        formats=formats)
    return 0


if __name__ == "__main__":
    sys.exit(main())
