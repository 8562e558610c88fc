"""Building a worker's rollout engine from what the worker knows: ``native`` or ``sglang``, and a device.

Owns: the choice between the two ``RolloutEngine`` implementations (a generation worker calls
``build_engine`` and from then on only the interface), device resolution (``auto`` / ``cpu`` / ``cuda`` /
``cuda:N`` against the GPUs torch sees; the grammar is ``asyncrl.config.devices``'), the default SGLang
interpreter. An ``EngineSpec`` carries the
SGLang settings as the run's own ``SGLangConfig`` (``asyncrl.config.schema``), so a key added there
reaches ``_build_sglang`` with no other edit.

Must never: import zmq/msgspec or know about controllers (the worker passes plain values in), start an
SGLang server for an ``url`` that is given (attach instead), or pick a device the caller did not allow.

The native engine runs any causal LM ``AutoModelForCausalLM`` builds from the architecture: the native
decoder where it is exact, else the model's own HF forward (``asyncrl.engine.native.hf_runner.make_runner``).

Invariants: the engine returned starts at version ``-1`` (it has no policy weights yet; the worker's first
fetch installs version >= 0), so every token it ever produces carries a learner version.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypedDict

from asyncrl.config.devices import parse_device
from asyncrl.config.schema import ENGINES, SGLANG_SERVING, SGLangConfig, check_serving
from asyncrl.constants import COMPILE_STEPS, CUDA_GRAPHS, DECODE_STEPS, OVERLAP, PREWARM
from asyncrl.engine.base import RolloutEngine
from asyncrl.engine.sglang.server import REPO_ROOT, SGLANG_PYTHON_ENV
from protocols.values import require_choice

__all__ = ["ENGINES", "SGLANG_SERVING", "EngineSpec", "build_engine", "resolve_device", "sglang_python"]
DEFAULT_SGLANG_VENV_PYTHON = REPO_ROOT / ".cache" / "sglang-venv" / "bin" / "python"


@dataclass(kw_only=True)
class EngineSpec:
    """Everything a worker needs to build its engine: its own settings (``asyncrl worker``, the run's
    ``rollout.*``/``sglang.*`` for a worker the launcher starts) and the run's ``WorkerSetup``."""

    kind: str = "native"
    """``native`` or ``sglang``."""
    quant_format: str = "int8"
    """Actor format: native = any published format; sglang = serving mode fp32 / bf16 / fp8."""
    device: str = "auto"
    """Native engine device (auto / cpu / cuda / cuda:N)."""
    slots: int = 32
    """Concurrent samples (native: batch rows; sglang: requests in flight at the server)."""
    eos_token_ids: list[int] = field(default_factory=list)
    max_seq_len: int = 0
    """0 = the model's max_position_embeddings (native)."""
    model_config_json: str = ""
    """The architecture (HF config JSON with model_type) for a native engine; weights come by fetch."""
    model_path: str = ""
    """HF model folder an SGLang server is started from (it must exist on this host)."""
    sglang: SGLangConfig = field(default_factory=SGLangConfig)
    """An SGLang engine's server: attach to ``sglang.url``, or start one with the other settings."""
    log_dir: str = ""
    """Where a started SGLang server writes its log (default: the temp folder)."""
    quantize_head: bool = False
    """Native engine: the output head is quantized too (``quant.lm_head``, from the controller's setup; the
    run publishes every quantized format so). An fp32 actor converts nothing, so it ignores this."""
    quantize_embedding: bool = False
    """Native engine: the token embedding is int8 codes (``quant.embedding``, from the controller's setup)."""
    decode_step: str = "auto"
    """Native engine decode step: ``auto`` / ``static`` / ``eager`` (``rollout.decode_step``)."""
    cuda_graphs: str = "auto"
    """Native engine: CUDA graphs of the static step, ``auto`` / ``true`` / ``false`` (``rollout.cuda_graphs``)."""
    compile_step: str = "auto"
    """Native engine: ``torch.compile`` the static step body, ``auto`` / ``true`` / ``false`` (``rollout.compile``)."""
    overlap: str = "auto"
    """Native engine: read a step's results after launching the next, ``auto`` / ``true`` / ``false``
    (``rollout.overlap``)."""
    prewarm: str = "auto"
    """Native engine: build every bucket of the static step at start, ``auto`` / ``true`` / ``false``
    (``rollout.prewarm``)."""

    def __post_init__(self) -> None:
        require_choice("engine", self.kind, ENGINES)
        require_choice("decode_step", self.decode_step, DECODE_STEPS)
        self.cuda_graphs = str(self.cuda_graphs).lower()
        require_choice("cuda_graphs", self.cuda_graphs, CUDA_GRAPHS)
        self.compile_step = str(self.compile_step).lower()
        require_choice("compile_step", self.compile_step, COMPILE_STEPS)
        self.overlap = str(self.overlap).lower()
        require_choice("overlap", self.overlap, OVERLAP)
        self.prewarm = str(self.prewarm).lower()
        require_choice("prewarm", self.prewarm, PREWARM)
        check_serving(self.kind, self.quant_format)


