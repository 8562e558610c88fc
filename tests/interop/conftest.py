"""Interop tier: installs the peer project at test time into a private folder and runs it.

``areal==1.0.4`` is installed with ``--no-deps`` into ``.cache/interop-site`` (gitignored),
together with exactly the packages that ``import areal.utils.functional`` needs (the import
closure of ``areal/__init__`` -> ``areal.infra`` -> ... -> ``utils.functional``), each pinned, none
of them torch. The folder is reused while its stamp matches the pinned list. Any failure to
install or import fails the test session loudly (``pytest.fail`` with pip's output); it never
skips.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from tests.conftest import ProcessTracker

ROOT = Path(__file__).resolve().parents[2]
SITE = ROOT / ".cache" / "interop-site"
AREAL = "areal==1.0.4"
# The import closure of ``import areal.utils.functional`` on top of this project's own pinned
# dependencies (torch, transformers, numpy, pydantic, hydra, ... come from the project venv).
# areal/__init__ imports areal.infra (launchers, schedulers: aiohttp, flask, httpx, ray, uvloop),
# areal.api.cli_args imports areal.utils.name_resolve (``@ray.remote`` at module level), and
# areal.utils.data imports torchdata, einops and areal.utils.seqpack (numba).
CLOSURE = (
    "aiofiles==25.1.0",
    "aiohappyeyeballs==2.7.1",
    "aiohttp==3.14.5",
    "aiosignal==1.4.0",
    "attrs==26.1.0",
    "blinker==1.9.0",
    "certifi==2026.10.19.post1",
    "colorlog==6.12.0",
    "einops==0.8.2",
    "flask==3.1.3",
    "frozenlist==1.8.0",
    "httpx==0.28.1",
    "itsdangerous==2.2.0",
    "jiter==0.19.0",
    "jsonschema==4.26.0",
    "jsonschema-specifications==2025.9.1",
    "lark==1.3.1",
    "llvmlite==0.50.0",
    "msgpack==1.2.4",
    "multidict==7.2.1",
    "numba==0.68.1",
    "openai==3.57.0",
    "orjson==3.13.0",
    "propcache==0.5.4",
    "ray==2.60.0",
    "referencing==0.37.0",
    "requests==2.34.2",
    "rpds-py==2026.9.1",
    "sniffio==1.3.1",
    "tenacity==9.2.1",
    "torchdata==0.11.0",
    "urllib3==2.8.0",
    "uvloop==0.23.0",
    "yarl==1.25.1",
)
REQUIREMENTS = (AREAL, *CLOSURE)
INSTALL_TIMEOUT_S = 900


def _run(tracker: ProcessTracker, args: list[str], timeout: float) -> tuple[int, str]:
    proc = tracker.spawn(args, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        out, _ = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        proc.kill()
        out, _ = proc.communicate()
        return -1, f"timed out after {timeout}s\n{out}"
    return proc.returncode, out


def _install(tracker: ProcessTracker) -> None:
    stamp = SITE / ".requirements"
    wanted = "\n".join(REQUIREMENTS) + "\n"
    if stamp.exists() and stamp.read_text() == wanted:
        return
    tmp = SITE.with_name(SITE.name + f".tmp-{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    cmd = [
        sys.executable,
        "-m",
        "pip",
        "install",
        "--disable-pip-version-check",
        "--no-deps",
        "--target",
        str(tmp),
        "-c",
        str(ROOT / "constraints.txt"),
        *REQUIREMENTS,
    ]
    rc, out = _run(tracker, cmd, INSTALL_TIMEOUT_S)
    if rc != 0:
        shutil.rmtree(tmp, ignore_errors=True)
        pytest.fail(
            f"could not install {AREAL} for the interop tier (exit {rc}):\n$ {' '.join(cmd)}\n{out}",
            pytrace=False,
        )
    if (tmp / "torch").exists():
        pytest.fail(
            "the interop install pulled in torch; it must use the project's torch only", pytrace=False
        )
    (tmp / ".requirements").write_text(wanted)
    shutil.rmtree(SITE, ignore_errors=True)
    SITE.parent.mkdir(parents=True, exist_ok=True)
    os.replace(tmp, SITE)


@pytest.fixture(scope="session")
def areal_site() -> Path:
    """Path of the private install (appended to sys.path by the oracle process, never by pytest)."""
    tracker = ProcessTracker()
    try:
        _install(tracker)
    finally:
        tracker.stop_all()
    return SITE


@pytest.fixture(scope="session")
def run_areal(areal_site, tmp_path_factory):
    """``run_areal(cases) -> (results, info)``: AReaL's loss and gradient for every case."""
    import json

    import torch

    def run(cases: dict) -> tuple[dict, dict]:
        d = tmp_path_factory.mktemp("areal")
        cases_path, out_path = d / "cases.pt", d / "results.pt"
        torch.save(cases, cases_path)
        tracker = ProcessTracker()
        try:
            cmd = [
                sys.executable,
                str(Path(__file__).with_name("areal_oracle.py")),
                str(areal_site),
                str(cases_path),
                str(out_path),
            ]
            rc, out = _run(tracker, cmd, 600)
        finally:
            tracker.stop_all()
        if rc != 0:
            pytest.fail(
                f"importing or running areal.utils.functional failed (exit {rc}):\n{out}", pytrace=False
            )
        info = json.loads(out.strip().splitlines()[-1])
        return torch.load(out_path), info

    return run
