"""Learner process (torchrun entry): ``torchrun --nproc_per_node=W -m workers.learner --run-dir RUN``.

Every rank trains the FSDP2-sharded policy; rank 0 alone talks to the controller (batches in,
versions out), serves weights (quantize-on-send, every format the run publishes) and evaluates.
One step (docs/algorithms.md §10): rank 0 asks for batch k and broadcasts it; every rank runs
``asyncrl.learner.train_step`` (prox log-probs with theta_k, minibatches with global denominators);
the new version k+1 is gathered, published, announced to the controller; every ``ckpt_every``
steps a DCP checkpoint is written (all ranks).
``main`` is two parts: ``build`` puts one rank's job together (configuration, process group, policy,
optimizer and resumed state from ``workers/learner/setup.py``; on rank 0 the batch source of
``workers/learner/link.py``, the weight server, and the publisher and evaluator of
``workers/learner/rank0.py``) into a ``Learner``, and ``Learner.train`` runs the step loop to its end.
Only here: argv, sockets, the process loop. The math is in ``asyncrl.learner`` and ``asyncrl.algo``.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import signal
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

import torch

import protocols as P
from asyncrl.config.schema import TrainConfig
from asyncrl.learner import (
    LearnerBatch,
    TrainState,
    export_hf,
    save_checkpoint,
    sha256_of_state_dict,
    train_step,
)
from asyncrl.learner.fsdp import DistInfo, broadcast_batch, close_distributed
from asyncrl.learner.policy import (
    LoraSpec,
    policy_state_dict,
    runtime_buffers,
)
from asyncrl.models.prepare import model_id
from asyncrl.rundir import RunDir
from asyncrl.rundir.checkpoints import KEEP_CHECKPOINTS
from asyncrl.rundir.files import DiskFullError
from asyncrl.transport import (
    ChannelTimeout,
    WeightServer,
    check_bind_security,
    server_curve,
)
from workers.learner.link import ControllerSource, ReplaySource
from workers.learner.rank0 import Evaluator, Publisher
from workers.learner.setup import Policy, Rank, load_policy, start_rank, training_state
from workers.learner.stop import StopRequest, stopped_line
from workers.run_config import read_run_config

log = logging.getLogger("asyncrl.learner")


def batch_from_message(msg: P.TrainBatch, temperature: float, pad_id: int) -> LearnerBatch:
    s = msg.samples
    return LearnerBatch.from_samples(
        [x.prompt_ids.to_numpy().tolist() for x in s], [x.response_ids.to_numpy().tolist() for x in s],
        [x.behav_logp.to_numpy() for x in s], [x.versions.to_numpy() for x in s], [x.advantage for x in s],
        temperature=temperature, pad_id=pad_id)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m workers.learner")
    ap.add_argument("--run-dir", required=True)
    ap.add_argument("--model-dir", required=True)
    ap.add_argument("--controller", default="", help="controller address (training)")
    ap.add_argument("--replay-log", default="", help="a trajectory log to replay instead of a controller")
    ap.add_argument("--replay-steps", type=int, default=None,
                    help="replay only the log's first N steps (a prefix of a run still training)")
    ap.add_argument("--publish-formats", default="")
    args = ap.parse_args(argv)
    if "TORCHELASTIC_RUN_ID" in os.environ:  # a rank under torchrun: never outlive a killed agent
        from workers.proc import die_with_parent

        die_with_parent()
    logging.basicConfig(level="INFO", format="%(asctime)s %(name)s %(message)s")
    learner = build(Path(args.run_dir), Path(args.model_dir), controller=args.controller, replay_log=args.replay_log,
                    replay_steps=args.replay_steps, publish_formats=[f for f in args.publish_formats.split(",") if f])
    return learner.train()


@dataclass
class Learner:
    """One rank's training job as ``build`` put it together; ``train`` runs the step loop to its end.

    ``source``, ``server``, ``publisher`` and ``evaluator`` exist on rank 0 only (None elsewhere).
    Holds no full copy of the policy between steps: weights are gathered (merged, for LoRA) only to
    publish or evaluate, inside one step, and dropped right after."""

    cfg: TrainConfig
    rank: Rank
    policy: Policy
    state: TrainState
    run_dir: Path
    model_dir: Path
    stop: StopRequest
    replay: bool
    buffers: dict[str, torch.Tensor]
    """The policy's non-parameter tensors (rotary tables), by the base model's names (for evaluation)."""
    source: ReplaySource | ControllerSource | None = None
    server: WeightServer | None = None
    publisher: Publisher | None = None
    evaluator: Evaluator | None = None

    @property
    def info(self) -> DistInfo:
        return self.rank.info

    def state_dict(self, needed: bool = True) -> Mapping[str, torch.Tensor]:
        """The full policy state dict (collective: every rank calls it), or {} when not ``needed``."""
        return policy_state_dict(self.policy.model, self.policy.lora) if needed else {}

    def train(self) -> int:
        """The step loop, then the final checkpoint, export and evaluation; the exit status of the rank."""
        t_run = time.perf_counter()
        try:
            while self.state.version < self.cfg.learner.total_steps and self.step():
                pass
            self.finish(t_run)
            if isinstance(self.source, ControllerSource) and self.source.lost:  # the run goes on without this process
                log.error("learner stopped: %s", self.source.lost)
                return 1
        except ChannelTimeout as e:
            log.error("controller unreachable: %s", e)
            return 1
        except DiskFullError as e:  # the failed checkpoint is removed; the previous one stays the resume point
            log.error("learner stopped: %s", e)
            return 1
        finally:
            self.close()
        return 0

    def step(self) -> bool:
        """One step on every rank (docs/algorithms.md §10): batch k in, version k+1 trained, published and
        reported, a checkpoint when due. False when rank 0 has no batch (stopped, or the replayed log ran out)."""
        info, L, k = self.info, self.cfg.learner, self.state.version
        t0 = time.perf_counter()
        msg = self.source.next_batch(k) if self.source is not None else None  # rank 0
        if _agree(info.is_main and msg is None, info):
            log.info("learner stopping before step %d", k)
            return False
        batch = batch_from_message(msg, self.cfg.rollout.temperature, self.policy.pad_id) if msg is not None else None
        batch = broadcast_batch(batch, info)
        t_wait = time.perf_counter() - t0
        mismatch = self.mismatch(batch, k)
        metrics = train_step(self.state, batch, self.cfg.algo, L, info, ref_model=self.policy.ref_model) | mismatch
        t_train = time.perf_counter() - t0 - t_wait
        v = self.state.version
        eval_due = bool(L.eval_every) and v % L.eval_every == 0 and v < L.total_steps
        ckpt = bool(L.ckpt_every) and v % L.ckpt_every == 0 and v < L.total_steps
        acked = self.publish_and_report(msg, metrics, eval_due=eval_due, ckpt=ckpt, t0=t0, t_wait=t_wait,
                                        t_train=t_train)
        if ckpt and _agree(info.is_main and acked, info):
            save_checkpoint(RunDir(self.run_dir).checkpoints, self.state, info, keep_last=KEEP_CHECKPOINTS)
        return True

    def mismatch(self, batch: LearnerBatch, k: int) -> dict[str, float]:
        """The log-prob gap taken apart (asyncrl/learner/mismatch.py) when ``learner.mismatch_every`` says so."""
        L = self.cfg.learner
        if not L.mismatch_every or k % L.mismatch_every:
            return {}
        from asyncrl.learner.aligned import RolloutAlignment
        from asyncrl.learner.mismatch import mismatch_decomposition
        from asyncrl.learner.step import autocast_context
        from asyncrl.quant.model import DEFAULT_KEEP_FULL_PRECISION

        def measure(aligned: RolloutAlignment | None) -> dict[str, float]:
            return mismatch_decomposition(self.policy.model, batch, version=k, rows=L.mismatch_rows, aligned=aligned,
                                          chunk_tokens=L.chunk_tokens, autocast=autocast_context(L, self.info.device))

        q = self.cfg.quant
        if self.policy.aligned is not None or q.fmt == "fp32":
            return measure(self.policy.aligned)
        with RolloutAlignment.routed(self.policy.model, q.fmt, keep_full_precision=DEFAULT_KEEP_FULL_PRECISION,
                                     head=q.lm_head, embedding=q.embedding, enabled=False) as aligned:  # for mismatch/quant only
            return measure(aligned)

    def adopt_publication(self) -> None:
        """Rank 0 at world size 1: the rollout-aligned forward computes with the codes just published (one
        quantization per version). Not with UAQ, whose published weights are the unfolded ones."""
        al, pub = self.policy.aligned, self.publisher
        if al is not None and pub is not None and self.info.world_size == 1 and not self.cfg.quant.uaq:
            published = pub.prev.get(self.cfg.quant.fmt)
            if published is not None and published.version == self.state.version:
                al.adopt(published.tensors)

    def publish_and_report(self, msg: P.TrainBatch | None, metrics: dict[str, float], *, eval_due: bool,
                           ckpt: bool, t0: float, t_wait: float, t_train: float) -> bool:
        """The new version published, evaluated when due and reported to the controller (rank 0; the state
        dict is gathered on every rank). True when the controller saved its state for a checkpoint."""
        sd = self.state_dict(not self.replay or eval_due)
        if not self.info.is_main:
            return False
        assert self.source is not None and self.evaluator is not None and msg is not None  # rank 0 holds them
        v = self.state.version
        if self.publisher is not None:
            metrics |= self.publisher.publish(sd, v)
            self.adopt_publication()
        if self.server is not None:  # the weight server's received/rejected counters reach metrics.jsonl
            metrics |= self.server.as_metrics()
        metrics |= msg.metrics
        metrics |= {"time/learner_wait_s": t_wait, "time/learner_train_s": t_train,
                    "time/learner_busy_frac": t_train / max(1e-9, time.perf_counter() - t0),
                    "learner/lr": float(self.state.optimizer.param_groups[0]["lr"])}
        if eval_due:
            metrics |= self.evaluator.evaluate(sd, v, self.buffers)
        # The controller saves its state for this version before the learner's checkpoint
        # exists, so every learner checkpoint has a matching controller state.
        return self.source.report(v, metrics, checkpoint=ckpt)

    def finish(self, t_run: float) -> None:
        """After the loop: a final checkpoint only with the controller's state of the same version (it may be
        gone: then the last periodic checkpoint stays the resume point); export, hash and evaluate unless stopped."""
        info = self.info
        saved = _agree(self.source is not None and self.source.sync_checkpoint(self.state.version), info)  # rank 0
        if saved:
            save_checkpoint(RunDir(self.run_dir).checkpoints, self.state, info, keep_last=KEEP_CHECKPOINTS)
        if not _agree(info.is_main and self.stop.is_set(), info):  # finished (or the replayed log ran out)
            finish_run(self.cfg, self.state, self.policy.model, self.model_dir, self.run_dir, info, self.evaluator,
                       self.source, t_run, self.policy.lora)
        elif info.is_main and self.stop.signal_name:  # a requested stop: one line, where to resume from
            log.info("%s", stopped_line(self.stop.signal_name, self.state.version, saved,
                                        RunDir(self.run_dir).checkpoints))

    def close(self) -> None:
        if self.server is not None:
            self.server.close()
        if self.source is not None:
            self.source.close()
        close_distributed()


def build(run_dir: Path, model_dir: Path, *, controller: str = "", replay_log: str = "",
          replay_steps: int | None = None, publish_formats: Sequence[str] = ()) -> Learner:
    """This rank's training job: configuration (the run folder's), process group, policy, optimizer,
    resumed state, and on rank 0 the batch source, the weight server with the first publication, and
    the evaluator with the step-0 baseline. ``replay_log``: train from a trajectory log instead of a
    controller (``replay_steps``: only its first N steps); ``publish_formats``: the formats rank 0 publishes
    (default: the run's ``quant.fmt``)."""
    cfg = read_run_config(run_dir)
    stop = StopRequest()
    for s in (signal.SIGTERM, signal.SIGINT):
        signal.signal(s, stop.on_signal)
    rank = start_rank(cfg)
    policy = load_policy(cfg, model_dir, rank)
    replay = bool(replay_log)
    state = training_state(cfg, policy, rank.info, RunDir(run_dir).checkpoints, replay=replay)
    learner = Learner(cfg, rank, policy, state, run_dir, model_dir, stop, replay,
                      buffers=runtime_buffers(policy.model))
    # Weights are gathered (merged, for LoRA) only to publish or evaluate, and dropped right after:
    # the learner process holds no full copy of the policy between steps.
    sd = learner.state_dict(not replay or (state.version == 0 and bool(cfg.learner.eval_every)))
    if rank.info.is_main:
        open_rank0(learner, sd, controller=controller, replay_log=replay_log, replay_steps=replay_steps,
                   formats=list(publish_formats) or [cfg.quant.fmt])
    return learner


def open_rank0(learner: Learner, sd: Mapping[str, torch.Tensor], *, controller: str, replay_log: str,
               formats: list[str], replay_steps: int | None = None) -> None:
    """Rank 0's parts: the evaluator, the batch source (the controller, with a weight server holding the
    first publication, or a trajectory log), and the step-0 evaluation every later one is read against."""
    cfg, version = learner.cfg, learner.state.version
    learner.evaluator = Evaluator(cfg, learner.model_dir)
    if learner.replay:
        learner.source = ReplaySource(Path(replay_log), learner.run_dir, model_id(cfg, learner.model_dir),
                                      learner.stop, salvage=cfg.log.salvage, steps=replay_steps)
    else:
        host = cfg.transport.host
        curve = server_curve(cfg.transport)
        check_bind_security(f"tcp://{host}:0", keys=curve is not None, insecure=cfg.transport.insecure)
        learner.server = WeightServer(f"tcp://{host}:0", f"tcp://{host}:0", curve=curve,
                                      bucket_bytes=int(cfg.transport.bucket_mb * 2**20))
        learner.publisher = Publisher(cfg, formats, learner.server)
        learner.publisher.publish(sd, version)
        learner.adopt_publication()
        learner.source = ControllerSource(controller, learner.server, version, learner.stop, cfg.transport)
    if version == 0 and cfg.learner.eval_every:  # the step-0 baseline every later evaluation is read against
        learner.source.report(0, learner.evaluator.evaluate(sd, 0, learner.buffers) | {"eval/baseline": 1.0})


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
        final = evaluator.evaluate(sd, state.version + 1, runtime_buffers(model))
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
