"""The kernels that take a traced step's time, by full name, from a torch.profiler Chrome trace (step.py
--profile): each kernel's total, count and mean over the traced window, the largest first. With --sources
DIR (inductor's cache: TORCHINDUCTOR_CACHE_DIR), each listed Triton kernel's source is copied from the file
of DIR that defines it into --out, so that what a slow fused kernel computes can be read.

    python3 benchmarks/top_kernels.py FOLDER/trace.json.gz [--top 30] [--sources DIR --out FOLDER]
"""

from __future__ import annotations

import argparse
import collections
import os
import re

from trace_gaps import kernels


def triton_source(name: str, sources: str) -> str | None:
    """The `def name(` block and the decorator lines above it, from the first file under `sources` holding it."""
    pattern = re.compile(rf"^((?:@.*\n)*)def {re.escape(name)}\(.*?(?=^\S|\Z)", re.M | re.S)
    for folder, _, files in os.walk(sources):
        for file in files:
            if not file.endswith(".py"):
                continue
            with open(os.path.join(folder, file), errors="replace") as f:
                text = f.read()
            if f"def {name}(" in text:
                found = pattern.search(text)
                return f"# from {os.path.join(folder, file)}\n" + (found.group(0) if found else text)
    return None


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("trace")
    parser.add_argument("--top", type=int, default=30)
    parser.add_argument("--sources", help="inductor's cache folder, to copy the listed Triton kernels' sources from")
    parser.add_argument("--out", help="where the sources go (with --sources)")
    args = parser.parse_args()
    found = kernels(args.trace)
    total, count = collections.Counter(), collections.Counter()
    for event in found:
        total[event["name"]] += event["dur"]
        count[event["name"]] += 1
    window = max(e["ts"] + e["dur"] for e in found) - found[0]["ts"]
    print(f"traced window {window / 1e3:.1f} ms; kernel time {sum(total.values()) / 1e3:.1f} ms")
    for name, microseconds in total.most_common(args.top):
        print(f"{microseconds / 1e3:9.3f} ms {count[name]:5d} x {microseconds / count[name]:9.1f} us  {name[:160]}")
        if args.sources and name.startswith("triton_"):
            source = triton_source(name, args.sources)
            if source is not None and args.out:
                os.makedirs(args.out, exist_ok=True)
                with open(os.path.join(args.out, f"{name[:120]}.py"), "w") as f:
                    f.write(source)


if __name__ == "__main__":
    main()
