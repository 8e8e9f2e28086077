"""Runs a function in N processes joined by a Gloo process group, for tests.

    results = run(fn, world=2, *args)   # [fn(rank, world, *args) for each rank]

`fn` must be picklable (a module-level function). The ranks are processes started with the spawn
method, the default process group initialised over Gloo on the loopback interface; the parent holds
the rendezvous store on a port the system picks, so there is no port to race for.

The processes of a world size outlive a call: the next `run` at that size, with the same environment
variables, hands its function to the same ones, so a test pays neither their start nor their imports
again (about 5 s a call on 2 cores), and torch's compile caches stay warm. They are replaced, not
reused, after a call that fails, that ends or replaces the default process group, or that asks for
`fresh=True`: a test whose ranks keep something past the call (a checkpoint folder's lock, as a
killed run would), change a module's settings, or measure their own memory. A rank's exception is
raised again in the parent, chained to the rank's traceback; a call that outlasts `timeout` seconds
is killed and fails rather than hanging the suite.
"""

from __future__ import annotations

import atexit
import multiprocessing
import os
import pickle
import queue
import socket
import time
import traceback
from collections.abc import Callable
from datetime import timedelta
from typing import Any

GROUP_TIMEOUT = timedelta(minutes=10)  # a collective's; a call's own `timeout` is the parent's to enforce


class RemoteTraceback(Exception):
    """The traceback of an exception raised in a rank, as text."""

    def __str__(self) -> str:
        return self.args[0]


def free_port() -> int:
    """A TCP port on the loopback address that nothing listens on now (for a launcher's rendezvous)."""
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def run(fn: Callable[..., Any], world: int, *args: Any, timeout: float = 120.0, backend: str = "gloo",
        fresh: bool = False) -> list[Any]:
    """fn(rank, world, *args) in `world` processes over Gloo (or over NCCL, rank r on GPU r); returns the
    results in rank order. `fresh`: in processes that ran nothing before and run nothing after."""
    key = (world, backend)
    ranks = _ranks.pop(key, None)
    if ranks is not None and ranks.environment != _environment():  # started under other variables
        ranks.close()
        ranks = None
    if ranks is None or fresh:
        if ranks is not None:
            _ranks[key] = ranks  # kept for the calls after this one
        ranks = _Ranks(world, backend)
    try:
        outcomes = ranks.call(fn, args, timeout)
    except BaseException:
        ranks.close()
        raise
    if fresh or any(kind != "ok" or retired for kind, _, retired in outcomes.values()):
        ranks.close()
    elif key in _ranks:
        ranks.close()
    else:
        _ranks[key] = ranks
    for rank in sorted(outcomes):
        kind, value, _ = outcomes[rank]
        if kind == "error":
            error, text = value
            raise error from RemoteTraceback(f"in rank {rank} of {world}:\n{text}")
    return [outcomes[rank][1] for rank in range(world)]


class _Ranks:
    """`world` processes, each in a loop of calls, and the store that joined them."""

    def __init__(self, world: int, backend: str):
        import torch.distributed as dist

        self.world, self.environment = world, _environment()
        self.store = dist.TCPStore("127.0.0.1", 0, world + 1, is_master=True, timeout=GROUP_TIMEOUT,
                                   wait_for_workers=False)
        context = multiprocessing.get_context("spawn")
        self.calls = [context.Queue() for _ in range(world)]
        self.results = context.Queue()
        self.processes = [
            context.Process(target=_serve, args=(rank, world, self.store.port, backend, self.calls[rank],
                                                 self.results, os.getpid()), daemon=True)
            for rank in range(world)
        ]
        for process in self.processes:
            process.start()

    def call(self, fn, args, timeout: float) -> dict[int, tuple[str, Any, bool]]:
        for calls in self.calls:
            calls.put((fn, args))
        outcomes: dict[int, tuple[str, Any, bool]] = {}
        deadline = time.monotonic() + timeout
        while len(outcomes) < self.world:
            try:
                rank, kind, value, retired = self.results.get(
                    timeout=max(0.0, min(1.0, deadline - time.monotonic())))
            except queue.Empty:
                missing = sorted(set(range(self.world)) - set(outcomes))
                if time.monotonic() >= deadline:
                    raise TimeoutError(f"ranks {missing} of {self.world} did not finish within "
                                       f"{timeout:.0f} s") from None
                dead = [r for r in missing if self.processes[r].exitcode is not None]
                if dead:
                    raise RuntimeError(f"rank {dead[0]} of {self.world} died (exit code "
                                       f"{self.processes[dead[0]].exitcode}) without reporting a result") from None
                continue
            outcomes[rank] = (kind, value, retired)
            if kind == "error":
                break
        return outcomes

    def close(self) -> None:
        for calls in self.calls:
            calls.put(None)
        for process in self.processes:
            process.join(timeout=2)
            if process.is_alive():
                process.kill()
                process.join()
        for q in (*self.calls, self.results):
            q.close()


_ranks: dict[tuple[int, str], _Ranks] = {}


def _environment() -> dict[str, str]:
    """The variables the ranks start with, but pytest's own (PYTEST_CURRENT_TEST changes at every test)."""
    return {name: value for name, value in os.environ.items() if not name.startswith("PYTEST_")}


@atexit.register
def _close_all() -> None:
    while _ranks:
        _ranks.popitem()[1].close()


def _serve(rank, world, port, backend, calls, results, parent: int) -> None:
    """One rank: joins the group, then runs each call it is handed until told to stop (None), the group it
    made is gone, a call fails, or the process that started it is gone (a pytest worker that ended without
    closing its ranks: the rank leaves at once, rather than run on with its watchdog)."""
    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")  # keep the traffic on this machine
    os.environ.setdefault("NCCL_NVLS_ENABLE", "0")
    import torch
    import torch.distributed as dist

    try:
        store = dist.TCPStore("127.0.0.1", port, world + 1, is_master=False, timeout=GROUP_TIMEOUT)
        device = None
        if backend == "nccl":
            torch.cuda.set_device(rank)
            device = torch.device("cuda", rank)
        dist.init_process_group(backend, store=store, rank=rank, world_size=world, timeout=GROUP_TIMEOUT,
                                device_id=device)
        group = dist.group.WORLD
    except BaseException as error:  # noqa: BLE001  (sent to the parent, which raises it)
        results.put((rank, "error", _sendable(error), True))
        return
    while (task := _next_call(calls, parent)) is not None:
        fn, args = task
        try:
            results.put((rank, "ok", fn(rank, world, *args), _retired(dist, group)))
        except BaseException as error:  # noqa: BLE001
            results.put((rank, "error", _sendable(error), True))
            break
        if _retired(dist, group):
            break
    if dist.is_initialized():
        dist.destroy_process_group()


def _next_call(calls, parent: int):
    """The next call handed to this rank, None to stop; where the parent is gone, this process ends."""
    while True:
        try:
            return calls.get(timeout=1.0)
        except queue.Empty:
            if os.getppid() != parent:
                os._exit(0)


def _retired(dist, group) -> bool:
    """Whether the call ended or replaced the group this process joined: then it serves no more calls."""
    return not dist.is_initialized() or dist.group.WORLD is not group


def _sendable(error: BaseException) -> tuple[BaseException, str]:
    text = traceback.format_exc()
    try:
        pickle.dumps(error)
    except Exception:  # noqa: BLE001
        error = RuntimeError(f"{type(error).__name__}: {error}")
    return error, text
