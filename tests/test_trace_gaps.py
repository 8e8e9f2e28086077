"""benchmarks/trace_gaps.py reads both profilers' traces alike: torch.profiler's "kernel" events (step.py
--profile) and jax.profiler's Perfetto trace, where a GPU is a "/device:GPU:N" process and a stream one of
its "Stream #N(...)" threads, beside tracks derived from them (step_jax.py --profile). The traces themselves
need a GPU; these are written by hand."""

from __future__ import annotations

import pytest

import gzip
import json
import subprocess
import sys
from pathlib import Path

BENCHMARKS = Path(__file__).parents[1] / "benchmarks"
sys.path.insert(0, str(BENCHMARKS))

import trace_gaps  # noqa: E402

pytestmark = pytest.mark.quick


def write(path: Path, events: list[dict]) -> str:
    with gzip.open(path, "wt") as f:
        json.dump({"traceEvents": events}, f)
    return str(path)


def test_torch_and_jax_traces_give_the_same_kernels_and_gaps(tmp_path):
    # Two kernels on the compute stream with a 30 us gap, a third on another stream; the host's events
    # (a CPU op, a thread of the host process) are not kernels.
    timeline = [("gemm", 7, 0.0, 10.0), ("add", 7, 40.0, 5.0), ("sleep", 9, 12.0, 20.0)]
    torch_trace = write(tmp_path / "trace.json.gz", [
        *({"ph": "X", "cat": "kernel", "name": n, "ts": t, "dur": d, "pid": 0, "tid": s, "args": {"stream": s}}
          for n, s, t, d in timeline),
        {"ph": "X", "cat": "cpu_op", "name": "aten::mm", "ts": 0.0, "dur": 50.0, "pid": 0, "tid": 1, "args": {}},
    ])
    jax_trace = write(tmp_path / "perfetto_trace.json.gz", [
        {"ph": "M", "name": "process_name", "pid": 1, "args": {"name": "/device:GPU:0"}},
        {"ph": "M", "name": "process_name", "pid": 700, "args": {"name": "/host:CPU"}},
        *({"ph": "M", "name": "thread_name", "pid": 1, "tid": s, "args": {"name": f"Stream #{s}(Compute)"}}
          for s in (7, 9)),
        {"ph": "M", "name": "thread_name", "pid": 1, "tid": 50, "args": {"name": "XLA Ops"}},  # derived: not kernels
        *({"ph": "X", "name": n, "ts": t, "dur": d, "pid": 1, "tid": s} for n, s, t, d in timeline),
        *({"ph": "X", "name": f"op {n}", "ts": t, "dur": d, "pid": 1, "tid": 50} for n, s, t, d in timeline),
        {"ph": "X", "name": "PjitFunction(step)", "ts": 0.0, "dur": 50.0, "pid": 700, "tid": 3},
    ])
    for path in (torch_trace, jax_trace):
        found = trace_gaps.kernels(path)
        assert [(k["name"], k["args"]["stream"]) for k in found] == [("gemm", 7), ("sleep", 9), ("add", 7)]
        printed = subprocess.run([sys.executable, str(BENCHMARKS / "trace_gaps.py"), path], capture_output=True,
                                 text=True, check=True, timeout=60).stdout
        assert "compute stream 7: idle 0.0 ms of 0.0 (0 gaps over 50 us" in printed  # 30 us: under 50
        assert "0.030 ms at     0.01 ms (other streams busy 0.020)  after 'gemm'  before 'add'" in printed
