"""A rank that dies or errs stops every rank within seconds, with a message that
names it, rather than leaving the others waiting in a collective until the
process group's timeout."""

from __future__ import annotations

import os
import re
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
import torch
from distributed import free_port, run

from linnet import nest
from linnet.data.packing import Example, pack

DRIVER = Path(__file__).parent / "rank_loss_driver.py"
ROW = 64


def torchrun(out: Path, *extra: str, timeout: float,
             env: dict | None = None) -> tuple[subprocess.CompletedProcess, float]:
    """The driver under torchrun at world 2, as users start it; returns the run and when it ended
    (time.time())."""
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2", str(DRIVER),
               str(out), *extra]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "GLOO_SOCKET_IFNAME": "lo", **(env or {})}
    result = subprocess.run(command, check=False, capture_output=True, text=True, timeout=timeout, env=env)
    return result, time.time()


def test_a_killed_rank_ends_the_run_within_a_minute_naming_it(tmp_path):
    """Gloo's survivor fails in its next collective at once (the dead rank's sockets close) and
    torchrun takes the others down, naming the lost rank and its signal. (Measured: under a second.)"""
    result, ended = torchrun(tmp_path, "--kill-rank", "1", "--at", "3", timeout=90)
    killed_at = float((tmp_path / "killed_at").read_text())
    assert result.returncode != 0
    assert ended - killed_at < 60, f"the run outlived rank 1 by {ended - killed_at:.0f} s"
    summary = re.search(r"rank\s*:\s*1 \(local_rank: 1\)\s*\n\s*exitcode\s*:\s*-9 .*\(SIGKILL\)", result.stderr)
    assert summary, result.stderr[-3000:]


def test_a_stopped_rank_ends_the_run_within_the_stall_timeout_naming_it(tmp_path):
    """A SIGSTOPped rank keeps its sockets open: without linnet's watchdog the other waits in its
    next collective for Gloo's thirty minutes. With LINNET_STALL_TIMEOUT=4 the other rank names it
    and exits; torchrun then takes the stopped one down (SIGKILL reaches a stopped process)."""
    result, ended = torchrun(tmp_path, "--stop-rank", "1", "--at", "3", timeout=120, env={"LINNET_STALL_TIMEOUT": "4"})
    stopped_at = float((tmp_path / "killed_at").read_text())
    assert result.returncode != 0
    assert ended - stopped_at < 60, f"the run outlived rank 1 by {ended - stopped_at:.0f} s"
    assert re.search(r"linnet: rank 1 of 2 has not answered for 4 s", result.stderr), result.stderr[-3000:]


def test_a_lost_machine_ends_the_other_within_a_minute_naming_its_ranks(tmp_path):
    """Two torchrun launches on the loopback address as two machines of 2 ranks; the second machine dies
    whole (its torchrun and both workers SIGKILLed) after step 3. The first machine's ranks fail in their
    next collective (Gloo: "Connection reset by peer", naming an address), find whose heartbeats stopped,
    and end naming those ranks and their machine. (Measured: 12 s after the kill.)"""
    port = free_port()
    env = {**os.environ, "OMP_NUM_THREADS": "1", "GLOO_SOCKET_IFNAME": "lo"}
    launches = []
    for node, extra in enumerate(([], ["--kill-this-machine"])):
        command = [sys.executable, "-m", "torch.distributed.run", "--nnodes=2", f"--node-rank={node}",
                   "--nproc_per_node=2", "--rdzv-backend=c10d", f"--rdzv-endpoint=127.0.0.1:{port}",
                   "--rdzv-id=linnet-lost-machine", str(DRIVER), str(tmp_path), "--steps", "8", *extra]
        with open(tmp_path / f"machine-{node}.log", "w") as log:  # files, not pipes: a full pipe would stall a machine
            launches.append(subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, env=env))
        time.sleep(2)  # the first launch hosts the rendezvous, which must outlive the second machine
    survivor, lost = launches
    survivor.wait(timeout=180)
    ended = time.time()
    lost.wait(timeout=30)
    stderr = (tmp_path / "machine-0.log").read_text()
    killed_at = float((tmp_path / "killed_at").read_text())
    assert survivor.returncode != 0
    assert ended - killed_at < 60, f"the first machine outlived the second by {ended - killed_at:.0f} s"
    ranks = ", ".join((tmp_path / "lost").read_text().split())
    assert re.search(rf"RanksLost: linnet: rank {ranks} stopped answering \(machine \d+, host ", stderr), stderr[-3000:]


