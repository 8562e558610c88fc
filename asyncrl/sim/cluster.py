"""Cluster shapes for the scale model: stage times of a 1.5B or 7B job on GPUs, from public figures.

Owns: ``ClusterShape`` (what a shape assumes, every figure named), ``cluster_params`` (its
simulator ``Params``) and ``AREAL`` (the published async/sync figures the shapes are compared with).
Never: measures anything; every number here is an input, named and sourced in ``ASSUMPTIONS`` and in
docs/benchmarks.md, so a reader can change it and rerun; ``controller_msg_s`` reads the one measured
input, a ``bench_controller.py`` result file, from the path it is given.

Stage times (one GPU per generation worker, tensor parallel 1; decode is memory-bound):

* decode step on one GPU = (weight bytes + active sequences x mean context x KV bytes per token) /
  (HBM bandwidth x ``hbm_eff``) + ``step_overhead_s``; the mean context of an active sequence is the
  prompt plus E[L^2] / (2 E[L]) (a sequence is active for L steps, so long ones are sampled more often);
* concurrent sequences per GPU (``slots``) = KV memory left after the weights / (mean context x KV
  bytes), rounded down to whole groups;
* learner: 8 N FLOPs per token (a forward for the proximal log-probs, a forward and a backward for the
  update: 2N + 6N) at ``mfu`` of the GPUs' dense BF16 peak;
* weight sync: the learner gathers and publishes the weights (``publish_bw``), every worker fetches them
  from the one publisher through its NIC (``egress_bw``, shared by all concurrent fetches: this is how
  ``WeightServer`` on learner rank 0 serves them), then loads them (``load_bw``); the engine pauses while it
  loads (an SGLang weight update);
* controller: one message costs 1 / (the controller throughput ``scripts/bench_controller.py`` measured).
"""

from __future__ import annotations

import json
import math
import random
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from asyncrl.sim.params import Params

__all__ = ["AREAL", "ASSUMPTIONS", "SHAPES", "ClusterShape", "cluster_params", "controller_msg_s", "derived",
           "lengths"]

# AReaL v0.3 (arXiv:2505.24298; the v0.3 release notes, "Table 2: End-to-end comparison between asynchronous
# AReaL and synchronous AReaL"): 1000 PPO steps, R1-Distill-Qwen base, AReaL-boba-106k math data.
AREAL = {
    "areal-1.5b": {"nodes": 16, "sync_hours": 41.0, "async_hours": 14.8},
    "areal-7b": {"nodes": 24, "sync_hours": 57.7, "async_hours": 25.4},
}


@dataclass(frozen=True)
class ClusterShape:
    """One cluster and job; every figure an input (see ``ASSUMPTIONS``)."""

    name: str
    params_b: float  # parameters, billions
    layers: int
    kv_heads: int
    head_dim: int
    gen_gpus: int
    train_gpus: int
    groups_per_step: int = 512  # prompts per step
    group_size: int = 16  # responses per prompt
    prompt_tokens: int = 512
    median_len: float = 3000.0  # response length: lognormal, clipped to [64, max_len]
    len_sigma: float = 1.0
    max_len: int = 27648
    hbm_bytes_s: float = 3.35e12  # H800/H100 SXM HBM3
    hbm_gb: float = 80.0
    peak_flops: float = 989e12  # dense BF16
    hbm_eff: float = 0.7
    mfu: float = 0.4
    step_overhead_s: float = 0.002
    weight_bytes_per_param: float = 2.0  # bf16 actor; 1.0 for an int8/fp8 actor
    publish_bw: float = 50e9
    egress_bw: float = 50e9  # one 400 Gb/s NIC
    load_bw: float = 25e9
    ctl_msg_s: float = 1 / 1400
    steps: int = 12
    seed: int = 0


SHAPES = {
    "areal-1.5b": ClusterShape("areal-1.5b", 1.78, 28, 2, 128, gen_gpus=96, train_gpus=32),
    "areal-7b": ClusterShape("areal-7b", 7.62, 28, 4, 128, gen_gpus=144, train_gpus=48),
    "7b-192gen-64train": ClusterShape("7b-192gen-64train", 7.62, 28, 4, 128, gen_gpus=192, train_gpus=64),
}

