"""Rank 0's services around a learner step: the new version published (``Publisher``: quantize-on-send in every
published format, whole, as a delta and in buckets, with per-publication diagnostics) and the policy evaluated
(``Evaluator``: greedy accuracy on the task's held-out set).

Owns: what a publication and an evaluation cost and log (``quant/*``, ``weights/*``, ``aqn/sigma``,
``time/publish_s``; ``eval/*``). Never: trains, talks to the controller, or keeps a copy of the policy between
steps (``workers/learner/process.py`` hands each the state dict of the version and drops it).
"""

from __future__ import annotations

import time
from collections.abc import Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from asyncrl.transport import WeightServer
from asyncrl.transport.publication import to_wire
from protocols.values import QUANTIZED_FORMATS

if TYPE_CHECKING:
    from asyncrl.quant import BufferPool, PublishedWeights


class Publisher:
    """Rank 0: quantize-on-send in every published format, plus per-publication diagnostics."""

    def __init__(self, cfg, formats: list[str], server: WeightServer) -> None:
        from asyncrl.quant import BufferPool

        self.cfg, self.formats, self.server = cfg, formats, server
        self.prev: dict[str, PublishedWeights] = {}
        self.pools: dict[str, BufferPool] = {fmt: BufferPool() for fmt in formats}

    def publish(self, state_dict: Mapping[str, torch.Tensor], version: int) -> dict[str, float]:
        from asyncrl.quant import aqn_sigma, code_change_frac, make_delta, publication_seed, publish
        from asyncrl.transport.publication import delta_to_wire, publish_streamed

        q = self.cfg.quant
        sigma, seed = 0.0, None
        if q.aqn:
            sigma = aqn_sigma(version, self.cfg.learner.total_steps, q.aqn_sigma_start, q.aqn_sigma_end, q.aqn_stages)
            seed = publication_seed(self.cfg.seed, version)
        metrics = {"aqn/sigma": sigma}
        t0 = time.perf_counter()
        t = self.cfg.transport
        for fmt in self.formats:
            kwargs: dict[str, Any] = dict(
                aqn_sigma=sigma, aqn_seed=seed if sigma > 0 else None, uaq_s=q.uaq_scale if q.uaq else 1.0,
                uaq_sites=tuple(q.uaq_sites) if q.uaq else (), aqn_resample=q.aqn_resample, head=q.lm_head,
                embedding=q.embedding, pool=self.pools[fmt])
            prev = self.prev.get(fmt)
            base = prev if (t.delta and fmt in QUANTIZED_FORMATS and prev is not None and prev.version == version - 1
                            and version % t.full_every != 0) else None  # a worker that holds it fetches the delta
            if t.bucket_mb > 0:  # served in buckets while it is quantised (transport.bucket_mb)
                pub, delta = publish_streamed(self.server, state_dict, fmt, version=version, prev=base, **kwargs)
            else:
                pub = publish(state_dict, fmt, version=version, **kwargs)
                delta = None if base is None else make_delta(base, pub)
                self.server.publish(*to_wire(pub), *(delta_to_wire(delta) if delta is not None else (None, None)))
            if prev is not None:  # from the delta's sparse parts where one was made (base is prev): no second comparison
                metrics[f"quant/{fmt}/code_change_frac"] = code_change_frac(prev, pub, delta)
            if delta is not None:
                metrics[f"weights/{fmt}/delta_bytes"] = float(delta.total_bytes())
                metrics[f"weights/{fmt}/changed_frac"] = delta.changed_frac()
            if fmt in QUANTIZED_FORMATS:  # the previous codes: code_change_frac and the next version's delta
                self.prev[fmt] = pub
            metrics[f"quant/{fmt}/published_bytes"] = float(pub.total_bytes())
        metrics["time/publish_s"] = time.perf_counter() - t0
        return metrics


class Evaluator:
    """Rank 0: greedy accuracy of the full-precision policy on the task's held-out set.

    Keeps no model between evaluations: an engine is built around the given state dict (its
    tensors are used in place, not copied: at world size 1 without LoRA they are the learner's
    own parameters, read under no_grad) and dropped afterwards."""

    def __init__(self, cfg, model_dir: Path) -> None:
        from asyncrl.tasks.scoring import build_scorer

        self.scorer = build_scorer(cfg, model_dir)
        self.model_dir = model_dir

    def evaluate(self, state_dict: Mapping[str, torch.Tensor], version: int,
                 buffers: dict[str, torch.Tensor]) -> dict[str, float]:
        """``buffers``: the policy's non-parameter tensors (rotary tables), by the base model's names."""
        from transformers import AutoConfig, AutoModelForCausalLM

        from asyncrl.engine.native.engine import NativeEngine
        from asyncrl.learner.evaluate import evaluate_greedy

        config = AutoConfig.from_pretrained(self.model_dir)
        with torch.device("meta"):  # a skeleton: no memory, no initialisation
            model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
        model.load_state_dict(state_dict, strict=False, assign=True)
        for name, buf in buffers.items():
            owner, _, leaf = name.rpartition(".")
            model.get_submodule(owner).register_buffer(leaf, buf, persistent=False)
        model.tie_weights()
        missing = [n for n, t in [*model.named_parameters(), *model.named_buffers()] if t.is_meta]
        if missing:
            raise ValueError(f"evaluation weights lack {missing[:3]}; pass the full policy state dict and buffers")
        engine = NativeEngine(model.eval(), quant_format="fp32", version=version, max_batch_size=64,
                              num_threads=None)
        try:
            with torch.no_grad():
                return evaluate_greedy(engine, self.scorer, max_new_tokens=self.scorer.max_new_tokens)
        finally:
            engine.close()
