"""A generation worker's command line and what it derives from it (``workers/generator.py`` runs it).

Owns: ``parse_args`` (every ``key=value`` setting of ``asyncrl worker``, checked), the ``EngineSpec`` a
worker builds from the run's ``WorkerSetup`` and its own settings, and ``built`` (a part of the worker
used before it exists is a bug, said as such). Never: opens a socket or builds an engine.
"""

from __future__ import annotations

import argparse
from collections.abc import Sequence
from typing import TypeVar

import protocols as P
from asyncrl.engine.factory import EngineSpec

SGLANG_KEYS = ("url", "device", "python", "model_path", "max_total_tokens", "startup_timeout_s", "extra_args")
NATIVE_KEYS = ("decode_step", "cuda_graphs", "compile")
"""Native engine settings a worker takes (``rollout.decode_step`` / ``cuda_graphs`` / ``compile``)."""

T = TypeVar("T")


def built(part: T | None, what: str) -> T:
    if part is None:
        raise RuntimeError(f"the worker's {what} is used before run() built it")
    return part


def settings(args: argparse.Namespace, keys: Sequence[str], prefix: str = "") -> dict[str, str]:
    """The given settings among the parsed ``key=value`` ones (``prefix``: ``sglang_`` for ``sglang.KEY``)."""
    return {k: getattr(args, f"{prefix}{k}") for k in keys if hasattr(args, f"{prefix}{k}")}


def engine_spec(setup: P.WorkerSetup, *, kind: str, fmt: str, device: str, slots: int, sglang: dict[str, str],
                native: dict[str, str], log_dir: str) -> EngineSpec:
    """The engine a worker builds from the run's ``WorkerSetup`` and its own settings."""
    sg = sglang
    extra = [a for a in sg.get("extra_args", "").strip("[]").split(",") if a]
    return EngineSpec(kind=kind, quant_format=fmt, device=device, slots=slots,
                      quantize_head=setup.quantize_head, decode_step=native.get("decode_step", "auto"),
                      cuda_graphs=native.get("cuda_graphs", "auto"),
                      compile_step=native.get("compile", "false").lower() == "true",
                      eos_token_ids=list(setup.eos_token_ids), max_seq_len=setup.max_seq_len,
                      model_config_json=setup.model_config, model_path=sg.get("model_path") or setup.model_dir,
                      sglang_url=sg.get("url", ""), sglang_device=sg.get("device", "auto"),
                      sglang_python=sg.get("python", ""), sglang_max_total_tokens=int(sg.get("max_total_tokens", 0)),
                      sglang_startup_timeout_s=float(sg.get("startup_timeout_s", 600.0)), sglang_extra_args=extra,
                      log_dir=log_dir)


def parse_args(argv: Sequence[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        prog="asyncrl worker", description="join a running asyncrl job as a generation worker (any host, any "
        "time; docs/cluster.md)", formatter_class=argparse.RawDescriptionHelpFormatter, epilog="""settings (key=value):
  controller=tcp://HOST:PORT   required: the address `asyncrl controller` / `asyncrl train` prints
  engine=native|sglang         rollout engine (default native)
  device=auto|cpu|cuda[:N]     native engine device (default auto: a GPU when one is visible)
  decode_step=auto|static|eager, cuda_graphs=auto|true|false, compile=false|true   native decode step
  quant.fmt=FMT                actor format (native: a published format; sglang: fp32, bf16 or fp8)
  sglang.url=http://H:P        attach to a running SGLang server instead of starting one
  sglang.device=auto|cpu|cuda  device of a server this worker starts; sglang.python=PATH its interpreter
  sglang.model_path=DIR        model folder for that server (default: the run's, from the controller)
  sglang.max_total_tokens=N, sglang.startup_timeout_s=S, sglang.extra_args=[--flag,value]
  worker_id=NAME slots=N drain_s=S log_dir=DIR log_level=INFO transport.keys_dir=DIR transport.key_name=NAME
  no_learner_s=S               how long to wait for a learner when a restarted controller has none (default 120)
A fatal error in any thread hands the worker's samples back and exits with status 1.""")
    p.add_argument("overrides", nargs="*", help="controller=tcp://HOST:PORT and other key=value settings")
    args = p.parse_args(argv)
    kv = {}
    for ov in args.overrides:
        if "=" not in ov:
            p.error(f"{ov!r} is not key=value")
        k, v = ov.split("=", 1)
        kv[k] = v
    known = {"controller", "quant.fmt", "worker_id", "slots", "drain_s", "no_learner_s", "log_level", "transport.keys_dir",
             "transport.key_name", "engine", "device", "log_dir", *NATIVE_KEYS, *(f"sglang.{k}" for k in SGLANG_KEYS)}
    unknown = set(kv) - known
    if unknown:
        p.error(f"unknown setting(s) {sorted(unknown)}; known: {sorted(known)}")
    if "controller" not in kv:
        p.error("controller=tcp://HOST:PORT is required (printed by `asyncrl train` at start)")
    try:
        wait_s = float(kv.get("no_learner_s", "1"))
    except ValueError:
        wait_s = -1.0
    if not 0 < wait_s < float("inf"):
        p.error(f"no_learner_s={kv['no_learner_s']} must be a number of seconds > 0 (default 120)")
    return argparse.Namespace(**{k.replace(".", "_"): v for k, v in kv.items()})
