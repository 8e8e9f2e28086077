"""Runs a training-step script as rank 0 of a simulated world of SIM_WORLD ranks on one GPU: the
collectives move no data, but each one holds a communication stream busy for the time its bytes
would take at a bus bandwidth of SIM_BUS_GBPS, so communication the script leaves exposed shows up
in its step time (docs/design/simulation.md):

    SIM_WORLD=4 SIM_BUS_GBPS=360 LOCAL_RANK=0 \\
        python3 benchmarks/sim_world.py benchmarks/step.py --card llama-3.1-8b --steps 8
    SIM_WORLD=4 SIM_BUS_GBPS=inf LOCAL_RANK=0 \\
        python3 benchmarks/sim_world.py benchmarks/step.py --card llama-3.1-8b --steps 8
    python3 benchmarks/sim_world.py --compare sim.log inf.log    # exposed share of the communication
    SIM_WORLD=8 SIM_MACHINE_SIZE=4 SIM_NET_GBPS=45 ...            # two machines of four GPUs

Machines: with SIM_MACHINE_SIZE=m, ranks r and s share a machine when r // m == s // m. A group
whose ranks all share one (the "shard" dimension of a hybrid mesh) moves its bytes at SIM_BUS_GBPS;
a group that spans machines (the "replicate" dimension, or one flat group of every rank) at
SIM_NET_GBPS (default 45), the bottleneck of its ring. The two kinds of link are separate lanes:
a collective inside a machine and one between machines run at the same time, as NCCL's
communicators over NVLink and over the network do; collectives on the same kind of link run one
after another. Without SIM_MACHINE_SIZE the world is one machine.

At exit it prints `SIM {json}`: the world, the bandwidth, every collective by kind (calls, bytes,
modelled seconds), each step's modelled communication (`steps`, from the script's `step N loss L Ts`
lines) and their medians after three warm-up steps (`step_s`, `comm_s_per_step`). The exposed share
is (step_s at SIM_BUS_GBPS - step_s at inf) / comm_s_per_step; `--compare` computes it.

Timing model, NCCL's bus-bandwidth convention (nccl-tests doc/PERFORMANCE.md): all_gather and
reduce_scatter of a full buffer of S bytes (the gathered output, the scattered input) take
S (n-1)/n / busbw, all_reduce 2 S (n-1)/n / busbw, broadcast S / busbw, barrier nothing; each call
adds a fixed latency, SIM_LATENCY_US (10 us: an assumption, the order of NCCL's small-message times
on NVLink). GB/s are 1e9 bytes a second, as nccl-tests counts them. SIM_BUS_GBPS=inf issues the
same calls through the same code but sleeps for nothing (latency 0 unless SIM_LATENCY_US is set):
the step time without communication.

Defaults, from published figures:
  * 360 GB/s (the default): NCCL all_gather / reduce_scatter / all_reduce bus bandwidth on 8 x H100
    over NVLink 4, without NVLink SHARP, in nccl-tests: "360 GB/s is exactly what we'd expect on
    H100" (NCCL maintainer, github.com/NVIDIA/nccl-tests/issues/326); reduce_scatter 360 GB/s,
    all_gather 350 GB/s on H100 (github.com/NVIDIA/nccl/issues/1281). NVLink 4 is 900 GB/s per
    GPU both ways together, 450 GB/s each way. That 4 ranks on an H200 machine reach the same bus
    bandwidth as 8 is an assumption.
  * ~45 GB/s: across machines, one 400 Gb/s NIC a GPU; NVIDIA expects 46-48 GB/s a NIC from NDR
    400 Gb/s InfiniBand (github.com/NVIDIA/nccl-tests/issues/290).

How: the backend "sim" is the fake process group (torch's FakeProcessGroup: rank 0, size
SIM_WORLD), and the CPU and CUDA kernels of the c10d dispatcher ops (c10d::_allgather_base_,
_reduce_scatter_base_, allreduce_, ...) are replaced in this process by Python ones, so calls that
reach them from Python (torch.distributed, FSDP2) or from C++ (Linnet's collectives) are timed
alike. A Python subclass of ProcessGroup would serve only the Python API: the dispatcher ops look
up a C++ backend, which Python cannot subclass. Every simulated rank holds rank 0's values: an
all-gather copies its input into every slot and a reduce-scatter keeps rank 0's share, so a run
stays finite (Linnet stops at a non-finite loss) and its loss is that of a world of equal ranks;
the copy runs before the modelled time on the same lane, so a collective lasts both, and its
writes take memory bandwidth as NCCL's do. A SUM through torch.distributed.all_reduce multiplies
by the world (as fake_world.py does), so code counting ranks sees every rank; Linnet's check
that a cuda model has an nccl group is skipped. Each collective returns a c10d Work wrapping a torch Future:
  * CUDA: one high-priority side stream per device and link (calls on it run one after another)
    waits for the caller's current stream, sleeps (torch.cuda._sleep, cycles a second calibrated
    once against CUDA events at the first collective, or SIM_CYCLES_PER_S) and completes the
    Future there; Work.wait(), and _c10d_functional::wait_tensor through it, make the waiting
    stream wait for that event. Nothing blocks the host. The collective's tensors are recorded on
    the side stream, so their memory is not reused before it ends, as with NCCL.
  * CPU: a worker thread a link completes each Future when its modelled time has passed (calls one
    after another); wait() blocks the host until then.
Not modelled: the SMs, memory bandwidth and launch time a real NCCL kernel takes from compute (the
sleep holds one SM), and NVLink SHARP. Benchmarks only: never import this from the package.
"""