def test_the_stall_timeout_is_read_from_the_environment(monkeypatch):
    from linnet.torch.watchdog import DEFAULT_TIMEOUT, stall_timeout

    monkeypatch.delenv("LINNET_STALL_TIMEOUT", raising=False)
    assert stall_timeout() == DEFAULT_TIMEOUT
    assert stall_timeout(7) == 7
    monkeypatch.setenv("LINNET_STALL_TIMEOUT", "0")
    assert stall_timeout() == 0
    monkeypatch.setenv("LINNET_STALL_TIMEOUT", "soon")
    with pytest.raises(ValueError, match="LINNET_STALL_TIMEOUT must be a number of seconds"):
        stall_timeout()


STAY = 8.0  # seconds the failing rank stays alive after its errors, in no collective


def bad_inputs_in_a_users_loop(rank: int, world: int) -> list:
    """A user's own loop over a sharded model in which rank 1 passes one bad batch of each kind
    (a row longer than MaxSeq, float token ids) and catches its error, as a user's except clause
    or a notebook does: (kind, what this rank raised, seconds from the bad step's start) for each."""
    from linnet.torch import fully_shard

    model = fully_shard(nest.load("tiny-llama", numerics="fast", generics={"Batch": 1, "MaxSeq": ROW, "T": "f32"},
                                  cast_dtype=True, trainable=True, weights="random", entry="loss_packed"))
    rng = np.random.default_rng(0)
    examples = [Example.prompted(rng.integers(6, 512, 12).tolist(), rng.integers(6, 512, 8).tolist())
                for _ in range(40)]
    row = list(pack(examples, ROW))[rank]
    good = [torch.from_numpy(f)[None] for f in (row.tokens, row.targets, row.positions, row.segments, row.weights)]
    bad = {"shape": [torch.cat([x, x[:, :1]], dim=1) for x in good], "dtype": [good[0].float(), *good[1:]]}
    model.loss_packed(*good).backward()
    outcomes = []
    for kind, inputs in bad.items():
        start = time.monotonic()
        try:
            model.loss_packed(*(inputs if rank == 1 else good)).backward()
            outcomes.append((kind, None, time.monotonic() - start))
        except Exception as error:  # noqa: BLE001  (the test looks at what each rank raised)
            outcomes.append((kind, f"{type(error).__name__}: {error}", time.monotonic() - start))
    if rank == 1:
        time.sleep(STAY)  # alive, and in no collective
    return outcomes


def test_one_ranks_bad_input_in_a_users_loop_stops_every_rank_with_its_message():
    """Needs each call of a sharded model to agree on its input checks across ranks before its
    first gather (linnet/torch/agree.py agree_on_check). Without it, rank 0 waits in the gather until
    rank 1 leaves the process group (here after STAY seconds; with NCCL, or a rank that carries
    on, until the group's timeout), and then fails without rank 1's message."""
    expected = {"shape": r"ValueError: .*rank 1: loss_packed\(tokens: .*got shape \(1, 65\), but MaxSeq is at most 64",
                "dtype": r"TypeError: .*rank 1: loss_packed\(tokens: .*expected an int tensor, got float"}
    for rank, outcomes in enumerate(run(bad_inputs_in_a_users_loop, 2, timeout=90)):
        for kind, message, seconds in outcomes:
            assert message is not None and re.search(expected[kind], message), (rank, kind, message)
            if rank == 0:
                assert seconds < STAY / 2, f"rank 0 took {seconds:.1f} s to learn of rank 1's {kind} error"
