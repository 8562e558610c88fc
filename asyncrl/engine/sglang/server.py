"""Starting, waiting for and stopping one SGLang server process for a generation worker.

Owns: the ``python -m sglang.launch_server`` command line (only flags of SGLang 0.5.23's own argument
parser), the environment of a CPU run (``SGLANG_USE_CPU_ENGINE=1`` plus asyncrl's pure-torch stand-in for
the CUDA-only ``sgl_kernel`` wheel, put in front of site-packages through ``PYTHONPATH``), the readiness
wait, and ending the process: SIGTERM to its PID, then SIGKILL to the process group the launcher created
for it (``start_new_session=True``, so that group holds exactly the server and its scheduler/detokenizer
children).

Must never: kill anything it did not start (no lookup by name), patch files of the SGLang installation,
or import SGLang/torch (the server runs in its own interpreter, usually another venv: SGLang 0.5.23 pins
torch 2.14.1 while asyncrl's base install uses another torch).

Invariants: ``stop()`` is idempotent and returns within ``grace_s`` + 5 s; ``wait_ready`` returns only
after ``/health_generate`` answered 200 (the server generated a token), and raises with the tail of the
server log when the process exits or the deadline passes.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from asyncrl.constants import STARTUP_TIMEOUT_S
from asyncrl.engine.sglang.http import SGLangError, SGLangHTTP, SGLangUnavailableError

REPO_ROOT = Path(__file__).resolve().parents[3]
SGLANG_PYTHON_ENV = "ASYNCRL_SGLANG_PYTHON"
"""Interpreter with SGLang installed (e.g. ``.cache/sglang-venv/bin/python``); default: this one."""

# Serving modes: asyncrl quant_format -> SGLang flags (verified against SGLang 0.5.23's arg parser).
SERVING_FLAGS: dict[str, tuple[str, ...]] = {
    "fp32": ("--dtype", "float32"),
    "bf16": ("--dtype", "bfloat16"),
    # FP8 weights quantized on load; later full-precision updates are re-quantized on load
    # (QuantizedRLModelLoader, Qwen2/Qwen3 only; GPU kernels).
    "fp8": ("--dtype", "bfloat16", "--quantization", "fp8", "--load-format", "flash_rl"),
}
CPU_FLAGS = ("--device", "cpu", "--attention-backend", "torch_native", "--disable-overlap-schedule", "--sleep-on-idle")
"""A CPU server's flags. ``--sleep-on-idle``: an idle scheduler waits on its sockets (woken by the next request)
instead of spinning, which otherwise holds a whole core of a CPU that the learner and other workers share."""
_SHIM_INIT = '''"""sgl_kernel stand-in written by asyncrl (asyncrl/engine/sglang/server.py); see its cpu_kernels.py."""
from asyncrl.engine.sglang.cpu_kernels import *  # noqa: F401,F403
from asyncrl.engine.sglang.cpu_kernels import __getattr__, __version__  # noqa: F401
'''


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port that was free a moment ago on ``host`` (the server binds it shortly after)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind((host, 0))
        return int(sock.getsockname()[1])


def server_command(
    model_path: str | Path,
    *,
    python: str | None = None,
    host: str = "127.0.0.1",
    port: int,
    device: str = "cuda",
    quant_format: str = "fp32",
    weight_version: int = 0,
    random_seed: int = 0,
    max_running_requests: int | None = None,
    max_total_tokens: int | None = None,
    disable_radix_cache: bool = True,
    deterministic: bool = False,
    extra_args: Sequence[str] = (),
) -> list[str]:
    """The ``launch_server`` argv for one worker's server.

    ``disable_radix_cache`` (default on): a prefix cached under old weights would otherwise be reused by a
    request admitted after a weight update, so its first tokens would carry the new version while their
    prompt K/V came from the old weights. ``deterministic`` adds ``--enable-deterministic-inference``,
    without which SGLang ignores ``sampling_seed`` (it needs a GPU attention backend: fa3/triton/flashinfer).
    """
    if quant_format not in SERVING_FLAGS:
        raise ValueError(
            f"SGLang serving mode quant_format={quant_format!r} is not supported; choose one of "
            f"{tuple(SERVING_FLAGS)} (fp8 = --quantization fp8 --load-format flash_rl, GPU only)"
        )
    if device == "cpu" and quant_format == "fp8":
        raise ValueError("SGLang's FP8 kernels need a GPU; on device='cpu' use quant_format='fp32' or 'bf16'")
    if device == "cpu" and deterministic:
        raise ValueError(
            "--enable-deterministic-inference needs a GPU attention backend (fa3/triton/flashinfer) in "
            "SGLang 0.5.23; on device='cpu' set deterministic=False (sampling is then unseeded)"
        )
    cmd = [python or os.environ.get(SGLANG_PYTHON_ENV) or sys.executable, "-m", "sglang.launch_server"]
    cmd += ["--model-path", str(model_path), "--host", host, "--port", str(port)]
    cmd += ["--weight-version", str(int(weight_version)), "--random-seed", str(int(random_seed))]
    cmd += list(SERVING_FLAGS[quant_format])
    if device == "cpu":
        cmd += list(CPU_FLAGS)
    elif device != "cuda":
        cmd += ["--device", device]
    if max_running_requests is not None:
        cmd += ["--max-running-requests", str(int(max_running_requests))]
    if max_total_tokens is not None:
        cmd += ["--max-total-tokens", str(int(max_total_tokens))]
    if disable_radix_cache:
        cmd.append("--disable-radix-cache")
    if deterministic:
        cmd.append("--enable-deterministic-inference")
    return cmd + list(extra_args)


def cpu_env(base: dict[str, str] | None = None, shim_dir: str | Path | None = None) -> dict[str, str]:
    """Environment for a CPU server: ``SGLANG_USE_CPU_ENGINE=1`` and the ``sgl_kernel`` stand-in on the path.

    The stand-in package is written to ``shim_dir`` (default: a fresh temporary folder); it only re-exports
    ``asyncrl.engine.sglang.cpu_kernels``, so the repository root is put on ``PYTHONPATH`` too.
    """
    env = dict(os.environ if base is None else base)
    root = Path(shim_dir) if shim_dir is not None else Path(tempfile.mkdtemp(prefix="asyncrl-sglcpu-"))
    pkg = root / "sgl_kernel"
    pkg.mkdir(parents=True, exist_ok=True)
    (pkg / "__init__.py").write_text(_SHIM_INIT)
    paths = [str(root), str(REPO_ROOT)] + [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p]
    env["PYTHONPATH"] = os.pathsep.join(paths)
    env["SGLANG_USE_CPU_ENGINE"] = "1"
    env.setdefault("OMP_NUM_THREADS", "1")
    return env


class SGLangServerProcess:
    """One SGLang server started by asyncrl; ended by its PID (and the process group made for it)."""

    def __init__(
        self, argv: Sequence[str], *, env: dict[str, str] | None = None, log_path: str | Path
    ) -> None:
        self.argv = list(argv)
        host = self.argv[self.argv.index("--host") + 1]
        port = int(self.argv[self.argv.index("--port") + 1])
        self.url = f"http://{host}:{port}"
        self.log_path = Path(log_path)
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        with open(self.log_path, "ab") as log:
            self.proc = subprocess.Popen(
                self.argv, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True
            )
        self.pid = self.proc.pid

    def log_tail(self, lines: int = 30) -> str:
        try:
            return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-lines:])
        except OSError:
            return "(no log)"

    def wait_ready(self, timeout_s: float = STARTUP_TIMEOUT_S, poll_s: float = 0.5) -> None:
        """Block until the server generates (``/health_generate`` 200); raise ``SGLangError`` otherwise."""
        client = SGLangHTTP(self.url, timeout_s=30.0)
        deadline = time.monotonic() + timeout_s
        while True:
            if not self.alive():
                self.stop()
                raise SGLangError(
                    f"SGLang server (pid {self.pid}) exited with code {self.proc.returncode} before it was ready. "
                    f"Log {self.log_path}, last lines:\n{self.log_tail()}"
                )
            try:
                status, _ = client.request("GET", "/health_generate", timeout=30.0)
                if status == 200:
                    return
            except SGLangUnavailableError:
                pass
            if time.monotonic() > deadline:
                self.stop()
                raise SGLangError(
                    f"SGLang server (pid {self.pid}) not ready after {timeout_s:.0f} s; raise startup_timeout_s "
                    f"or see the log {self.log_path}, last lines:\n{self.log_tail()}"
                )
            time.sleep(poll_s)

    def alive(self) -> bool:
        """Whether the server process is still running (an exited one is not reaped here, see ``stop``)."""
        if self.proc.returncode is not None:
            return False
        try:
            info = os.waitid(os.P_PID, self.pid, os.WEXITED | os.WNOHANG | os.WNOWAIT)
        except ChildProcessError:
            return False
        return info is None

    def stop(self, grace_s: float = 10.0) -> None:
        """SIGTERM the server's PID; then SIGKILL the process group created for it, which still holds its
        scheduler/detokenizer children. The group's first process is reaped only after that, so its PID
        (= the group id) cannot have been reused by another process when the group is signalled. Idempotent."""
        if self.proc.returncode is not None:
            return
        if self.alive():
            self.proc.send_signal(signal.SIGTERM)
            deadline = time.monotonic() + grace_s
            while self.alive() and time.monotonic() < deadline:
                time.sleep(0.05)
        try:
            os.killpg(self.pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass
        self.proc.wait(timeout=5)


def start_server(
    model_path: str | Path,
    *,
    device: str = "cuda",
    quant_format: str = "fp32",
    version: int = 0,
    python: str | None = None,
    host: str = "127.0.0.1",
    port: int | None = None,
    log_path: str | Path | None = None,
    startup_timeout_s: float = STARTUP_TIMEOUT_S,
    server_args: dict[str, Any] | None = None,
) -> SGLangServerProcess:
    """Start a server for one worker (``device="cpu"`` adds the CPU environment, ``cpu_env``) and wait
    until it generates; a server that does not get ready is stopped before the error propagates.

    ``server_args`` go to ``server_command`` (e.g. ``max_total_tokens``, ``deterministic``,
    ``extra_args``); ``port`` defaults to a free one; the log goes to ``log_path`` (default
    ``/tmp/asyncrl-sglang-<port>.log``)."""
    port = port or free_port(host)
    if Path(model_path).exists():
        model_path = Path(model_path).resolve()
    argv = server_command(
        model_path,
        python=python,
        host=host,
        port=port,
        device=device,
        quant_format=quant_format,
        weight_version=version,
        **(server_args or {}),
    )
    env = cpu_env() if device == "cpu" else None
    log = Path(log_path) if log_path else Path(f"/tmp/asyncrl-sglang-{port}.log")
    proc = SGLangServerProcess(argv, env=env, log_path=log)
    try:
        proc.wait_ready(startup_timeout_s)
    except BaseException:
        proc.stop()
        raise
    return proc