from __future__ import annotations

import collections
import json
import math
import os
import queue
import re
import runpy
import statistics
import sys
import threading
import time
import warnings

import torch
import torch.distributed as dist

DEFAULT_BUS_GBPS = 360.0
DEFAULT_NET_GBPS = 45.0
DEFAULT_LATENCY_US = 10.0
WARMUP_STEPS = 3  # as benchmarks/step.py and peers/fsdp2_baseline.py: the median step after these

# the collectives the model knows: kind -> bus bytes per byte of the full buffer, as a function of n
BUS_FACTOR = {
    "all_gather": lambda n: (n - 1) / n,
    "reduce_scatter": lambda n: (n - 1) / n,
    "all_reduce": lambda n: 2 * (n - 1) / n,
    "broadcast": lambda n: 1.0,
    "barrier": lambda n: 0.0,
}


def model_seconds(kind: str, nbytes: int, world: int, bus_gbps: float, latency_s: float) -> float:
    """How long one collective of `kind` over a full buffer of `nbytes` takes among `world` ranks."""
    if math.isinf(bus_gbps):
        return latency_s
    return latency_s + BUS_FACTOR[kind](world) * nbytes / (bus_gbps * 1e9)


def _nbytes(tensors) -> int:
    return sum(t.numel() * t.element_size() for t in tensors)


def _flat(items) -> list:
    """The leaves of nested lists (c10d's Tensor[][] arguments)."""
    return [leaf for x in items for leaf in (_flat(x) if isinstance(x, (list, tuple)) else [x])]


class _CpuLane:
    """One worker thread completes the Futures in issue order, each when its modelled time has passed."""

    def __init__(self):
        self._queue = queue.Queue()
        self._lock = threading.Lock()
        self._free_at = 0.0  # when the last issued collective ends
        self._thread = threading.Thread(target=self._run, name="sim-world-comm", daemon=True)
        self._thread.start()

    def issue(self, seconds: float, value: list, tensors: list, fill) -> torch.futures.Future:
        fill()
        future = torch.futures.Future()
        with self._lock:
            self._free_at = max(time.perf_counter(), self._free_at) + seconds
            self._queue.put((self._free_at, future, value))
        return future

    def _run(self):
        while (item := self._queue.get()) is not None:
            end, future, value = item
            delay = end - time.perf_counter()
            if delay > 0:
                time.sleep(delay)
            future.set_result(value)
            self._queue.task_done()

    def finish(self) -> None:
        """Returns once every collective issued so far has completed."""
        self._queue.join()

    def close(self) -> None:
        self.finish()
        self._queue.put(None)
        self._thread.join()


