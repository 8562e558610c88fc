"""Learner process (torchrun entry): ``torchrun --nproc_per_node=W workers/learner.py --run-dir RUN``.

Every rank trains the FSDP2-sharded policy; rank 0 alone talks to the controller (batches in,
versions out), serves weights (quantize-on-send, every format the run publishes) and evaluates.
One step (docs/algorithms.md §10): rank 0 asks for batch k and broadcasts it; every rank runs
``asyncrl.learner.train_step`` (prox log-probs with theta_k, minibatches with global denominators);
the new version k+1 is gathered, published, announced to the controller; every ``ckpt_every``
steps a DCP checkpoint is written (all ranks).
Only here: argv, sockets, the process loop. The math is in ``asyncrl.learner`` and ``asyncrl.algo``.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import signal
import sys
import threading
import time
from collections.abc import Mapping
from pathlib import Path
from typing import TYPE_CHECKING

import torch

import protocols as P
from asyncrl.config.loader import read_run_config
from asyncrl.learner import (
    LearnerBatch,
    LRSchedule,
    TrainState,
    build_optimizer,
    build_scheduler,
    export_hf,
    init_distributed,
    load_checkpoint,
    save_checkpoint,
    sha256_of_state_dict,
    train_step,
)
from asyncrl.learner.fsdp import broadcast_batch, close_distributed
from asyncrl.learner.memory import bound_kernel_caches, bound_malloc_retention
from asyncrl.learner.policy import (
    LoraSpec,
    base_model,
    default_num_threads,
    initial_copy,
    policy_state_dict,
    prepare_policy,
    reference_policy,
)
from asyncrl.models.prepare import model_id
from asyncrl.rundir import RunDir
from asyncrl.rundir.checkpoints import KEEP_CHECKPOINTS
from asyncrl.transport import (
    ChannelTimeout,
    WeightServer,
    check_bind_security,
    server_curve,
)
from asyncrl.transport.publication import to_wire
from workers.learner_link import FINAL_ACK_TIMEOUT_S, ControllerSource, finite_metrics

if TYPE_CHECKING:
    from asyncrl.quant import BufferPool, PublishedWeights

log = logging.getLogger("asyncrl.learner")

# Timeouts (seconds) of rank 0's link to the controller: workers/learner_link.py.
COLLECTIVE_TIMEOUT_S = 3600.0
"""torch.distributed timeout: how long ranks wait for rank 0 in a collective (rank 0 may be waiting for a
batch, evaluating, or exporting)."""


def batch_from_message(msg: P.TrainBatch, temperature: float, pad_id: int) -> LearnerBatch:
    s = msg.samples
    return LearnerBatch.from_samples(
        [x.prompt_ids.to_numpy().tolist() for x in s], [x.response_ids.to_numpy().tolist() for x in s],
        [x.behav_logp.to_numpy() for x in s], [x.versions.to_numpy() for x in s], [x.advantage for x in s],
        temperature=temperature, pad_id=pad_id)


class Publisher:
    """Rank 0: quantize-on-send in every published format, plus per-publication diagnostics."""

    def __init__(self, cfg, formats: list[str], server: WeightServer) -> None:
        from asyncrl.quant import BufferPool

        self.cfg, self.formats, self.server = cfg, formats, server
        self.prev: dict[str, PublishedWeights] = {}
        self.pools: dict[str, BufferPool] = {fmt: BufferPool() for fmt in formats}

    def publish(self, state_dict: Mapping[str, torch.Tensor], version: int) -> dict[str, float]:
        from asyncrl.quant import aqn_sigma, code_change_frac, publication_seed, publish

        q = self.cfg.quant
        sigma, seed = 0.0, None
        if q.aqn:
            sigma = aqn_sigma(version, self.cfg.learner.total_steps, q.aqn_sigma_start, q.aqn_sigma_end, q.aqn_stages)
            seed = publication_seed(self.cfg.seed, version)
        metrics = {"aqn/sigma": sigma}
        t0 = time.perf_counter()
        for fmt in self.formats:
            pub = publish(state_dict, fmt, version=version, aqn_sigma=sigma, aqn_seed=seed if sigma > 0 else None,
                          uaq_s=q.uaq_scale if q.uaq else 1.0, uaq_sites=tuple(q.uaq_sites) if q.uaq else (),
                          aqn_resample=q.aqn_resample, head=q.lm_head, pool=self.pools[fmt])
            if fmt in self.prev:
                metrics[f"quant/{fmt}/code_change_frac"] = code_change_frac(self.prev[fmt], pub)
            if fmt not in ("fp32", "bf16"):  # the previous codes, for code_change_frac; no full-precision copy
                self.prev[fmt] = pub
            announce, buffers = to_wire(pub)
            self.server.publish(announce, buffers)
            metrics[f"quant/{fmt}/published_bytes"] = float(pub.total_bytes())
        metrics["time/publish_s"] = time.perf_counter() - t0
        return metrics


class Evaluator:
    """Rank 0: greedy accuracy of the full-precision policy on the task's held-out set.

    Keeps no model between evaluations: an engine is built around the given state dict (its
    tensors are used in place, not copied: at world size 1 without LoRA they are the learner's
    own parameters, read under no_grad) and dropped afterwards."""

    def __init__(self, cfg, model_dir: Path) -> None:
        from asyncrl.controller.scoring import build_scorer

        self.scorer = build_scorer(cfg, model_dir)
        self.model_dir = model_dir

    def evaluate(self, state_dict: Mapping[str, torch.Tensor], version: int,
                 buffers: dict[str, torch.Tensor]) -> dict[str, float]:
        """``buffers``: the policy's non-parameter tensors (rotary tables), by the base model's names."""
        from transformers import AutoConfig, AutoModelForCausalLM

        from asyncrl.controller.scoring import evaluate_greedy
        from asyncrl.engine.native import NativeEngine

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


class ReplaySource:
    """Batches from a trajectory log (``asyncrl replay``); metrics go to this run's own metrics.jsonl."""

    def __init__(self, log_dir: Path, run_dir: Path, model_id: str, stop: threading.Event,
                 salvage: bool = False) -> None:
        from asyncrl.log.replay import load_replay_batches
        from asyncrl.metrics import MetricsWriter

        self.batches = load_replay_batches(log_dir, model_id=model_id, salvage=salvage)
        self.writer = MetricsWriter(run_dir)
        self.stop = stop

    def next_batch(self, step: int) -> P.TrainBatch | None:
        if self.stop.is_set() or step >= len(self.batches):
            return None
        return self.batches[step]

    def report(self, version: int, metrics: dict[str, float], *, checkpoint: bool = False,
               done: bool = False) -> bool:
        self.writer.log(version, finite_metrics(metrics) | ({"done": 1.0} if done else {}))  # done marks the final record
        return checkpoint

    def sync_checkpoint(self, version: int, timeout_s: float = FINAL_ACK_TIMEOUT_S) -> bool:
        return True

    def close(self) -> None:
        self.writer.close()


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="workers/learner.py")
    ap.add_argument("--run-dir", required=True)
    ap.add_argument("--model-dir", required=True)
    ap.add_argument("--controller", default="", help="controller address (training)")
    ap.add_argument("--replay-log", default="", help="a trajectory log to replay instead of a controller")
    ap.add_argument("--publish-formats", default="")
    args = ap.parse_args(argv)
    if "TORCHELASTIC_RUN_ID" in os.environ:  # a rank under torchrun: never outlive a killed agent
        from workers.proc import die_with_parent

        die_with_parent()
    logging.basicConfig(level="INFO", format="%(asctime)s %(name)s %(message)s")
    run_dir, model_dir = Path(args.run_dir), Path(args.model_dir)
    cfg = read_run_config(run_dir)
    stop = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: stop.set())
    signal.signal(signal.SIGINT, lambda *_: stop.set())
    # Before any tensor exists: freed activations go back to the kernel instead of staying in
    # glibc's heap (asyncrl/learner/memory.py; most of the LoRA learner's peak RSS otherwise).
    bounded = bound_malloc_retention()
    caches = bound_kernel_caches()  # before the first bf16 matmul: one cache entry per batch shape otherwise
    info = init_distributed({"cpu": "gloo", "cuda": "cpu:gloo,cuda:nccl"}.get(cfg.learner.device), timeout_s=COLLECTIVE_TIMEOUT_S)
    L = cfg.learner
    threads = L.num_threads or default_num_threads(cfg.rollout.num_workers, info.world_size)
    torch.set_num_threads(threads)
    torch.manual_seed(L.seed)

    from transformers import AutoModelForCausalLM

    from asyncrl.controller.prompts import load_tokenizer

    model: torch.nn.Module = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    pad_id = load_tokenizer(model_dir).pad_token_id or 0
    if cfg.quant.uaq:  # §8: fold once on the fp32 master weights, before optimiser states exist
        from asyncrl.quant import fold_uaq

        fold_uaq(model, cfg.quant.uaq_scale, tuple(cfg.quant.uaq_sites))
    lora = lora_spec(L)
    initial = initial_copy(model) if cfg.algo.kl_coef > 0 and lora is None else None
    model = prepare_policy(model, info, lora=lora, activation_checkpointing=L.activation_checkpointing)
    ref_model = reference_policy(model, initial, info) if cfg.algo.kl_coef > 0 else None
    del initial
    log.info("learner: %d threads, %s, %s, world size %d%s%s, oneDNN/ideep caches %s", threads,
             f"LoRA r={lora.rank}" if lora else "full fine-tuning",
             "activation checkpointing" if L.activation_checkpointing else "no activation checkpointing",
             info.world_size, ", KL reference" if ref_model is not None else "",
             "" if bounded else ", malloc retention unbounded (not glibc)",
             "/".join(caches.values()))
    opt = build_optimizer(model, lr=L.lr, weight_decay=L.weight_decay)
    sched = build_scheduler(opt, LRSchedule(kind=L.lr_schedule, warmup_steps=L.warmup_steps,
                                            total_steps=max(L.total_steps, L.warmup_steps + 1),
                                            min_lr_ratio=L.min_lr_ratio))
    state = TrainState(model, opt, sched, version=0)
    ckpt_root = RunDir(run_dir).checkpoints
    # The same verified checkpoint the controller chose on resume (damaged ones are skipped, said why); also
    # without resume=: a learner started again under a running controller goes on from the run's newest one.
    if cfg.resume or not args.replay_log:
        from asyncrl.rundir.checkpoints import choose_resume_point

        point = choose_resume_point(ckpt_root)
        for note in point.notes if cfg.resume or point.learner_dir is not None else ():
            log.warning("resume: %s", note)
        if point.learner_dir is not None:
            load_checkpoint(point.learner_dir, state, info)
            log.info("resumed learner at version %d", state.version)
    formats = [f for f in args.publish_formats.split(",") if f] or [cfg.quant.fmt]
    replay = bool(args.replay_log)

    # rank 0 only:
    source: ReplaySource | ControllerSource | None = None
    server: WeightServer | None = None
    publisher: Publisher | None = None
    evaluator: Evaluator | None = None
    # Weights are gathered (merged, for LoRA) only to publish or evaluate, and dropped right after:
    # the learner process holds no full copy of the policy between steps.
    sd = policy_state_dict(model, lora) if not replay or (state.version == 0 and L.eval_every) else {}
    buffers = {n: b for n, b in base_model(model).named_buffers()}
    if info.is_main:
        evaluator = Evaluator(cfg, model_dir)
        if replay:
            source = ReplaySource(Path(args.replay_log), run_dir, model_id(cfg, model_dir), stop,
                                  salvage=cfg.log.salvage)
        else:
            host = cfg.transport.host
            curve = server_curve(cfg.transport)
            check_bind_security(f"tcp://{host}:0", keys=curve is not None, insecure=cfg.transport.insecure)
            server = WeightServer(f"tcp://{host}:0", f"tcp://{host}:0", curve=curve)
            publisher = Publisher(cfg, formats, server)
            publisher.publish(sd, state.version)
            source = ControllerSource(args.controller, server, state.version, stop, cfg.transport)
        if state.version == 0 and L.eval_every:  # the step-0 baseline every later evaluation is read against
            source.report(0, evaluator.evaluate(sd, 0, buffers) | {"eval/baseline": 1.0})
    sd = {}
    t_run = time.perf_counter()
    try:
        while state.version < L.total_steps:
            k = state.version
            t0 = time.perf_counter()
            msg = source.next_batch(k) if source is not None else None  # rank 0
            if _agree(info.is_main and msg is None, info):
                log.info("learner stopping before step %d", k)
                break
            batch = batch_from_message(msg, cfg.rollout.temperature, pad_id) if msg is not None else None
            batch = broadcast_batch(batch, info)
            t_wait = time.perf_counter() - t0
            metrics = train_step(state, batch, cfg.algo, cfg.learner, info, ref_model=ref_model)
            t_train = time.perf_counter() - t0 - t_wait
            eval_due = bool(L.eval_every) and state.version % L.eval_every == 0 and state.version < L.total_steps
            sd = policy_state_dict(model, lora) if (not replay or eval_due) else {}
            ckpt = bool(L.ckpt_every) and state.version % L.ckpt_every == 0 and state.version < L.total_steps
            if info.is_main:
                assert source is not None and evaluator is not None and msg is not None  # rank 0 holds them
                if publisher is not None:
                    metrics |= publisher.publish(sd, state.version)
                if server is not None:  # the weight server's received/rejected counters reach metrics.jsonl
                    metrics |= server.as_metrics()
                metrics |= msg.metrics
                metrics |= {"time/learner_wait_s": t_wait, "time/learner_train_s": t_train,
                            "time/learner_busy_frac": t_train / max(1e-9, time.perf_counter() - t0),
                            "learner/lr": float(opt.param_groups[0]["lr"])}
                if eval_due:
                    metrics |= evaluator.evaluate(sd, state.version, buffers)
                # The controller saves its state for this version before the learner's checkpoint
                # exists, so every learner checkpoint has a matching controller state.
                acked = source.report(state.version, metrics, checkpoint=ckpt)
            sd = {}
            if ckpt and _agree(info.is_main and acked, info):
                save_checkpoint(ckpt_root, state, info, keep_last=KEEP_CHECKPOINTS)
        # A final checkpoint only with the controller's state of the same version (it may be gone:
        # then the last periodic checkpoint stays the resume point).
        if _agree(source is not None and source.sync_checkpoint(state.version), info):  # rank 0
            save_checkpoint(ckpt_root, state, info, keep_last=KEEP_CHECKPOINTS)
        if not _agree(info.is_main and stop.is_set(), info):  # finished (or the replayed log ran out): export, hash, final eval
            finish_run(cfg, state, model, model_dir, run_dir, info, evaluator, source, t_run, lora)
        if isinstance(source, ControllerSource) and source.lost:  # the run goes on without this process
            log.error("learner stopped: %s", source.lost)
            return 1
    except ChannelTimeout as e:
        log.error("controller unreachable: %s", e)
        return 1
    finally:
        if server is not None:
            server.close()
        if source is not None:
            source.close()
        close_distributed()
    return 0


