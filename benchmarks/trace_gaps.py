"""Where the compute stream waits, from a torch.profiler Chrome trace (step.py --profile) or the
Perfetto trace of jax.profiler (step_jax.py --profile):

    python3 benchmarks/trace_gaps.py FOLDER/trace.json.gz [--top 20]
    python3 benchmarks/trace_gaps.py FOLDER/perfetto_trace.json.gz [--top 20]

Prints, per CUDA stream, its kernels' busy time in the traced window; for the stream with the
most kernels (the compute stream), its idle time and the largest gaps, each with the kernels on
either side and which other streams were busy during it (the simulated world's sleeps are
communication). What a step leaves exposed is the compute stream's idle time."""

from __future__ import annotations

import argparse
import collections
import gzip
import itertools
import json


def kernels(path: str) -> list[dict]:
    """The GPU's kernels, each with args["stream"]: torch.profiler's are "kernel" events; jax.profiler's
    are the complete events of a "/device:GPU:N" process's "Stream #N(...)" threads."""
    with (gzip.open if path.endswith(".gz") else open)(path, "rt") as f:
        events = json.load(f)["traceEvents"]
    found = [e for e in events if e.get("cat") == "kernel" and "dur" in e]
    if not found:
        def metadata(kind: str, prefix: str) -> list[dict]:
            return [e for e in events if e.get("ph") == "M" and e.get("name") == kind
                    and e.get("args", {}).get("name", "").startswith(prefix)]

        gpus = {e["pid"] for e in metadata("process_name", "/device:GPU")}
        # A stream's thread is "Stream #14(Compute)", tid 14; tracks derived from them (XLA Ops, Steps) are not kernels.
        streams = {(e["pid"], e["tid"]) for e in metadata("thread_name", "Stream") if e["pid"] in gpus}
        found = [{**e, "args": {**e.get("args", {}), "stream": e["tid"]}} for e in events
                 if e.get("ph") == "X" and (e.get("pid"), e.get("tid")) in streams and "dur" in e]
    return sorted(found, key=lambda e: e["ts"])


def busy(intervals: list[tuple[float, float]]) -> float:
    total, end = 0.0, float("-inf")
    for start, stop in sorted(intervals):
        if stop > end:
            total += stop - max(start, end)
            end = stop
    return total


def main():
    p = argparse.ArgumentParser()
    p.add_argument("trace")
    p.add_argument("--top", type=int, default=20)
    a = p.parse_args()
    found = kernels(a.trace)
    streams = collections.defaultdict(list)
    for e in found:
        streams[e["args"].get("stream")].append(e)
    window = (found[0]["ts"], max(e["ts"] + e["dur"] for e in found))
    span = window[1] - window[0]
    print(f"traced window {span / 1e3:.1f} ms, {len(found)} kernels")
    for stream, es in sorted(streams.items(), key=lambda kv: -sum(e["dur"] for e in kv[1])):
        print(f"  stream {stream}: {len(es)} kernels, "
              f"busy {busy([(e['ts'], e['ts'] + e['dur']) for e in es]) / 1e3:.1f} ms")
    compute = max(streams, key=lambda s: len(streams[s]))  # the most kernels: a sleep is one long kernel
    es = streams[compute]
    others = [(e["ts"], e["ts"] + e["dur"]) for s, x in streams.items() if s != compute for e in x]
    gaps = []
    for before, after in itertools.pairwise(es):
        start, stop = before["ts"] + before["dur"], after["ts"]
        if stop > start:
            overlapped = busy([(max(s, start), min(t, stop)) for s, t in others if t > start and s < stop])
            gaps.append((stop - start, overlapped, before["name"], after["name"], start - window[0]))
    idle = sum(g[0] for g in gaps)
    print(f"compute stream {compute}: idle {idle / 1e3:.1f} ms of {span / 1e3:.1f} "
          f"({sum(1 for g in gaps if g[0] > 50)} gaps over 50 us, {sum(g[0] for g in gaps if g[0] > 50) / 1e3:.1f} ms)")
    for length, overlapped, before, after, at in sorted(gaps, reverse=True)[:a.top]:
        print(f"  {length / 1e3:7.3f} ms at {at / 1e3:8.2f} ms (other streams busy {overlapped / 1e3:.3f})  "
              f"after {before[:60]!r}  before {after[:60]!r}")
    by_name = collections.Counter()
    for e in es:
        by_name[e["name"][:80]] += e["dur"]
    print("compute stream's kernels by time:")
    for name, dur in by_name.most_common(a.top):
        print(f"  {dur / 1e3:8.2f} ms  {name}")


if __name__ == "__main__":
    main()
