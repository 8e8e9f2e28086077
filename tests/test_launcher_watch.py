"""A rank started by torchrun ends, naming the reason, once its torchrun agent is killed outright: no rank
trains on (writing checkpoints) without a launcher to stop it."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

WORKER = """
import os, sys, time
from pathlib import Path
from linnet.torch import watchdog
watchdog.watch_launcher(poll=0.2)
Path(sys.argv[1], os.environ["RANK"]).write_text(str(os.getpid()))
time.sleep(120)
"""


def alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return Path(f"/proc/{pid}/stat").exists() and Path(f"/proc/{pid}/stat").read_text().split()[2] != "Z"


def test_workers_end_within_seconds_when_their_torchrun_agent_is_killed(tmp_path):
    script = tmp_path / "worker.py"
    script.write_text(WORKER)
    pids = tmp_path / "pids"
    pids.mkdir()
    agent = subprocess.Popen([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2",
                              str(script), str(pids)], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + 60
        while len(list(pids.iterdir())) < 2 and time.monotonic() < deadline:
            time.sleep(0.1)
        workers = [int(path.read_text()) for path in sorted(pids.iterdir())]
        assert len(workers) == 2, agent.stderr.read() if agent.poll() is not None else "no workers in 60 s"
        agent.send_signal(signal.SIGKILL)
        agent.wait()
        deadline = time.monotonic() + 30
        while any(alive(pid) for pid in workers) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert not any(alive(pid) for pid in workers), "a worker outlived its agent by 30 s"
        said = agent.stderr.read()
        for rank in (0, 1):
            assert f"linnet: rank {rank} ends: its torchrun agent (process {agent.pid}) is gone" in said, said
    finally:
        agent.kill()
        for path in pids.iterdir():
            try:
                os.kill(int(path.read_text()), signal.SIGKILL)
            except ProcessLookupError:
                pass