class _CudaLane:
    """One high-priority side stream: each collective waits for the caller's stream, sleeps, and
    completes its Future there (the Future records an event that a waiting stream waits on)."""

    def __init__(self, device: torch.device, cycles_per_s: float | None):
        self.device = device
        self.stream = torch.cuda.Stream(device=device, priority=-1)
        self.cycles_per_s = cycles_per_s or self._calibrate()
        self.measured_s = 0.0  # the sleeps as CUDA events timed them
        self._pending = collections.deque()

    def _calibrate(self) -> float:
        """Cycles a second of torch.cuda._sleep: the difference between a sleep of n and one of 3n cycles."""
        n = 1 << 24  # about 8 ms at 2 GHz
        rates = []
        with torch.cuda.device(self.device), torch.cuda.stream(self.stream):
            torch.cuda._sleep(n)  # wakes the clocks
            for _ in range(3):
                a, b, c = (torch.cuda.Event(enable_timing=True) for _ in range(3))
                a.record()
                torch.cuda._sleep(n)
                b.record()
                torch.cuda._sleep(3 * n)
                c.record()
                c.synchronize()
                rates.append(2 * n / ((b.elapsed_time(c) - a.elapsed_time(b)) / 1e3))
        return statistics.median(rates)

    def issue(self, seconds: float, value: list, tensors: list, fill) -> torch.futures.Future:
        self.stream.wait_stream(torch.cuda.current_stream(self.device))
        for t in tensors:  # their memory is not reused before the collective ends, as with NCCL's
            t.record_stream(self.stream)
        with torch.cuda.device(self.device), torch.cuda.stream(self.stream):
            fill()  # before the sleep, outside its timing: the sleep is the modelled time
            if seconds > 0:
                start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                start.record()
                torch.cuda._sleep(max(1, round(seconds * self.cycles_per_s)))
                end.record()
                self._pending.append((start, end))
                self._collect(block=False)
            future = torch.futures.Future(devices=[self.device])
            future.set_result(value)  # records the event on this stream, now current
        return future

    def _collect(self, block: bool) -> None:
        while self._pending and (block or self._pending[0][1].query()):
            start, end = self._pending.popleft()
            end.synchronize()
            self.measured_s += start.elapsed_time(end) / 1e3

    def finish(self) -> None:
        self._collect(block=True)

    close = finish


