"""``asyncrl keys``: the command line that writes CurveZMQ key folders (``asyncrl/transport/keys.py``).

Owns: parsing ``asyncrl keys generate DIR [--clients N] [--force]`` and ``asyncrl keys add DIR NAME``,
and printing what was written and how to use it. Bad input prints the fix and returns 2.
Never: opens a socket; reads or changes a running server (servers re-read the allow-list themselves).
"""

from __future__ import annotations

import argparse
from collections.abc import Iterable
from pathlib import Path

from asyncrl.transport.keys import CLIENTS_DIR, SERVER_NAME, generate_keys


def keys_main(argv: Iterable[str] | None = None) -> int:
    """``asyncrl keys generate DIR [--clients N] [--force]`` and ``asyncrl keys add DIR NAME``."""
    ap = argparse.ArgumentParser(prog="asyncrl keys", description="CurveZMQ keys for transport.keys_dir")
    sub = ap.add_subparsers(dest="cmd", required=True)
    gen = sub.add_parser("generate", help="a server key pair and N client key pairs (allow-listed)")
    gen.add_argument("dir")
    gen.add_argument("--clients", type=int, default=1,
                     help="client key pairs: 1 makes 'client', N>1 makes client-0..client-(N-1)")
    gen.add_argument("--force", action="store_true", help="replace existing keys of the same names")
    add = sub.add_parser("add", help="one more client key pair, admitted at once by running servers")
    add.add_argument("dir")
    add.add_argument("name")
    args = ap.parse_args(list(argv) if argv is not None else None)
    try:
        if args.cmd == "generate":
            if args.clients < 1:
                raise ValueError("--clients must be >= 1")
            names = ["client"] if args.clients == 1 else [f"client-{i}" for i in range(args.clients)]
            written = generate_keys(args.dir, [SERVER_NAME, *names], overwrite=args.force)
        else:
            if not (Path(args.dir) / f"{SERVER_NAME}.key").is_file():
                raise ValueError(f"{args.dir} has no server.key; run `asyncrl keys generate {args.dir}` first")
            written = generate_keys(args.dir, [args.name])
    except ValueError as e:
        print(f"asyncrl keys: {e}")
        return 2
    root = Path(args.dir).resolve()
    for name, path in written.items():
        print(f"  {name:>12}: {path}")
    print(f"allow-list: {root / CLIENTS_DIR} (delete a .key there to revoke that client)\n"
          f"use: transport.keys_dir={root}  (a worker host needs server.key and its own <name>.key_secret)")
    return 0
