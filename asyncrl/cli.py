"""The ``asyncrl`` command line: one entry point, sub-commands dispatched lazily.

Owns argument parsing only. Each sub-command imports its implementation when it runs, so
``asyncrl --help`` stays fast and never imports torch or zmq.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable, Sequence


def _cmd_log_inspect(args: argparse.Namespace) -> int:
    from asyncrl.log.inspect import inspect_main

    return inspect_main(args.path, as_json=args.json)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="asyncrl", description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", required=True)

    log = sub.add_parser("log", help="trajectory-log tools")
    log_sub = log.add_subparsers(dest="log_command", required=True)
    insp = log_sub.add_parser("inspect", help="counts, version range, staleness histogram, rewards")
    insp.add_argument("path", help="a trajectory log file, or a run folder holding trajectories.log")
    insp.add_argument("--json", action="store_true", help="print the summary as JSON")
    insp.set_defaults(func=_cmd_log_inspect)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    func: Callable[[argparse.Namespace], int] = args.func
    return int(func(args) or 0)


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
