"""The learner library: batch layout, log-probs, FSDP2 setup, the training step, checkpoints.

Owns everything the learner *process* (workers/learner/process.py) needs to train, save and export a
policy; it never opens sockets, reads argv/env beyond torchrun's variables, or computes an
objective (that is ``asyncrl.algo``). The options (``StepConfig``, the run schema's, and ``LRSchedule``,
``asyncrl.learner.options``) import without torch; every other name loads (with torch) on first use.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from asyncrl._lazy import lazy_exports
from asyncrl.config.schema import StepConfig
from asyncrl.learner.options import LRSchedule

if TYPE_CHECKING:
    from asyncrl.learner.batch import LearnerBatch
    from asyncrl.learner.checkpoint import (
        export_hf,
        latest_checkpoint,
        load_checkpoint,
        save_checkpoint,
        sha256_of_state_dict,
        state_dict_sha256,
    )
    from asyncrl.learner.fsdp import (
        DistInfo,
        broadcast_batch,
        close_distributed,
        full_state_dict,
        init_distributed,
        shard_model,
    )
    from asyncrl.learner.logprobs import token_logprobs
    from asyncrl.learner.schedule import build_optimizer, build_scheduler, lr_multiplier
    from asyncrl.learner.step import TrainState, train_step

_LAZY = {
    "batch": ("LearnerBatch",),
    "checkpoint": ("export_hf", "latest_checkpoint", "load_checkpoint", "save_checkpoint", "sha256_of_state_dict",
                   "state_dict_sha256"),
    "fsdp": ("DistInfo", "broadcast_batch", "close_distributed", "full_state_dict", "init_distributed", "shard_model"),
    "logprobs": ("token_logprobs",),
    "schedule": ("build_optimizer", "build_scheduler", "lr_multiplier"),
    "step": ("TrainState", "train_step"),
}
__getattr__ = lazy_exports(__name__, _LAZY)  # the torch side, imported on first use


__all__ = [
    "LearnerBatch",
    "token_logprobs",
    "DistInfo",
    "init_distributed",
    "shard_model",
    "broadcast_batch",
    "full_state_dict",
    "close_distributed",
    "StepConfig",
    "TrainState",
    "train_step",
    "LRSchedule",
    "lr_multiplier",
    "build_optimizer",
    "build_scheduler",
    "save_checkpoint",
    "load_checkpoint",
    "latest_checkpoint",
    "export_hf",
    "state_dict_sha256",
    "sha256_of_state_dict",
]
