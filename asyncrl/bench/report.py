"""A benchmark's command line and output: the --quick/--smoke/--json convention and the printed table.

Every benchmark prints one table whose key column is a ratio measured in the same run, and writes
the same rows as JSON (``--json PATH``; default ``benchmarks/results/<name>.json``) together with
the machine and the command, so a figure in docs/benchmarks.md can be traced to its run.

Owns: the shared options (``parser``, ``comma_list``), the table's format, the JSON document's keys
(``write_json``) and the record of the machine and commit (``machine``). Never: measures anything or starts
a process but ``git`` (for the commit).
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import subprocess
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from asyncrl.machine import cpu_model, describe, machine_record

ROOT = Path(__file__).resolve().parents[2]
"""The repository root: benchmarks run from a checkout (results, caches and scripts are found from it)."""
_LOADAVG_AT_START = list(os.getloadavg())  # the machine is shared: record how busy it was


def parser(name: str, doc: str | None, *, smoke: bool = False) -> argparse.ArgumentParser:
    """The shared options of script ``name``, whose docstring ``doc`` is the help (its first paragraph the
    description, the rest the epilog). ``smoke=True`` adds ``--smoke``: the smallest run that exercises every
    code path of the script (seconds to a minute; its figures mean nothing), used by the tests."""
    description, _, epilog = (doc or "").partition("\n\n")
    p = argparse.ArgumentParser(prog=f"{name}.py", description=description, epilog=epilog or None,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--quick", action="store_true", help="a run of a minute or two (smaller sizes, fewer repeats)")
    if smoke:
        p.add_argument("--smoke", action="store_true",
                       help="smallest run that exercises every code path (tests; figures are meaningless)")
    p.add_argument("--json", metavar="PATH", default=str(ROOT / "benchmarks" / "results" / f"{name}.json"),
                   help="write the table as JSON here (default: %(default)s)")
    return p


def comma_list(text: str, option: str = "", choices: Sequence[str] | None = None) -> list[str]:
    """The items of a comma-separated option; ``SystemExit`` naming ``option`` for an item not in ``choices``."""
    items = [x for x in text.split(",") if x]
    bad = [x for x in items if choices is not None and x not in choices]
    if bad:
        raise SystemExit(f"{option}: unknown {bad}; choose from {', '.join(choices or ())}")
    return items


def machine() -> dict[str, Any]:
    """Where the numbers come from: the CPU's model, cores and the ISA flags the numerics choose by
    (asyncrl/machine.py), and the commit. ``commit`` is HEAD of the checkout the script runs from, with
    ``dirty`` true when tracked files differ from it; a snapshot exported with ``git archive`` (no ``.git``;
    used to benchmark a fixed commit while others edit the shared checkout) names its commit in
    ``$ASYNCRL_BENCH_COMMIT``."""
    def git(*args: str) -> str:
        try:
            out = subprocess.run(["git", *args], cwd=ROOT, capture_output=True, text=True, check=False)
        except OSError:
            return ""
        return out.stdout.strip() if out.returncode == 0 else ""

    commit = git("rev-parse", "--short", "HEAD")
    dirty = bool(git("status", "--porcelain", "--untracked-files=no")) if commit else False
    if not commit:
        commit = os.environ.get("ASYNCRL_BENCH_COMMIT", "")
    return {"platform": platform.platform(), "python": platform.python_version(), "cpus": os.cpu_count(),
            "processor": cpu_model(), **machine_record(), "commit": commit, "dirty": dirty,
            "loadavg_at_start": _LOADAVG_AT_START, "loadavg_at_write": list(os.getloadavg())}


def print_table(title: str, rows: list[dict[str, Any]], columns: list[str]) -> None:
    def fmt(v: Any) -> str:
        if isinstance(v, float):
            return f"{v:.4g}" if abs(v) < 1e5 else f"{v:.3e}"
        return str(v)

    cells = [[fmt(r.get(c, "")) for c in columns] for r in rows]
    widths = [max(len(c), *(len(row[i]) for row in cells)) for i, c in enumerate(columns)]
    print(f"\n{title}")
    print("  ".join(c.ljust(w) for c, w in zip(columns, widths, strict=True)))
    print("  ".join("-" * w for w in widths))
    for row in cells:
        print("  ".join(v.ljust(w) for v, w in zip(row, widths, strict=True)))


def write_json(path: str, name: str, tables: dict[str, list[dict[str, Any]]], args: argparse.Namespace,
               **extra: Any) -> None:
    out = {"benchmark": name, "date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
           "command": " ".join([Path(sys.argv[0]).name, *sys.argv[1:]]), "quick": bool(args.quick),
           "smoke": bool(getattr(args, "smoke", False)),
           "machine": machine(), "tables": tables, **extra}
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    Path(path).write_text(json.dumps(out, indent=2))
    print(f"\nwrote {path}")
    print(f"measured on {describe()}; the CPU int8 kernel here: {cpu_int8_kernel()}")


def cpu_int8_kernel() -> str:
    """The int8 kernel a CPU linear runs here, named with why (asyncrl/quant/kernels.py)."""
    import torch

    from asyncrl.quant.cpu_int8 import kernel_status
    from asyncrl.quant.kernels import select_kernel

    kernel = select_kernel("int8", torch.device("cpu"), 64, 64)
    why = {"int_mm": "torch._int_mm", "int_mm_avx2": "no int8 dot product; the AVX2 kernel",
           "int_mm_fp32": f"no int8 dot product; no AVX2 kernel: {kernel_status() or 'no avx2 among the flags'}"}
    return f"{kernel} ({why[kernel]})"