def lora_spec(L) -> LoraSpec | None:
    """``learner.lora`` as a ``LoraSpec`` (None for full fine-tuning)."""
    if L.lora.rank <= 0:
        return None
    return LoraSpec(rank=L.lora.rank, alpha=L.lora.alpha, target_modules=tuple(L.lora.target_modules),
                    dropout=L.lora.dropout)


def finish_run(cfg, state, model, model_dir: Path, run_dir: Path, info, evaluator, source, t_run: float,
               lora: LoraSpec | None = None) -> None:
    """Export the final policy (UAQ unfolded), hash it, evaluate it, tell the controller we are done."""
    unfold = None
    if cfg.quant.uaq:
        from asyncrl.quant import unfold_uaq

        def unfold(d):
            return unfold_uaq(d, cfg.quant.uaq_scale, tuple(cfg.quant.uaq_sites))
    export_hf(model, model_dir, RunDir(run_dir).model, info, state_dict_transform=unfold, lora=lora)
    sd = policy_state_dict(model, lora)
    if info.is_main:
        if unfold is not None:
            sd = unfold(sd)
        final = evaluator.evaluate(sd, state.version + 1, {n: b for n, b in base_model(model).named_buffers()})
        final["learner/wall_s"] = time.perf_counter() - t_run
        sha = sha256_of_state_dict(sd)
        RunDir(run_dir).learner_final.write_text(json.dumps(
            {"version": state.version, "state_dict_sha256": sha, **final}, indent=2))
        source.report(state.version, final, done=True)


def _agree(flag: bool, info) -> bool:
    """Rank 0's decision, shared with every rank (collective)."""
    t = torch.tensor([1 if flag else 0])
    if info.world_size > 1:
        torch.distributed.broadcast(t, src=0)
    return bool(int(t))



if __name__ == "__main__":
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    raise SystemExit(main())