def resolve_device(spec: str) -> str:
    """``auto`` -> ``cuda`` when torch sees a GPU, else ``cpu``; ``cuda[:N]`` is checked against the GPUs.
    The grammar is ``asyncrl.config.devices.parse_device``'s (its refusal names every valid spelling)."""
    import torch

    device = parse_device(spec)
    if device.kind == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    if device.kind == "cpu":
        return "cpu"
    if not torch.cuda.is_available():
        raise ValueError(f"rollout.device={spec} but torch sees no GPU here (CUDA_VISIBLE_DEVICES="
                         f"{os.environ.get('CUDA_VISIBLE_DEVICES', '<unset>')}); "
                         "use rollout.device=auto or rollout.device=cpu")
    if device.index is not None and device.index >= torch.cuda.device_count():
        raise ValueError(f"rollout.device={spec} but only {torch.cuda.device_count()} GPU(s) are visible; "
                         "pick an index below that")
    return device.text


def sglang_python(explicit: str = "") -> str:
    """The interpreter a started SGLang server runs in; ``ValueError`` naming the fix when there is none."""
    for candidate in (explicit, os.environ.get(SGLANG_PYTHON_ENV, "")):
        if candidate:
            if not Path(candidate).exists():
                raise ValueError(f"SGLang interpreter {candidate!r} does not exist; point sglang.python (or "
                                 f"${SGLANG_PYTHON_ENV}) at the venv of docs/sglang.md")
            return candidate
    if DEFAULT_SGLANG_VENV_PYTHON.exists():
        return str(DEFAULT_SGLANG_VENV_PYTHON)
    raise ValueError("no SGLang installation: build it with `python3.11 -m venv .cache/sglang-venv && "
                     ".cache/sglang-venv/bin/pip install sglang==0.5.23` (docs/sglang.md), set sglang.python, "
                     "or attach to a running server with sglang.url=http://HOST:PORT")


def build_engine(spec: EngineSpec) -> RolloutEngine:
    """The ``RolloutEngine`` described by ``spec`` (at version -1, without policy weights yet)."""
    if spec.kind == "native":
        return _build_native(spec)
    return _build_sglang(spec)


def _build_native(spec: EngineSpec) -> RolloutEngine:
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    from asyncrl.engine.native.engine import NativeEngine

    if not spec.model_config_json:
        raise ValueError("a native engine needs the model architecture (model_config_json from the Welcome)")
    device = resolve_device(spec.device)
    cfg_dict = json.loads(spec.model_config_json)
    config = AutoConfig.for_model(cfg_dict.pop("model_type"), **cfg_dict)
    torch.manual_seed(0)  # weights are replaced by the first fetch; the seed only makes init cheap to reason about
    with torch.device(device):  # initialised where it runs: a GPU draws an 8B model's random init in seconds
        model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    return NativeEngine(model, quant_format=spec.quant_format, version=-1, device=device,
                        max_batch_size=spec.slots, max_seq_len=spec.max_seq_len or None,
                        eos_token_ids=spec.eos_token_ids, quantize_head=spec.quantize_head,
                        quantize_embedding=spec.quantize_embedding, decode_step=spec.decode_step, cuda_graphs=spec.cuda_graphs, compile_step=spec.compile_step,
                        prewarm=spec.prewarm, overlap=spec.overlap)


class _SGLangEngineArgs(TypedDict):
    """Keyword arguments of ``SGLangEngine`` shared by ``attach`` and ``launch``."""

    quant_format: str
    version: int
    max_batch_size: int
    eos_token_ids: list[int] | None


def _build_sglang(spec: EngineSpec) -> RolloutEngine:
    from asyncrl.engine.sglang.engine import SGLangEngine

    common = _SGLangEngineArgs(quant_format=spec.quant_format, version=-1, max_batch_size=spec.slots,
                               eos_token_ids=spec.eos_token_ids or None)
    sg = spec.sglang
    if sg.url:
        return SGLangEngine.attach(sg.url, **common)
    if not spec.model_path or not Path(spec.model_path).is_dir():
        raise ValueError(f"an SGLang worker starts its server from the model folder, and {spec.model_path!r} is "
                         "not a folder on this host; pass sglang.model_path=DIR (a copy of the run's model) or "
                         "attach to a server with sglang.url=http://HOST:PORT")
    device = parse_device(sg.device, key="sglang.device", indexed=False).kind
    if device == "auto":  # the server's own interpreter may see GPUs this one's torch cannot: only auto asks
        import torch

        device = "cuda" if torch.cuda.is_available() else "cpu"
    server_args: dict[str, Any] = {"extra_args": list(sg.extra_args)}
    tokens = sg.max_total_tokens or (16384 if device == "cpu" else 0)
    if tokens:
        server_args["max_total_tokens"] = tokens
    server_args["max_running_requests"] = spec.slots
    log_dir = Path(spec.log_dir) if spec.log_dir else None
    log_path = log_dir / f"sglang-{os.getpid()}.log" if log_dir else None
    return SGLangEngine.launch(spec.model_path, device=device, python=sglang_python(sg.python),
                               log_path=log_path, startup_timeout_s=sg.startup_timeout_s,
                               server_args=server_args, **common)
