"""python -m benchmarks precision MODEL BUNDLE... [--prompts N] [--out FILE.json]"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path


def main() -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks")
    sub = parser.add_subparsers(dest="command", required=True)
    precision = sub.add_parser("precision", help="bundle logits against transformers fp32")
    precision.add_argument("model", help="what the bundles were exported from (alias, folder, .gguf)")
    precision.add_argument("bundles", nargs="+")
    precision.add_argument("--prompts", type=int, default=5, help="HumanEval chat prompts, besides two raw ones")
    precision.add_argument("--out", help="write the rows as JSON here")
    args = parser.parse_args()

    from benchmarks.precision import compare

    rows = compare(args.model, args.bundles, args.prompts)
    if args.out:
        Path(args.out).write_text(json.dumps(rows, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
