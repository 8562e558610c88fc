"""Build the embedded tiny character-level (byte-level) Qwen2 as a Hugging Face folder.

Deterministic: the same --seed writes the same bytes. Nothing is downloaded.

    python scripts/make_tiny_model.py --out runs/models/tiny
"""

from __future__ import annotations

import argparse
import sys


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--out", required=True, help="folder to create (must be absent or empty)")
    parser.add_argument("--seed", type=int, default=0, help="initialisation seed (default 0)")
    args = parser.parse_args(argv)

    from asyncrl.models import ensure_tiny_model

    folder = ensure_tiny_model(args.out, seed=args.seed)
    print(folder)
    return 0


if __name__ == "__main__":
    sys.exit(main())
