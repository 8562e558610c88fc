"""Which GPUs a launched job's processes get: the ones this launcher may hand out, and the plan that
splits them between the learner's ranks and the generation workers.

Owns: ``visible_gpus`` (counted by the driver's NVML library, honouring an inherited
``CUDA_VISIBLE_DEVICES``) and ``gpu_plan``.
Never: imports torch or creates a CUDA context (the launcher supervises a run for its whole length).
"""

from __future__ import annotations

import os
from collections.abc import Sequence

from asyncrl.config.devices import parse_device
from asyncrl.config.schema import TrainConfig


def visible_gpus() -> list[str]:
    """The GPU ids this launcher may hand out (honours an inherited ``CUDA_VISIBLE_DEVICES``).

    Counted by the driver's NVML library, not by torch: the launcher supervises the run for its whole
    length and never loads torch (docs/benchmarks.md §8), nor creates a CUDA context. No NVML (no
    NVIDIA driver): no GPUs."""
    env = os.environ.get("CUDA_VISIBLE_DEVICES")
    if env is not None:
        return [d.strip() for d in env.split(",") if d.strip()]
    return [str(i) for i in range(nvml_device_count())]


def nvml_device_count() -> int:
    """GPUs the NVIDIA driver sees (``nvmlDeviceGetCount``); 0 without the driver's NVML library."""
    import ctypes

    try:
        nvml = ctypes.CDLL("libnvidia-ml.so.1")
    except OSError:
        return 0
    count = ctypes.c_uint(0)
    if nvml.nvmlInit_v2() != 0:
        return 0
    try:
        return int(count.value) if nvml.nvmlDeviceGetCount_v2(ctypes.byref(count)) == 0 else 0
    finally:
        nvml.nvmlShutdown()


def gpu_plan(gpus: Sequence[str], cfg: TrainConfig) -> tuple[str | None, list[str | None]]:
    """``CUDA_VISIBLE_DEVICES`` for the learner and for each worker (None: leave the variable alone).

    The learner's W ranks take the first W GPUs; the workers share the rest round-robin, one GPU each
    while there are enough. With no GPU left over the workers share all of them. A worker on the CPU,
    or pinned by ``rollout.device=cuda:N``, gets nothing (the choice stays the user's).
    """
    n, W = len(gpus), cfg.learner.world_size
    if n == 0:
        return None, [None] * cfg.rollout.num_workers
    learner_gpu = parse_device(cfg.learner.device, key="learner.device", indexed=False).may_use_gpu
    learner = ",".join(gpus[:W]) if learner_gpu and n > W else None
    pool = list(gpus[W:]) if learner is not None else list(gpus)
    gpu_workers = cfg.rollout.engine == "sglang" or parse_device(cfg.rollout.device, key="rollout.device").may_use_gpu
    return learner, [pool[i % len(pool)] if gpu_workers else None for i in range(cfg.rollout.num_workers)]
