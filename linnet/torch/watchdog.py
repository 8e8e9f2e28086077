"""A rank that stops (SIGSTOP, a frozen host, a paused container) does not close its sockets, so
the other ranks wait in their next collective until the process group's timeout (NCCL's ten
minutes, Gloo's thirty), and the error that ends them names an operation, not the rank. This
watchdog names it, sooner: from `fully_shard` on, a thread of each rank counts a heartbeat into the
process group's store every few seconds and reads the others'. When a rank's count has not moved
for `timeout` seconds, every rank that sees it prints which ranks stopped and exits, and torchrun
ends the run.

The heartbeat runs on its own thread, so a rank that computes, compiles or writes for a long time is
not taken for a stopped one; counts, not clocks, cross hosts, so their clocks need not agree. A rank
that leaves the process group (or exits) says so first, and is not waited for.

A machine that dies closes its sockets: the others' next collective fails within seconds, naming an
address. `linnet.torch.train` then asks `lost_ranks` which peers' heartbeats have stopped (two beats'
time) and raises `RanksLost`, naming them and their machine, instead of the collective's error.

    LINNET_STALL_TIMEOUT=600 torchrun ...    # seconds (default 300); 0 turns the watchdog off

Under torchrun a rank also watches its launcher: torchrun's agent stops its workers when it is stopped,
but one killed outright (SIGKILL, out of memory) cannot, and its workers would train on, writing
checkpoints, with nobody to stop them. From `fully_shard` on, a thread of each such rank looks at its
parent every LAUNCHER_POLL seconds; once the agent is gone, the rank says so and exits.
"""

from __future__ import annotations

import atexit
import os
import socket
import sys
import threading
import time

import torch.distributed as dist

DEFAULT_TIMEOUT = 300.0
FAKE_BACKENDS = {"fake", "sim"}  # torch's FakeProcessGroup, and benchmarks/sim_world.py's timed one
DONE = "done"
LAUNCHER_POLL = 2.0  # seconds between a rank's looks at its torchrun agent
LAUNCHER_GONE_STATUS = 1

_launcher_watched = False

_watching: dict[str, _Watchdog] = {}  # group name -> its watchdog


class RanksLost(RuntimeError):
    """Peers that stopped answering while this rank waited for them in a collective."""


def stall_timeout(timeout: float | None = None) -> float:
    """`timeout` if given, else LINNET_STALL_TIMEOUT, else the default; 0 is off."""
    if timeout is None:
        raw = os.environ.get("LINNET_STALL_TIMEOUT", str(DEFAULT_TIMEOUT))
        try:
            timeout = float(raw)
        except ValueError:
            raise ValueError(f"LINNET_STALL_TIMEOUT must be a number of seconds (0: off), got {raw!r}") from None
    if timeout < 0:
        raise ValueError(f"the stall timeout must be 0 (off) or a number of seconds, got {timeout}")
    return timeout


def watch(group: dist.ProcessGroup, timeout: float | None = None) -> None:
    """Starts the watchdog of `group` on this rank (once a group; every rank of it should), and under torchrun
    the watch of its launcher (`watch_launcher`)."""
    watch_launcher()
    timeout = stall_timeout(timeout)
    if timeout == 0 or dist.get_world_size(group) == 1 or group.group_name in _watching:
        return
    if dist.get_backend(group) in FAKE_BACKENDS:  # one process playing every rank: no peer to watch
        return
    try:
        watchdog = _Watchdog(dist.distributed_c10d._get_default_store(), group.group_name,
                             dist.get_process_group_ranks(group), dist.get_rank(), timeout)
    except RuntimeError:  # a store that keeps no keys (a fake group's) cannot carry heartbeats
        return
    _watching[group.group_name] = watchdog
    watchdog.thread = threading.Thread(target=watchdog.run, name=f"linnet-watchdog-{group.group_name}", daemon=True)
    watchdog.thread.start()


def watch_launcher(poll: float = LAUNCHER_POLL) -> None:
    """Under torchrun (TORCHELASTIC_RUN_ID set), once a process: a daemon thread that ends this process, naming
    the reason, when the torchrun agent that started it is gone (its parent changes)."""
    global _launcher_watched
    if _launcher_watched or "TORCHELASTIC_RUN_ID" not in os.environ:
        return
    _launcher_watched = True
    agent = os.getppid()

    def look() -> None:
        while os.getppid() == agent:
            time.sleep(poll)
        rank = os.environ.get("RANK", "?")
        sys.__stderr__.write(f"linnet: rank {rank} ends: its torchrun agent (process {agent}) is gone, so nothing "
                             f"would stop this run; start it again to resume from its last checkpoint\n")
        sys.__stderr__.flush()
        os._exit(LAUNCHER_GONE_STATUS)

    threading.Thread(target=look, name="linnet-launcher-watch", daemon=True).start()


