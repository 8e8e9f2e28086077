"""Runs a function in N processes joined by a Gloo process group, for tests.

    results = run(fn, world=2, *args)   # [fn(rank, world, *args) for each rank]

`fn` must be picklable (a module-level function). Each rank runs in a fresh
process (the spawn start method), with the default process group initialised
over Gloo on the loopback interface; the parent holds the rendezvous store on
a port the system picks, so there is no port to race for. A rank's exception
is raised again in the parent, chained to the rank's traceback; a run that
outlasts `timeout` seconds is killed and fails rather than hanging the suite.
"""

from __future__ import annotations

import multiprocessing
import os
import pickle
import queue
import time
import traceback
from collections.abc import Callable
from datetime import timedelta
from typing import Any


class RemoteTraceback(Exception):
    """The traceback of an exception raised in a rank, as text."""

    def __str__(self) -> str:
        return self.args[0]


def run(fn: Callable[..., Any], world: int, *args: Any, timeout: float = 120.0, backend: str = "gloo") -> list[Any]:
    """fn(rank, world, *args) in `world` processes over Gloo (or over NCCL, rank r on GPU r); returns the
    results in rank order."""
    import torch.distributed as dist

    store = dist.TCPStore("127.0.0.1", 0, world + 1, is_master=True, timeout=timedelta(seconds=timeout),
                          wait_for_workers=False)
    context = multiprocessing.get_context("spawn")
    results = context.Queue()
    processes = [
        context.Process(target=_worker, args=(fn, rank, world, store.port, timeout, args, results, backend),
                        daemon=True)
        for rank in range(world)
    ]
    for process in processes:
        process.start()
    outcomes: dict[int, tuple[str, Any]] = {}
    deadline = time.monotonic() + timeout
    try:
        while len(outcomes) < world:
            try:
                rank, kind, value = results.get(timeout=max(0.0, min(1.0, deadline - time.monotonic())))
            except queue.Empty:
                if time.monotonic() >= deadline:
                    raise TimeoutError(f"ranks {sorted(set(range(world)) - set(outcomes))} of {world} did not "
                                       f"finish within {timeout:.0f} s") from None
                dead = [r for r, p in enumerate(processes) if r not in outcomes and p.exitcode not in (None, 0)]
                if dead:
                    raise RuntimeError(f"rank {dead[0]} of {world} died (exit code {processes[dead[0]].exitcode}) "
                                       "without reporting a result") from None
                continue
            outcomes[rank] = (kind, value)
            if kind == "error":
                break
    finally:
        for process in processes:
            process.join(timeout=5 if len(outcomes) == world else 0)
            if process.is_alive():
                process.kill()
                process.join()
        results.close()
    for rank in sorted(outcomes):
        kind, value = outcomes[rank]
        if kind == "error":
            error, text = value
            raise error from RemoteTraceback(f"in rank {rank} of {world}:\n{text}")
    return [outcomes[rank][1] for rank in range(world)]


def _worker(fn, rank, world, port, timeout, args, results, backend) -> None:
    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")  # keep the traffic on this machine
    os.environ.setdefault("NCCL_NVLS_ENABLE", "0")
    import torch
    import torch.distributed as dist

    try:
        store = dist.TCPStore("127.0.0.1", port, world + 1, is_master=False, timeout=timedelta(seconds=timeout))
        device = None
        if backend == "nccl":
            torch.cuda.set_device(rank)
            device = torch.device("cuda", rank)
        dist.init_process_group(backend, store=store, rank=rank, world_size=world, timeout=timedelta(seconds=timeout),
                                device_id=device)
        try:
            results.put((rank, "ok", fn(rank, world, *args)))
        finally:
            dist.destroy_process_group()
    except BaseException as error:  # noqa: BLE001  (sent to the parent, which raises it)
        text = traceback.format_exc()
        try:
            pickle.dumps(error)
        except Exception:  # noqa: BLE001
            error = RuntimeError(f"{type(error).__name__}: {error}")
        results.put((rank, "error", (error, text)))
