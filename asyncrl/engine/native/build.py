"""How a ``NativeEngine`` is put together: its options resolved and checked, the model placed and quantized,
the decode runner and the static step built.

Owns: ``build_decode`` (model on its device, the fallback check on the model as loaded, quantization, the
runner: ``DecoderRunner`` or the HF fallback, and the ``StaticStep`` with its CUDA graphs / compiled body),
the resolution of ``compile_step`` (``resolve_compile``) and ``prewarm`` (``resolve_prewarm``), building every
bucket's runner up front (``prewarm_runners``), and the checks of the decode options against each other and
the model (``ValueError`` naming the fix).

Must never: run a request, touch the engine's locks or queues, or load published weights (``weights`` does).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from asyncrl.constants import DECODE_STEPS, OVERLAP, PREWARM
from asyncrl.engine.native.hf_runner import build_runner, fallback_reason
from asyncrl.engine.native.static_step import StaticStep
from asyncrl.engine.native.step_graphs import resolve_cuda_graphs
from asyncrl.engine.native.weights import QUANT_FORMATS, quantize_actor


@dataclass(slots=True)
class DecodeSetup:
    """What ``build_decode`` made: the model (quantized, on its device), its runner and the static step."""

    model: torch.nn.Module
    runner: Any
    """``DecoderRunner`` for a natively supported model, else the HF fallback runner (``hf_runner``)."""
    static: StaticStep | None
    """The static decode step; None on the eager path (``decode_step="eager"`` or the HF fallback)."""
    prewarm: bool
    """Build every bucket's runner now and after anything drops them (``prewarm_runners``)."""


@dataclass(frozen=True, slots=True)
class CompilePlan:
    """How the static step's body is compiled (``resolve_compile``)."""

    backend: str | None
    """The ``torch.compile`` backend; None: the body runs uncompiled."""
    fallback: bool
    """A build that fails logs an error and the step runs uncompiled (``auto``); else the failure is raised."""


def resolve_compile(choice: str | bool, device: torch.device) -> CompilePlan:
    """The one place ``compile_step`` (``rollout.compile``) is decided.

    ``auto``: Inductor on CUDA, where a build that fails is logged as an error naming ``rollout.compile=false``
    and the step falls back to the uncompiled body; off elsewhere (on a CPU a compiled step buys little and
    costs a compiler). ``true``: Inductor anywhere, a failed build raised naming the fix. ``false``: off. Any
    other text names a ``torch.compile`` backend (``eager``, ``aot_eager``: tests and benchmarks), no fallback.
    """
    if isinstance(choice, bool):
        choice = "true" if choice else "false"
    if not isinstance(choice, str):
        raise ValueError(f"compile_step must be auto, true, false or a torch.compile backend, got {choice!r}")
    value = choice.lower()
    if value == "auto":
        return CompilePlan("inductor", True) if device.type == "cuda" else CompilePlan(None, False)
    if value == "true":
        return CompilePlan("inductor", False)
    if value == "false":
        return CompilePlan(None, False)
    from torch._dynamo import list_backends

    backends = list_backends(exclude_tags=())
    if choice not in backends:
        raise ValueError(f"compile_step={choice!r} is neither auto, true, false nor a torch.compile backend "
                         f"({', '.join(backends)}); set rollout.compile=auto, true or false")
    return CompilePlan(choice, False)


def check_options(quant_format: str, max_batch_size: int, max_prefill_tokens: int, decode_step: str) -> None:
    """The engine options checked before anything is built (``ValueError`` naming the valid values)."""
    if quant_format not in QUANT_FORMATS:
        raise ValueError(f"quant_format must be one of {QUANT_FORMATS}, got {quant_format!r}")
    if max_batch_size < 1 or max_prefill_tokens < 1:
        raise ValueError("max_batch_size and max_prefill_tokens must be >= 1")
    if decode_step not in DECODE_STEPS:
        raise ValueError(f"decode_step must be one of {DECODE_STEPS}, got {decode_step!r}")


