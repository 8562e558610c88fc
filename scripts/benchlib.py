"""Shared plumbing of the bench_*.py scripts: the --quick/--json convention and the printed table.

Every benchmark prints one table whose key column is a ratio measured in the same run, and writes
the same rows as JSON (``--json PATH``; default ``benchmarks/results/<name>.json``) together with
the machine and the command, so a figure in docs/benchmarks.md can be traced to its run.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import subprocess
import sys
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent


def parser(name: str, description: str, *, smoke: bool = False) -> argparse.ArgumentParser:
    """The shared options. ``smoke=True`` adds ``--smoke``: the smallest run that exercises every code
    path of the script (seconds to a minute; its figures mean nothing), used by the tests."""
    p = argparse.ArgumentParser(prog=f"{name}.py", description=description,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--quick", action="store_true", help="a run of a minute or two (smaller sizes, fewer repeats)")
    if smoke:
        p.add_argument("--smoke", action="store_true",
                       help="smallest run that exercises every code path (tests; figures are meaningless)")
    p.add_argument("--json", metavar="PATH", default=str(ROOT / "benchmarks" / "results" / f"{name}.json"),
                   help="write the table as JSON here (default: %(default)s)")
    return p


def machine() -> dict[str, Any]:
    try:
        commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True,
                                text=True, check=False).stdout.strip()
    except OSError:
        commit = ""
    return {"platform": platform.platform(), "python": platform.python_version(), "cpus": os.cpu_count(),
            "processor": platform.processor(), "commit": commit}


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
