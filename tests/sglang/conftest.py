"""Fixtures for the suites that run against a REAL SGLang 0.5.23 server (marker ``sglang``).

Where the server comes from, first match wins:
  * ``ASYNCRL_SGLANG_URL=http://host:port``: a running server that serves the embedded tiny model (its
    weights are reset from the tiny model folder before every engine, so it must be able to read it);
  * an interpreter with SGLang installed: ``ASYNCRL_SGLANG_PYTHON`` or ``.cache/sglang-venv/bin/python``.
    One server is launched for the session (``ASYNCRL_SGLANG_DEVICE``: ``cpu`` by default, which uses
    asyncrl's CPU setup, see scripts/sglang_cpu_server.py; ``cuda`` adds ``--attention-backend triton
    --enable-deterministic-inference`` so the seeded contract tests run too) and ended by its PID;
  * neither: every test here is skipped with the command that builds the venv.

Nothing here fakes a server: without SGLang the tests skip.
"""

from __future__ import annotations

import importlib.util
import os
from pathlib import Path

import pytest

from asyncrl.engine.sglang.engine import SGLangEngine
from asyncrl.engine.sglang.http import SGLangHTTP
from asyncrl.engine.sglang.server import (
    SGLANG_PYTHON_ENV,
    SGLangServerProcess,
    cpu_env,
    free_port,
    server_command,
)

REPO = Path(__file__).resolve().parents[2]
DEFAULT_PYTHON = REPO / ".cache" / "sglang-venv" / "bin" / "python"
SKIP_REASON = (
    "no SGLang server: set ASYNCRL_SGLANG_URL, or build the SGLang venv "
    "(python3.11 -m venv .cache/sglang-venv && .cache/sglang-venv/bin/pip install sglang==0.5.23; docs/sglang.md)"
)


def _load(name: str, path: Path):
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


# The native engine's fixtures (tiny model, HF references) are reused as they are.
_unit = _load("asyncrl_engine_unit_conftest", REPO / "tests" / "unit" / "engine" / "conftest.py")
tiny_dir = _unit.tiny_dir
tiny_hf = _unit.tiny_hf
tiny_hf_v1 = _unit.tiny_hf_v1
reference = _unit.reference
logp_atol = _unit.logp_atol
ref_v0 = _unit.ref_v0
ref_v1 = _unit.ref_v1


def sglang_python() -> str | None:
    py = os.environ.get(SGLANG_PYTHON_ENV) or (str(DEFAULT_PYTHON) if DEFAULT_PYTHON.exists() else None)
    return py if py and Path(py).exists() else None


@pytest.fixture(scope="session")
def sglang_python_path() -> str:
    """Interpreter with SGLang installed (skips without one)."""
    python = sglang_python()
    if python is None:
        pytest.skip(SKIP_REASON)
    return python


@pytest.fixture(scope="session")
def sglang_device() -> str:
    return os.environ.get("ASYNCRL_SGLANG_DEVICE", "cpu")


@pytest.fixture(scope="session")
def sglang_url(tiny_dir, sglang_device, tmp_path_factory):
    """URL of a real SGLang server serving the tiny model (launched once per session if needed)."""
    url = os.environ.get("ASYNCRL_SGLANG_URL")
    if url:
        yield url
        return
    python = sglang_python()
    if python is None:
        pytest.skip(SKIP_REASON)
    gpu = (
        {}
        if sglang_device == "cpu"
        else {"deterministic": True, "extra_args": ["--attention-backend", "triton"]}
    )
    argv = server_command(
        tiny_dir, python=python, port=free_port(), device=sglang_device, max_total_tokens=16384, **gpu
    )
    env = cpu_env(shim_dir=tmp_path_factory.mktemp("sglang-shim")) if sglang_device == "cpu" else None
    log = tmp_path_factory.mktemp("sglang-log") / "server.log"
    server = SGLangServerProcess(argv, env=env, log_path=log)
    try:
        server.wait_ready(timeout_s=float(os.environ.get("ASYNCRL_SGLANG_STARTUP_S", "600")))
        yield server.url
    finally:
        server.stop()


def reset_weights(url: str, model_dir: Path) -> None:
    """Load the tiny model's v0 weights from disk (idle server; the next engine sets the version)."""
    SGLangHTTP(url, timeout_s=120).post(
        "/update_weights_from_disk", {"model_path": str(model_dir), "weight_version": "0"}
    )


@pytest.fixture(params=[("sglang", "fp32")], ids="-".join)
def engine_case(request) -> tuple[str, str]:
    return request.param


@pytest.fixture
def make_engine(sglang_url, tiny_dir, engine_case):
    """``make_engine(**kwargs)``: a fresh SGLangEngine on the session's server, weights reset to v0."""
    engines: list[SGLangEngine] = []

    def build(**kwargs) -> SGLangEngine:
        for engine in engines:  # one engine at a time drives the shared server
            engine.close()
        reset_weights(sglang_url, tiny_dir)
        kwargs.pop("quant_format", None)
        engine = SGLangEngine.attach(sglang_url, request_timeout_s=120, control_timeout_s=120, **kwargs)
        engines.append(engine)
        return engine

    yield build
    for engine in engines:
        engine.close()
