"""Run a real SGLang 0.5.23 server on this CPU (no GPU), in the foreground.

    .venv/bin/python scripts/sglang_cpu_server.py [--model DIR] [--port 30000] [--python PY] [-- EXTRA...]

What it does (nothing else):
  * builds the ``launch_server`` command with ``--device cpu --attention-backend torch_native
    --disable-overlap-schedule --sleep-on-idle --dtype float32`` (asyncrl.engine.sglang.server.server_command);
  * sets ``SGLANG_USE_CPU_ENGINE=1`` (SGLang's own switch for its CPU code path) and puts a package named
    ``sgl_kernel`` in front of site-packages via ``PYTHONPATH``. That package re-exports
    ``asyncrl/engine/sglang/cpu_kernels.py``: pure-torch versions of the two kernels SGLang's CPU path
    calls (``assign_req_to_token_pool_cpu``, ``copy_all_layer_kv_cache_cpu``) plus names that raise when
    called (speculative decoding, AMX). The PyPI ``sglang-kernel`` wheel is a CUDA build that cannot be
    imported without ``libcuda.so.1``. No installed file is changed;
  * ``exec``s the server, so this process *is* the server (same PID: end it by that PID).

``--python`` (or ``$ASYNCRL_SGLANG_PYTHON``) is the interpreter with ``sglang==0.5.23`` installed, by
default ``.cache/sglang-venv/bin/python`` (see docs/sglang.md for how to build that venv). ``--model``
defaults to the embedded tiny Qwen2 (``asyncrl.models.ensure_tiny_model``).
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

from asyncrl.engine.sglang.server import REPO_ROOT, SGLANG_PYTHON_ENV, cpu_env, server_command

DEFAULT_PYTHON = REPO_ROOT / ".cache" / "sglang-venv" / "bin" / "python"


def main(argv: list[str] | None = None) -> None:
    argv = list(sys.argv[1:] if argv is None else argv)
    extra = argv[argv.index("--") + 1 :] if "--" in argv else []
    argv = argv[: argv.index("--")] if "--" in argv else argv
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=None, help="HF folder (default: the embedded tiny Qwen2)")
    ap.add_argument("--host", default="127.0.0.1")
    ap.add_argument("--port", type=int, default=30000)
    ap.add_argument("--python", default=os.environ.get(SGLANG_PYTHON_ENV) or str(DEFAULT_PYTHON))
    ap.add_argument("--version", type=int, default=0, help="initial weight version")
    ap.add_argument("--max-total-tokens", type=int, default=16384, help="KV cache size in tokens")
    ap.add_argument("--dtype", choices=("fp32", "bf16"), default="fp32")
    ap.add_argument(
        "--print-command", action="store_true", help="print the command and environment, do not run"
    )
    args = ap.parse_args(argv)
    if not Path(args.python).exists():
        raise SystemExit(
            f"no SGLang interpreter at {args.python}; build it (docs/sglang.md, 'CPU run') or pass --python"
        )
    model = args.model
    if model is None:
        from asyncrl.models import ensure_tiny_model

        model = str(ensure_tiny_model())
    cmd = server_command(
        model,
        python=args.python,
        host=args.host,
        port=args.port,
        device="cpu",
        quant_format=args.dtype,
        weight_version=args.version,
        max_total_tokens=args.max_total_tokens,
        extra_args=extra,
    )
    env = cpu_env(shim_dir=REPO_ROOT / ".cache" / "sglang-cpu-shim")
    if args.print_command:
        print("PYTHONPATH=" + env["PYTHONPATH"], "SGLANG_USE_CPU_ENGINE=1", " ".join(cmd))
        return
    sys.stdout.flush()
    os.execvpe(cmd[0], cmd, env)


if __name__ == "__main__":
    main()