class Sim:
    """The simulated communicator's settings, its lanes (one per device) and its accounting."""

    def __init__(self, world: int, bus_gbps: float, latency_us: float | None, cycles_per_s: float | None = None,
                 machine_size: int | None = None, net_gbps: float = DEFAULT_NET_GBPS):
        if world < 1:
            raise ValueError(f"SIM_WORLD must be at least 1, got {world}")
        if not bus_gbps > 0 or not net_gbps > 0:
            raise ValueError(f"SIM_BUS_GBPS and SIM_NET_GBPS must be positive (or inf), got {bus_gbps} and {net_gbps}")
        if machine_size is not None and (machine_size < 1 or world % machine_size):
            raise ValueError(f"SIM_MACHINE_SIZE must divide SIM_WORLD={world}, got {machine_size}")
        self.world = world
        self.bus_gbps = bus_gbps
        self.machine_size = machine_size
        self.net_gbps = bus_gbps if math.isinf(bus_gbps) else net_gbps  # inf: no communication time anywhere
        self.latency_us = (latency_us if latency_us is not None
                           else 0.0 if math.isinf(bus_gbps) else DEFAULT_LATENCY_US)
        self.cycles_per_s = cycles_per_s
        self.calls = collections.Counter()
        self.bytes = collections.Counter()
        self.seconds = collections.Counter()
        self.link_seconds = collections.Counter()  # "machine" or "network" -> modelled seconds
        self.steps: list[dict] = []
        self._mark = (0, 0.0)  # calls and seconds when the last step line was printed
        self._lanes: dict = {}
        self._lock = threading.Lock()

    @property
    def total_calls(self) -> int:
        return sum(self.calls.values())

    @property
    def total_seconds(self) -> float:
        return sum(self.seconds.values())

    def link(self, ranks: list[int] | None) -> str:
        """"machine" for a group inside one machine, "network" for one that spans machines."""
        if self.machine_size is None or not ranks:
            return "machine"
        return "machine" if len({r // self.machine_size for r in ranks}) == 1 else "network"

    def duration(self, kind: str, nbytes: int, world: int, ranks: list[int] | None = None) -> float:
        gbps = self.bus_gbps if self.link(ranks) == "machine" else self.net_gbps
        return model_seconds(kind, nbytes, world, gbps, self.latency_us * 1e-6)

    def issue(self, kind: str, nbytes: int, world: int, outputs: list, tensors: list, ranks: list[int] | None = None,
              fill=lambda: None):
        """Times one collective among `ranks` (of `world` ranks) whose results are `outputs` (of all its
        `tensors`, written by `fill`); returns its c10d Work, boxed for the dispatcher."""
        seconds = self.duration(kind, nbytes, world, ranks)
        device = outputs[0].device if outputs else torch.device("cpu")
        link = self.link(ranks)
        with self._lock:
            self.calls[kind] += 1
            self.bytes[kind] += nbytes
            self.seconds[kind] += seconds
            self.link_seconds[link] += seconds
            lane = self._lane(device, link)
            future = lane.issue(seconds, outputs, tensors, fill)
        return torch._C._distributed_c10d._create_work_from_future(future).boxed()

    def _lane(self, device: torch.device, link: str):
        key = (device.type, device.index, link)
        if key not in self._lanes:
            match device.type:
                case "cpu":
                    self._lanes[key] = _CpuLane()
                case "cuda":
                    index = device.index if device.index is not None else torch.cuda.current_device()
                    self._lanes[key] = _CudaLane(torch.device("cuda", index), self.cycles_per_s)
                case _:
                    raise NotImplementedError(f"sim_world simulates collectives on cpu and cuda tensors, "
                                              f"not {device.type}")
        return self._lanes[key]

    def step_done(self, step: int, seconds: float) -> None:
        """Called at each `step N loss L Ts` line: the communication issued since the last one."""
        with self._lock:
            calls, comm = self.total_calls, self.total_seconds
            self.steps.append(dict(step=step, step_s=seconds, comm_s=round(comm - self._mark[1], 6),
                                   calls=calls - self._mark[0]))
            self._mark = (calls, comm)

    def close(self) -> None:
        """Waits for every collective issued, and stops the lanes' threads."""
        with self._lock:
            for lane in self._lanes.values():
                lane.close()
            self._lanes.clear()

    def summary(self) -> dict:
        """Everything issued so far, after waiting for it to finish."""
        for lane in self._lanes.values():
            lane.finish()
        timed = self.steps[WARMUP_STEPS:] or self.steps
        cuda = [lane for lane in self._lanes.values() if isinstance(lane, _CudaLane)]
        result = dict(world=self.world, bus_gbps="inf" if math.isinf(self.bus_gbps) else self.bus_gbps,
                      machine_size=self.machine_size, net_gbps="inf" if math.isinf(self.net_gbps) else self.net_gbps,
                      comm_s_by_link={link: round(seconds, 6) for link, seconds in sorted(self.link_seconds.items())},
                      latency_us=self.latency_us, collectives=self.total_calls, comm_s=round(self.total_seconds, 6),
                      by_kind={kind: dict(calls=self.calls[kind], bytes=self.bytes[kind],
                                          comm_s=round(self.seconds[kind], 6))
                               for kind in sorted(self.calls)},
                      step_s=round(statistics.median(s["step_s"] for s in timed), 4) if timed else None,
                      comm_s_per_step=round(statistics.median(s["comm_s"] for s in timed), 6) if timed else None,
                      steps=self.steps)
        if cuda:
            # the sleeps as CUDA events timed them, against comm_s: off when the SM clock under load
            # differs from the calibration's (then set SIM_CYCLES_PER_S) or a sleep waited for an SM
            result["cycles_per_s"] = [round(lane.cycles_per_s) for lane in cuda]
            result["measured_sleep_s"] = round(sum(lane.measured_s for lane in cuda), 6)
        return result


# --- the c10d kernels -------------------------------------------------------------------------
# Each takes the op's arguments by name (from its schema: trailing defaults may be left out) and the
# group's size, and returns (kind, bytes of the full buffer, the outputs the Work completes with, the
# fill that writes them). Every simulated rank holds rank 0's values: an all-gather writes its input
# into every rank's slot, a reduce-scatter writes rank 0's share of its input (as AVG over equal
# ranks would). So results are finite, and the writes take memory bandwidth as NCCL's do.

def _group_of(args: dict, sim: Sim) -> tuple[int, list[int] | None]:
    """The group's size and its ranks (None where they cannot be found: then one machine's)."""
    try:
        group = dist.ProcessGroup.unbox(args["process_group"])
    except Exception:  # an older torch without unbox: this process has one group, the world
        return sim.world, list(range(sim.world))
    try:
        return group.size(), dist.get_process_group_ranks(group)
    except Exception:  # a group torch.distributed does not know
        return group.size(), None


def _gather_into(output: torch.Tensor, input: torch.Tensor, world: int) -> None:
    """Every slot of `output` becomes `input` (slot 0 may be `input` itself, as FSDP2 passes it)."""
    slots, source = output.view(world, -1), input.reshape(-1)
    if slots[0].data_ptr() != source.data_ptr():
        slots[0].copy_(source)
    slots[1:].copy_(source.expand(world - 1, -1))


def _allgather_base(a, world):
    output, input = a["output_tensor"], a["input_tensor"]
    return "all_gather", _nbytes([output]), [output], lambda: _gather_into(output, input, world)


def _reduce_scatter_base(a, world):
    output, input = a["output_tensor"], a["input_tensor"]
    return "reduce_scatter", _nbytes([input]), [output], lambda: output.copy_(input.view(world, -1)[0].view_as(output))


def _allreduce(a, world):
    return "all_reduce", _nbytes(a["tensors"]), list(a["tensors"]), lambda: None


def _allgather(a, world):
    outputs = _flat(a["output_tensors"])

    def fill():
        for slots, input in zip(a["output_tensors"], a["input_tensors"]):
            for slot in slots:
                if slot.data_ptr() != input.data_ptr():
                    slot.copy_(input)
    return "all_gather", _nbytes(outputs), outputs, fill


def _allgather_coalesced(a, world):
    def fill():
        for output, input in zip(a["outputs"], a["inputs"]):
            _gather_into(output, input, world)
    return "all_gather", _nbytes(a["outputs"]), list(a["outputs"]), fill


def _reduce_scatter(a, world):
    def fill():
        for output, inputs in zip(a["output_tensors"], a["input_tensors"]):
            output.copy_(inputs[0])
    return "reduce_scatter", _nbytes(_flat(a["input_tensors"])), list(a["output_tensors"]), fill


def _reduce_scatter_coalesced(a, world):
    def fill():
        for output, input in zip(a["outputs"], a["inputs"]):
            output.copy_(input.view(world, -1)[0].view_as(output))
    return "reduce_scatter", _nbytes(a["inputs"]), list(a["outputs"]), fill


def _broadcast(a, world):
    return "broadcast", _nbytes(a["tensors"]), list(a["tensors"]), lambda: None


def _barrier(a, world):
    return "barrier", 0, [a["tensor"]], lambda: None


KERNELS = {
    "_allgather_base_": _allgather_base,
    "_reduce_scatter_base_": _reduce_scatter_base,
    "allreduce_": _allreduce,
    "allreduce_coalesced_": _allreduce,
    "allgather_": _allgather,
    "allgather_into_tensor_coalesced_": _allgather_coalesced,
    "reduce_scatter_": _reduce_scatter,
    "reduce_scatter_tensor_coalesced_": _reduce_scatter_coalesced,
    "broadcast_": _broadcast,
    "barrier": _barrier,
}


def _kernel(sim: Sim, handler, names: list[str], returns_tensors: bool):
    def kernel(*args, **kwargs):
        a = dict(zip(names, args), **kwargs)
        world, ranks = _group_of(a, sim)
        kind, nbytes, outputs, fill = handler(a, world)
        tensors = [t for t in _flat(list(a.values())) if isinstance(t, torch.Tensor)]
        work = sim.issue(kind, nbytes, world, outputs, tensors, ranks, fill)
        return (args[0], work) if returns_tensors else work
    return kernel


# --- installing it in this process --------------------------------------------------------------

_installed: dict = {}


def install(world: int, bus_gbps: float = DEFAULT_BUS_GBPS, latency_us: float | None = None,
            cycles_per_s: float | None = None, machine_size: int | None = None,
            net_gbps: float = DEFAULT_NET_GBPS) -> Sim:
    """Makes this process rank 0 of a simulated world: init_process_group (whatever backend it asks
    for) joins the "sim" backend, c10d's collectives are timed, Linnet's device check is off."""
    if _installed:
        raise RuntimeError("sim_world is already installed in this process; uninstall() first")
    from torch.testing._internal.distributed.fake_pg import FakeStore  # also registers "fake"

    sim = Sim(world, bus_gbps, latency_us, cycles_per_s, machine_size, net_gbps)
    if "SIM" not in dist.Backend._plugins:
        fake = dist.Backend._plugins["FAKE"]
        dist.Backend.register_backend("sim", fake.creator_fn, extended_api=fake.extended_api, devices=["cpu", "cuda"])
    library = torch.library.Library("c10d", "IMPL")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # "Overriding a previously registered kernel": that is the point
        for name, handler in KERNELS.items():
            try:
                schema = torch._C._get_schema(f"c10d::{name}", "")
            except RuntimeError:
                continue  # not in this torch
            kernel = _kernel(sim, handler, [arg.name for arg in schema.arguments], len(schema.returns) == 2)
            for key in ("CPU", "CUDA"):
                library.impl(name, kernel, key)

    init = dist.init_process_group

    def sim_init(*args, **kwargs):
        init("sim", store=FakeStore(), rank=0, world_size=world)
        _skip_linnet_device_check()

    all_reduce = dist.all_reduce

    def sim_all_reduce(tensor, op=dist.ReduceOp.SUM, group=None, *args, **kwargs):
        # Every simulated rank holds the same values, so their SUM is the group's size times them. Here
        # rather than in the kernel: the kernel's ReduceOp is opaque in older torch.
        work = all_reduce(tensor, op, group, *args, **kwargs)
        if op == dist.ReduceOp.SUM:
            tensor.mul_(world if group is None else dist.get_world_size(group))
        return work

    dist.init_process_group, dist.all_reduce = sim_init, sim_all_reduce
    _installed.update(sim=sim, library=library, init=init, all_reduce=all_reduce)
    _skip_linnet_device_check()
    return sim


def _skip_linnet_device_check() -> None:
    """fully_shard wants nccl on cuda and gloo on cpu. Patched only where the script has imported
    Linnet (step.py does before init_process_group): a FSDP2 run never loads the extension."""
    shard = sys.modules.get("linnet.torch.shard")
    if shard is not None and "check_device" not in _installed:
        _installed["check_device"] = shard._check_device
        shard._check_device = lambda *args, **kwargs: None


def uninstall() -> None:
    """Gives c10d its kernels back and undoes the patches (the process group, if any, stays)."""
    if not _installed:
        return
    _installed["sim"].close()
    _installed["library"]._destroy()
    dist.init_process_group, dist.all_reduce = _installed["init"], _installed["all_reduce"]
    if "check_device" in _installed:
        sys.modules["linnet.torch.shard"]._check_device = _installed["check_device"]
    _installed.clear()


class _StepLines:
    """Passes the script's stdout through, and tells the Sim of each `step N loss L Ts` line."""

    STEP = re.compile(r"^step (\d+) loss \S+ ([0-9.]+)s$")

    def __init__(self, stream, sim: Sim):
        self._stream, self._sim, self._line = stream, sim, ""

    def write(self, text: str) -> int:
        self._line += text
        *lines, self._line = self._line.split("\n")
        for line in lines:
            if match := self.STEP.match(line.strip()):
                self._sim.step_done(int(match[1]), float(match[2]))
        return self._stream.write(text)

    def __getattr__(self, name):
        return getattr(self._stream, name)


def _from_env() -> Sim:
    world = int(os.environ["SIM_WORLD"])
    bus = float(os.environ.get("SIM_BUS_GBPS", DEFAULT_BUS_GBPS))  # float("inf") parses "inf"
    latency = os.environ.get("SIM_LATENCY_US")
    cycles = os.environ.get("SIM_CYCLES_PER_S")
    machine = os.environ.get("SIM_MACHINE_SIZE")
    return install(world, bus, float(latency) if latency is not None else None, float(cycles) if cycles else None,
                   int(machine) if machine else None, float(os.environ.get("SIM_NET_GBPS", DEFAULT_NET_GBPS)))


def _last_sim(path: str) -> dict:
    with open(path) as log:
        lines = [line for line in log if line.startswith("SIM ")]
    if not lines:
        raise SystemExit(f"{path} has no SIM line: was it written by sim_world.py?")
    return json.loads(lines[-1][4:])


def compare(with_comm: str, without_comm: str) -> dict:
    """The exposed share of communication, from the logs of the same run at a bandwidth and at inf."""
    sim, base = _last_sim(with_comm), _last_sim(without_comm)
    exposed = (sim["step_s"] - base["step_s"]) / sim["comm_s_per_step"] if sim["comm_s_per_step"] else None
    return dict(world=sim["world"], bus_gbps=sim["bus_gbps"], step_s=sim["step_s"], step_s_without_comm=base["step_s"],
                comm_s_per_step=sim["comm_s_per_step"], exposed=round(exposed, 3) if exposed is not None else None)


def main(argv: list[str]) -> None:
    if argv[:1] == ["--compare"]:
        if len(argv) != 3:
            raise SystemExit("usage: sim_world.py --compare LOG_AT_A_BANDWIDTH LOG_AT_INF")
        print(json.dumps(compare(argv[1], argv[2])))
        return
    if not argv:
        raise SystemExit(__doc__)
    sim = _from_env()
    saved = sys.argv, list(sys.path), sys.stdout
    sys.argv = argv
    sys.path.insert(0, os.path.dirname(os.path.abspath(argv[0])))  # step.py imports its neighbour common.py
    sys.stdout = _StepLines(sys.stdout, sim)
    try:
        runpy.run_path(argv[0], run_name="__main__")
    finally:
        sys.argv, sys.path, sys.stdout = saved
        print("SIM " + json.dumps(sim.summary()), flush=True)
        uninstall()


if __name__ == "__main__":
    main(sys.argv[1:])
