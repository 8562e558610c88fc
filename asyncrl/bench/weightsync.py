"""Parts of the weight-sync benchmarks that train a model for consecutive versions (bench_delta.py,
bench_buckets.py) or sync it to a worker child (bench_weightsync.py too).

Owns: the runs (full fine-tuning, LoRA) and their learning rates, the supervised steps on the task's own
questions that make each version (``Trainer``, ``task_batch``), the shared options of those benchmarks
(``sync_run_args``), the worker side in a spawned process (``WorkerChild``) and the memcpy floor of a
version's bytes (``memcpy_s``). Never: publishes or fetches weights itself (the scripts time that).
"""

from __future__ import annotations

import argparse
import random
import time
from collections.abc import Callable, Iterator
from typing import Any

from asyncrl.bench.models import load_fp32, model_folder

RUNS: dict[str, dict[str, float]] = {"full": {"lr": 2e-5, "rank": 0},
                                     "lora": {"lr": 2e-4, "rank": 16, "alpha": 32.0}}
TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def sync_run_args(p: argparse.ArgumentParser, *, runs: str, formats: str) -> None:
    """The options of the weight-sync benchmarks that train a model for consecutive versions (bench_delta.py,
    bench_buckets.py): which model, runs (full fine-tuning, LoRA), formats, how many versions, batch size."""
    p.add_argument("--model", default=None, help="smollm2 (default) or tiny (the --smoke default)")
    p.add_argument("--runs", default=runs, help="comma list of full, lora (default: %(default)s)")
    p.add_argument("--formats", default=formats, help="comma list (default: %(default)s)")
    p.add_argument("--versions", type=int, default=None, help="consecutive versions after the first "
                                                              "(default 6, quick 3, smoke 2)")
    p.add_argument("--batch", type=int, default=16, help="questions per optimiser step (default 16)")


def task_batch(name: str, n: int, seed: int) -> tuple[Any, Any]:
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

    def __init__(self, model: Any, lr: float, rank: int = 0, alpha: float = 32.0) -> None:
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

    @classmethod
    def for_run(cls, run: str, model_name: str) -> Trainer:
        """The trainer of ``run`` (a key of ``RUNS``) on the fp32 ``model_name``."""
        if run not in RUNS:
            raise SystemExit(f"unknown run {run!r}; choose from {sorted(RUNS)}")
        spec = RUNS[run]
        return cls(load_fp32(model_name), spec["lr"], int(spec["rank"]), spec.get("alpha", 32.0))

    def step(self, ids: Any, mask: Any) -> float:
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

    def versions(self, model_name: str, n_versions: int, batch: int) -> Iterator[tuple[int, float, dict]]:
        """(version, loss of the step that made it, published state dict) for versions 0 (untrained) to
        ``n_versions``, one optimiser step on ``batch`` questions (``task_batch``, seeded by the version) apart."""
        loss = 0.0
        for v in range(n_versions + 1):
            if v:
                loss = self.step(*task_batch(model_name, batch, seed=v))
            yield v, loss, self.state_dict()


class WorkerChild:
    """A weight-sync benchmark's worker side in a spawned process: ``target(conn, *args)`` receives the weight
    servers' ``addresses`` (what ``target`` expects: an (announce, fetch) pair, or one per server), answers
    ``"ready"``, then one reply per ``ask(request)`` until ``None`` ends it. A context manager: leaving it ends
    the child (terminated if it does not stop by itself)."""

    def __init__(self, target: Callable[..., None], args: tuple, addresses: Any, timeout_s: float) -> None:
        import multiprocessing as mp

        ctx = mp.get_context("spawn")
        self.conn, child = ctx.Pipe()
        self.proc = ctx.Process(target=target, args=(child, *args), daemon=True)
        self.timeout_s = timeout_s
        self.proc.start()
        self.conn.send(addresses)
        if not self.conn.poll(timeout_s) or self.conn.recv() != "ready":
            self.close()
            raise RuntimeError("the worker child did not start")

    def ask(self, request: Any) -> Any:
        """Send ``request`` and wait (up to the timeout) for the child's answer."""
        self.conn.send(request)
        if not self.conn.poll(self.timeout_s):
            raise RuntimeError(f"the worker child did not answer {request!r}")
        return self.conn.recv()

    def close(self) -> None:
        if self.proc.is_alive():
            try:
                self.conn.send(None)
            except OSError:
                pass
            self.proc.join(60)
        if self.proc.is_alive():
            self.proc.terminate()
            self.proc.join(10)

    def __enter__(self) -> WorkerChild:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


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