ASSUMPTIONS = [
    "architectures: Qwen2 1.5B/7B as in R1-Distill-Qwen (28 layers; 2 and 4 KV heads of dimension 128; public configs)",
    "GPUs: H800/H100 SXM, 80 GB HBM3 at 3.35 TB/s, 989 TFLOP/s dense BF16 (public datasheet); 70% of HBM bandwidth "
    "reached in decode, 40% MFU in training (assumed)",
    "AReaL split: 3/4 of the GPUs generate, 1/4 train (assumed; the 192 + 64 shape has the same ratio)",
    "batch: 512 prompts x 16 responses; prompts 512 tokens; responses lognormal (median 3000 tokens, sigma 1.0, "
    "mean ~4.8k) clipped at 27648 tokens (assumed; AReaL v0.3 states a 27K limit for its coding runs; a longer "
    "mean would make the learner alone slower than AReaL's published async step at 40% MFU)",
    "weight sync: gather+publish at 50 GB/s, one 400 Gb/s publisher NIC shared by every fetch, load at 25 GB/s; "
    "the engine pauses while it loads (assumed)",
    "controller: 1 / the samples/s that scripts/bench_controller.py measured (its result file), per message",
]


def controller_msg_s(path: Path) -> float:
    """Seconds per controller message from a ``scripts/bench_controller.py`` result file (its best worker
    count); the ``ClusterShape`` default when the file is missing or holds no controller table."""
    try:
        rows = json.loads(path.read_text())["tables"]["controller"]
        return 1.0 / max(float(r["accepted_per_s"]) for r in rows)
    except (OSError, KeyError, ValueError, TypeError):
        return ClusterShape.ctl_msg_s


def lengths(shape: ClusterShape, n: int = 4096) -> list[int]:
    """``n`` response lengths drawn from the shape's clipped lognormal (seeded by ``shape.seed``)."""
    rng = random.Random(shape.seed)
    mu = math.log(shape.median_len)
    return [int(min(shape.max_len, max(64, rng.lognormvariate(mu, shape.len_sigma)))) for _ in range(n)]


def derived(shape: ClusterShape) -> dict[str, float]:
    """The stage costs a shape implies (also printed, so the numbers behind a prediction are visible)."""
    ls = lengths(shape)
    mean_l = sum(ls) / len(ls)
    ctx = shape.prompt_tokens + sum(x * x for x in ls) / (2 * sum(ls))
    kv_per_token = 2 * shape.layers * shape.kv_heads * shape.head_dim * 2  # K and V, bf16
    weights = shape.params_b * 1e9 * shape.weight_bytes_per_param
    bw = shape.hbm_bytes_s * shape.hbm_eff
    kv_room = shape.hbm_gb * 1e9 * 0.9 - weights
    slots = max(shape.group_size, int(kv_room / (ctx * kv_per_token)) // shape.group_size * shape.group_size)
    step_a = weights / bw + shape.step_overhead_s
    step_c = ctx * kv_per_token / bw
    train_per_token = 8 * shape.params_b * 1e9 / (shape.train_gpus * shape.peak_flops * shape.mfu)
    bf16 = shape.params_b * 1e9 * 2
    return {"mean_len": mean_l, "ctx_tokens": ctx, "slots": slots, "step_a": step_a, "step_c": step_c,
            "decode_tok_s_per_gpu_full": slots / (step_a + step_c * slots),
            "train_s_per_token": train_per_token, "publish_s": bf16 / shape.publish_bw,
            "fetch_bytes": weights, "load_s": weights / shape.load_bw, "weights_GB": weights / 1e9}


def cluster_params(shape: ClusterShape, *, eta: int, **overrides: Any) -> Params:
    """``Params`` of ``shape`` at ``eta`` (the stage costs of ``derived``), with ``overrides`` applied."""
    d = derived(shape)
    p = Params(workers=shape.gen_gpus, eta=eta, groups_per_step=shape.groups_per_step, group_size=shape.group_size,
               slots=int(d["slots"]), steps=shape.steps, train_s=0.0, publish_s=d["publish_s"], other_s=0.0,
               fetch_s=d["load_s"], step_a=d["step_a"], step_c=d["step_c"],
               lengths=lengths(shape), engine="fluid", train_s_per_token=d["train_s_per_token"],
               fetch_bytes=d["fetch_bytes"], egress_bw=shape.egress_bw, pause_engine_on_load=True, cores=None,
               msg_s=0.001, result_s=0.001, ctl_msg_s=shape.ctl_msg_s, prompt_tokens=shape.prompt_tokens,
               seed=shape.seed)
    return replace(p, **overrides)
