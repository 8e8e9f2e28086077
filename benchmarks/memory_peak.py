"""What is live at the peak of a recorded step: reads an allocator snapshot (step.py --memory-snapshot FILE),
replays its trace to the moment the most bytes were allocated, and prints the blocks allocated since the
recording started and live then, the largest first, each with the innermost frames of the Python stack that
allocated it (for compiled code, the line of inductor's output that made the buffer).

    python3 benchmarks/memory_peak.py snapshot.pickle [--top 30] [--frames 3]
"""

import argparse
import pickle
import re
from collections import Counter

parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
parser.add_argument("snapshot")
parser.add_argument("--top", type=int, default=30)
parser.add_argument("--frames", type=int, default=3)
parser.add_argument("--device", type=int, default=0)
args = parser.parse_args()

with open(args.snapshot, "rb") as f:
    snapshot = pickle.load(f)
trace = snapshot["device_traces"][args.device]
live: dict[int, dict] = {}  # address -> the alloc event
allocated = peak = 0
peak_live: dict[int, dict] = {}
for event in trace:
    if event["action"] == "alloc":
        live[event["addr"]] = event
        allocated += event["size"]
        if allocated > peak:
            peak, peak_live = allocated, dict(live)
    elif event["action"] == "free_requested":  # a block from before the recording too
        live.pop(event["addr"], None)
        allocated -= event["size"]


def frames(event) -> str:
    shown = [f"{frame['filename'].rsplit('/', 1)[-1]}:{frame['line']} {frame['name']}"
             for frame in event.get("frames", []) if not re.search(r"(site|dist)-packages/torch/", frame["filename"])]
    return " < ".join(shown[:args.frames]) or "(no Python frame)"


gib = 2**30
print(f"recorded {len(trace)} events; the peak is {peak / gib:.3f} GiB over what was allocated when the recording "
      f"started (step.py prints it), in {len(peak_live)} blocks allocated since:")
by_site = Counter()
for event in peak_live.values():
    by_site[(event["size"], frames(event))] += 1
for (size, site), count in sorted(by_site.items(), key=lambda item: -item[0][0] * item[1])[:args.top]:
    print(f"{count:4d} x {size / 2**20:10.2f} MiB = {count * size / gib:7.3f} GiB  {site}")
