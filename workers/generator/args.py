"""A generation worker's command line and what it derives from it (``workers/generator/process.py`` runs it).

Owns: ``parse_args`` (``asyncrl worker key=value ...`` -> a checked ``WorkerRoleConfig``, parsed by
``asyncrl.config.roles.parse_role`` like ``asyncrl train``'s overrides; ``--help``: ``workers.role_cli.role_argv``), the ``EngineSpec`` a worker builds from the run's ``WorkerSetup`` and its own settings, and
``built`` (a part of the worker used before it exists is a bug, said as such).
Never: opens a socket or builds an engine; knows a setting by name that the role schema does not define.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TypeVar

import protocols as P
from asyncrl.config.roles import WorkerRoleConfig, parse_role, server_settings
from asyncrl.engine.factory import EngineSpec

T = TypeVar("T")

WORKER_DESCRIPTION = "join a running asyncrl job as a generation worker (any host, any time; docs/cluster.md)"
WORKER_NOTE = "A fatal error in any thread hands the worker's samples back and exits with status 1."


def built(part: T | None, what: str) -> T:
    if part is None:
        raise RuntimeError(f"the worker's {what} is used before run() built it")
    return part


def engine_spec(setup: P.WorkerSetup, role: WorkerRoleConfig, *, fmt: str, slots: int) -> EngineSpec:
    """The engine a worker builds from the run's ``WorkerSetup`` and its own settings (``fmt`` and ``slots``:
    what the controller granted it)."""
    return EngineSpec(kind=role.rollout.engine, quant_format=fmt, device=role.rollout.device, slots=slots,
                      quantize_head=setup.quantize_head, quantize_embedding=setup.quantize_embedding,
                      decode_step=role.rollout.decode_step,
                      cuda_graphs=role.rollout.cuda_graphs, compile_step=role.rollout.compile,
                      prewarm=role.rollout.prewarm, overlap=role.rollout.overlap,
                      eos_token_ids=list(setup.eos_token_ids),
                      max_seq_len=setup.max_seq_len, model_config_json=setup.model_config,
                      model_path=role.sglang.model_path or setup.model_dir, sglang=server_settings(role.sglang),
                      log_dir=role.log_dir)


def parse_args(argv: Sequence[str]) -> WorkerRoleConfig:
    """``asyncrl worker`` settings -> a checked ``WorkerRoleConfig`` (``ValueError`` naming the fix)."""
    from workers.role_cli import role_argv

    settings = role_argv(argv, command="worker", description=WORKER_DESCRIPTION, schema=WorkerRoleConfig,
                         note=WORKER_NOTE)
    return parse_role(WorkerRoleConfig, settings, command="worker")