def build_decode(model: torch.nn.Module, *, device: torch.device, quant_format: str, max_batch_size: int,
                 max_seq_len: int, vocab_size: int, quantize_head: bool, quantize_embedding: bool,
                 decode_step: str, cuda_graphs: str | bool, compile_step: bool | str,
                 prewarm: str | bool = "auto") -> DecodeSetup:
    """Move ``model`` to ``device``, quantize it, and build its runner and (unless eager) its static step."""
    graphs = resolve_cuda_graphs(cuda_graphs, device)
    resolve_compile(compile_step, device)  # a bad value is refused before the model moves
    model = model.to(device).eval()
    reason = fallback_reason(model, max_seq_len)  # on the model as loaded, before its linears change
    model = quantize_actor(model, quant_format, head=quantize_head, embedding=quantize_embedding)
    runner = build_runner(model, max_batch_size, max_seq_len, reason)
    static: StaticStep | None = None
    if decode_step == "static" and reason is not None:
        raise ValueError(f"decode_step=static needs a model the native decoder runs ({reason}); use "
                         "decode_step=auto, which takes the eager path on the HF fallback")
    if decode_step != "eager" and reason is None:
        plan = resolve_compile(compile_step, device)
        static = StaticStep(runner, vocab_size, cuda_graphs=graphs, compile_body=plan.backend,
                            compile_fallback=plan.fallback)
    elif graphs and str(cuda_graphs).lower() == "true":
        why = "drop decode_step=eager" if reason is None else f"this model runs on the HF fallback ({reason})"
        raise ValueError(f"cuda_graphs=true replays the static decode step; {why}")
    setup = DecodeSetup(model, runner, static, resolve_prewarm(prewarm, static))
    if setup.prewarm:
        prewarm_runners(setup)
    return setup


def resolve_prewarm(choice: str | bool, static: StaticStep | None) -> bool:
    """``auto`` -> on when the static step runs buckets (CUDA graphs or a compiled body); ``true`` needs them."""
    value = str(choice).lower()
    if value not in PREWARM:
        raise ValueError(f"prewarm must be one of {PREWARM}, got {choice!r}")
    bucketed = static is not None and static.pad
    if value == "true" and not bucketed:
        why = "it runs the eager decode path" if static is None else "its static step runs exact shapes"
        raise ValueError(f"prewarm=true builds the runners of the bucketed decode step, and this engine has none "
                         f"({why}: no CUDA graphs, no compiled step); set rollout.prewarm=auto, or turn on "
                         "rollout.compile or rollout.cuda_graphs")
    return value != "false" and bucketed


def resolve_overlap(choice: str | bool, device: torch.device, static: StaticStep | None) -> bool:
    """``auto`` -> on for CUDA with the static step (a CPU has no device to overlap with); ``true`` needs the
    static step (``ValueError`` naming the fix)."""
    value = str(choice).lower()
    if value not in OVERLAP:
        raise ValueError(f"overlap must be one of {OVERLAP}, got {choice!r}")
    if value == "true" and static is None:
        raise ValueError("overlap=true reads a static step's results while the next one runs, and this engine runs "
                         "the eager decode path; set rollout.overlap=auto (overlap=auto), or rollout.decode_step=auto on a "
                         "natively supported model")
    return static is not None and (value == "true" or value == "auto" and device.type == "cuda")


def prewarm_runners(setup: DecodeSetup) -> int:
    """Size the K/V cache to ``max_seq_len`` (its final size: it never grows, so no runner is dropped by a growth)
    and build the runner of every batch/span bucket; return how many were built. Runs between steps only."""
    static, cache = setup.static, setup.runner.cache
    assert static is not None
    if cache.kv is None:  # the K/V dtype is the model's compute dtype: one single-token prefill into row 0 sets it
        setup.runner.prefill(0, [[0]], 1)
    assert cache.dtype is not None
    cache.reserve(cache.max_rows, cache.max_len, cache.dtype, static.device)
    return static.build_all()
