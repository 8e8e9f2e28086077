"""Write the example's instruction data set, data/tasks.jsonl, from linnet.data.synthetic_tasks.

Run from the repository root:

    PYTHONPATH=. python examples/sft/make_tasks.py

It writes 4000 alpaca-format rows (seed 0), one JSON object a line; the same
command always writes the same bytes, so the committed file can be checked.
"""

import argparse
import json
from pathlib import Path

from linnet.data.synthetic_tasks import generate

ROWS = 4000
SEED = 0


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=Path(__file__).parent / "data" / "tasks.jsonl")
    args = parser.parse_args()
    args.out.parent.mkdir(parents=True, exist_ok=True)
    # newline="\n" so the bytes do not depend on the platform.
    with open(args.out, "w", encoding="utf-8", newline="\n") as f:
        for row in generate(ROWS, SEED):
            f.write(json.dumps(row, ensure_ascii=False) + "\n")


if __name__ == "__main__":
    main()