def from_communication(error: BaseException) -> bool:
    """Whether `error` is a collective's failure (a peer gone, a broken connection): c10d's own error
    types, or Gloo's and NCCL's RuntimeErrors, which name their library."""
    text = str(error)
    return isinstance(error, dist.DistError) or "gloo" in text.lower() or "NCCL" in text


def lost_ranks() -> RanksLost | None:
    """After a collective failed: the peers of every watched group whose heartbeat does not move over
    two beats, as the error to raise; None if every peer still beats (or none is watched, or the
    store that carries the heartbeats went with them)."""
    lost: dict[int, str] = {}
    for watchdog in list(_watching.values()):
        lost.update(watchdog.silent())
    if not lost:
        return None
    ranks = sorted(lost)
    where = sorted(set(lost.values()))
    return RanksLost(f"linnet: rank {', '.join(map(str, ranks))} stopped answering ({'; '.join(where)}): their "
                     f"heartbeats stopped while rank {dist.get_rank()} waited for them in a collective. A machine "
                     "that died, or lost its network, takes all of its ranks with it.")


class _Watchdog:
    def __init__(self, store, group_name: str, ranks: list[int], rank: int, timeout: float):
        self.store, self.ranks, self.rank, self.timeout = store, ranks, rank, timeout
        self.key = lambda r: f"linnet/heartbeat/{group_name}/{r}"
        self.host_key = lambda r: f"linnet/host/{group_name}/{r}"
        self.interval = min(max(timeout / 4, 0.2), 5.0)
        self.beats = 0
        self.stopping, self.thread = threading.Event(), None
        self.store.set(self.key(rank), "0")
        # Where this rank runs, for a message about it: torchrun's machine index (GROUP_RANK) and the host.
        machine = os.environ.get("GROUP_RANK")
        self.store.set(self.host_key(rank),
                       (f"machine {machine}, " if machine is not None else "") + f"host {socket.gethostname()}")
        atexit.register(self._leave)

    def _leave(self) -> None:
        # At exit the thread is stopped first: a daemon thread still in a store call while the
        # interpreter and the store's own threads are torn down can abort the process.
        self.stopping.set()
        if self.thread is not None and self.thread is not threading.current_thread():
            self.thread.join(timeout=10)
        try:
            self.store.set(self.key(self.rank), DONE)
        except Exception:  # noqa: BLE001  (the store may be gone already: nothing left to tell)
            pass

    def run(self) -> None:
        peers = [r for r in self.ranks if r != self.rank]
        seen = {r: (None, time.monotonic()) for r in peers}  # rank -> (last count, when it last moved)
        while not self.stopping.wait(self.interval):
            if not dist.is_initialized():  # this rank left the process group: it is done
                self._leave()
                return
            try:
                self.beats += 1
                self.store.set(self.key(self.rank), str(self.beats))
                counts = self._counts(peers)
            except Exception:  # noqa: BLE001  (the store went away: the run is ending anyway)
                return
            now = time.monotonic()
            for r, count in counts.items():
                if count == DONE:
                    seen.pop(r, None)
                elif r in seen and count != seen[r][0]:
                    seen[r] = (count, now)
            stopped = sorted(r for r, (_, moved) in seen.items() if now - moved > self.timeout)
            if stopped:
                self._end(stopped)

    def _counts(self, peers: list[int]) -> dict[int, str | None]:
        return {r: self.store.get(self.key(r)).decode() if self.store.check([self.key(r)]) else None for r in peers}

    def silent(self) -> dict[int, str]:
        """The peers (rank -> where it ran) whose count does not move over two beats of this one's."""
        peers = [r for r in self.ranks if r != self.rank]
        try:
            before = self._counts(peers)
            time.sleep(2 * self.interval + 0.5)
            after = self._counts(peers)
            silent = [r for r in peers if before[r] not in (None, DONE) and after[r] == before[r]]
            return {r: self.store.get(self.host_key(r)).decode() for r in silent}
        except Exception:  # noqa: BLE001  (the store went with the lost machine: nothing to tell)
            return {}

    def _end(self, stopped: list[int]) -> None:
        names = ", ".join(map(str, stopped))
        print(f"linnet: rank {names} of {len(self.ranks)} has not answered for {self.timeout:.0f} s (stopped, frozen, "
              f"or its host is unreachable); rank {self.rank} ends here rather than wait in a collective for it. "
              "LINNET_STALL_TIMEOUT (seconds, 0: off) sets how long to wait.", file=sys.stderr, flush=True)
        sys.stdout.flush()
        os._exit(1)  # the main thread waits in a collective that will not return: nothing else can end it
