"""benchmarks/sim_world.py on the CPU: its timing model, collectives that take the time the model
gives them (through torch.distributed and through the dispatcher ops Linnet's C++ calls), and a
Linnet training step as rank 0 of a simulated world of four."""

from __future__ import annotations

import importlib.util
import json
import time
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.distributed as dist

spec = importlib.util.spec_from_file_location("sim_world", Path(__file__).parents[1] / "benchmarks" / "sim_world.py")
sim_world = importlib.util.module_from_spec(spec)
spec.loader.exec_module(sim_world)

GB = 10**9
# all_gather_into_tensor and reduce_scatter_tensor, deprecated in torch 2.13, are what 2.11 has
pytestmark = pytest.mark.filterwarnings("ignore:`torch.distributed.:FutureWarning")


@pytest.mark.parametrize(
    "world, gather, reduce, broadcast",
    [(2, 0.005, 0.010, 0.010), (8, 0.00875, 0.0175, 0.010)],  # seconds for 1 GB at 100 GB/s, no latency
)
def test_the_model_follows_nccl_bus_bandwidth(world, gather, reduce, broadcast):
    def seconds(kind, latency=0.0):
        return sim_world.model_seconds(kind, GB, world, 100.0, latency)

    assert seconds("all_gather") == pytest.approx(gather)  # S (n-1)/n / busbw
    assert seconds("reduce_scatter") == pytest.approx(gather)
    assert seconds("all_reduce") == pytest.approx(reduce)  # 2 S (n-1)/n / busbw
    assert seconds("broadcast") == pytest.approx(broadcast)  # S / busbw
    assert seconds("barrier") == 0.0
    assert seconds("all_gather", latency=1e-5) == pytest.approx(gather + 1e-5)
    assert sim_world.model_seconds("all_reduce", GB, world, float("inf"), 1e-5) == 1e-5


def test_latency_defaults_to_ten_microseconds_and_to_nothing_at_infinite_bandwidth():
    assert sim_world.Sim(4, 360.0, None).latency_us == 10.0
    assert sim_world.Sim(4, float("inf"), None).duration("all_gather", GB, 4) == 0.0
    assert sim_world.Sim(4, float("inf"), 5.0).duration("all_gather", GB, 4) == pytest.approx(5e-6)
    with pytest.raises(ValueError, match="SIM_BUS_GBPS and SIM_NET_GBPS must be positive"):
        sim_world.Sim(4, 0.0, None)


@pytest.fixture
def simulated():
    """Rank 0 of 4 at 5 MB/s and no latency: a 1 MiB gather takes 0.157 s."""
    sim = sim_world.install(4, bus_gbps=0.005, latency_us=0.0)
    try:
        dist.init_process_group("gloo")  # any backend asked for joins the simulated world
        yield sim
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()
        sim_world.uninstall()


def elapsed(since: float) -> float:
    return time.perf_counter() - since


def test_a_collective_returns_at_once_and_its_wait_takes_the_modelled_time(simulated):
    assert (dist.get_rank(), dist.get_world_size(), dist.get_backend()) == (0, 4, "sim")
    part, full = torch.ones(2**16), torch.empty(2**18)  # 256 KiB of f32 a rank, 1 MiB gathered
    modelled = simulated.duration("all_gather", full.numel() * 4, 4)
    assert modelled == pytest.approx(0.157, abs=1e-3)
    start = time.perf_counter()
    work = dist.all_gather_into_tensor(full, part, async_op=True)
    assert elapsed(start) < 0.05 and not work.is_completed()
    work.wait()
    assert 0.95 * modelled <= elapsed(start) < modelled + 0.1
    # two in flight run one after the other, as on one communicator
    start = time.perf_counter()
    works = [dist.all_gather_into_tensor(full, part, async_op=True),
             dist.reduce_scatter_tensor(part, full, async_op=True)]
    for work in works:
        work.wait()
    assert 1.95 * modelled <= elapsed(start) < 2 * modelled + 0.1
    assert simulated.calls == {"all_gather": 2, "reduce_scatter": 1}
    assert simulated.total_seconds == pytest.approx(3 * modelled)


def test_an_all_reduce_sum_counts_every_rank_and_blocks_for_its_time(simulated):
    counts = torch.full((2**16,), 2.0)  # 256 KiB: 2 x 3/4 of it on the bus, 0.079 s
    start = time.perf_counter()
    dist.all_reduce(counts)
    assert elapsed(start) >= 0.95 * simulated.duration("all_reduce", 2**18, 4)
    assert torch.all(counts == 8.0)
    dist.all_reduce(counts, op=dist.ReduceOp.MAX)
    assert torch.all(counts == 8.0)
    dist.broadcast(counts, src=0)
    dist.barrier()
    dist.all_gather([torch.empty(3) for _ in range(4)], torch.ones(3))
    assert simulated.calls == {"all_reduce": 2, "broadcast": 1, "barrier": 1, "all_gather": 1}


def test_the_dispatcher_path_that_linnets_collectives_take_waits_too(simulated):
    """c10d::_allgather_base_ with async_op, the work registered against the output, then
    _c10d_functional::wait_tensor: what csrc/collectives.cpp does."""
    part, full = torch.ones(2**16), torch.empty(2**18)
    start = time.perf_counter()
    _, work = torch.ops.c10d._allgather_base_(full, part, dist.group.WORLD.boxed(), True, -1)
    torch._C._distributed_c10d._register_work(full, dist.Work.unbox(work))
    assert elapsed(start) < 0.05
    torch.ops._c10d_functional.wait_tensor(full)
    assert elapsed(start) >= 0.95 * simulated.duration("all_gather", 2**20, 4)


def test_every_simulated_rank_holds_rank_0s_values(simulated):
    """Results are rank 0's, never leftover memory: a run through them stays finite."""
    part = torch.arange(4.0)
    full = torch.full((16,), float("nan"))
    dist.all_gather_into_tensor(full, part)
    assert torch.equal(full, part.repeat(4))
    dist.all_gather_into_tensor(full, full[:4])  # FSDP2 gathers from its own slot
    assert torch.equal(full, part.repeat(4))
    share = torch.full((4,), float("nan"))
    dist.reduce_scatter_tensor(share, torch.arange(16.0))
    assert torch.equal(share, torch.arange(4.0))
    slots = [torch.full((4,), float("nan")) for _ in range(4)]
    dist.all_gather(slots, part)
    assert all(torch.equal(slot, part) for slot in slots)
    torch.ops.c10d._allgather_base_(full.fill_(float("nan")), part, dist.group.WORLD.boxed(), False, -1)[1].wait()
    assert torch.equal(full, part.repeat(4))


STEP_SCRIPT = """
import time
import torch, torch.distributed as dist
dist.init_process_group("nccl")
part, full = torch.ones(2**10), torch.empty(2**12)  # 16 KiB gathered: 12 ms at 1 MB/s
for step in range(6):
    start = time.perf_counter()
    dist.all_gather_into_tensor(full, part)
    print(f"step {step} loss 1.000 {time.perf_counter() - start:.4f}s", flush=True)
dist.destroy_process_group()
"""


def test_the_harness_reports_each_steps_communication_and_the_exposed_share(tmp_path, monkeypatch, capsys):
    script = tmp_path / "step.py"
    script.write_text(STEP_SCRIPT)
    monkeypatch.setenv("SIM_WORLD", "4")
    logs = []
    for bandwidth in ("0.001", "inf"):
        monkeypatch.setenv("SIM_BUS_GBPS", bandwidth)
        sim_world.main([str(script)])
        logs.append(tmp_path / f"{bandwidth}.log")
        logs[-1].write_text(capsys.readouterr().out)
    report = json.loads(logs[0].read_text().splitlines()[-1].removeprefix("SIM "))
    assert (report["world"], report["bus_gbps"], report["collectives"], len(report["steps"])) == (4, 0.001, 6, 6)
    modelled = 10e-6 + 3 / 4 * 2**14 / 1e6
    assert report["comm_s_per_step"] == pytest.approx(modelled)
    assert report["by_kind"]["all_gather"] == dict(calls=6, bytes=6 * 2**14, comm_s=pytest.approx(6 * modelled))
    comparison = sim_world.compare(str(logs[0]), str(logs[1]))
    assert 0.9 < comparison["exposed"] < 1.5  # a gather waited for at once hides nothing
    assert not dist.is_initialized() and not sim_world._installed


cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


@cuda
def test_on_cuda_the_waiting_stream_waits_and_nothing_else(simulated):
    """As FSDP2 gathers: in its own stream, without async_op. Neither the host nor another stream waits."""
    part, full = torch.ones(2**16, device="cuda"), torch.empty(2**18, device="cuda")
    modelled = simulated.duration("all_gather", 2**20, 4)
    dist.all_reduce(torch.ones(1, device="cuda"))  # the first collective on the GPU calibrates the sleep
    torch.cuda.synchronize()
    waiting, other = torch.cuda.Stream(), torch.cuda.current_stream()
    start = time.perf_counter()
    with torch.cuda.stream(waiting):
        dist.all_gather_into_tensor(full, part)
        waited = waiting.record_event()
    not_waited = other.record_event()
    not_waited.synchronize()
    assert elapsed(start) < 0.05
    waited.synchronize()
    assert 0.95 * modelled <= elapsed(start) < modelled + 0.05
    summary = simulated.summary()  # the sleeps as CUDA events timed them, against the model
    assert summary["measured_sleep_s"] == pytest.approx(summary["comm_s"], rel=0.05)


@cuda
def test_on_cuda_wait_tensor_makes_the_current_stream_wait_not_the_host(simulated):
    part, full = torch.ones(2**16, device="cuda"), torch.empty(2**18, device="cuda")
    dist.all_reduce(torch.ones(1, device="cuda"))
    torch.cuda.synchronize()
    start = time.perf_counter()
    _, work = torch.ops.c10d._allgather_base_(full, part, dist.group.WORLD.boxed(), True, -1)
    torch._C._distributed_c10d._register_work(full, dist.Work.unbox(work))
    torch.ops._c10d_functional.wait_tensor(full)
    done = torch.cuda.current_stream().record_event()
    assert elapsed(start) < 0.05
    done.synchronize()
    assert elapsed(start) >= 0.95 * simulated.duration("all_gather", 2**20, 4)


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=cuda)])
def test_a_linnet_training_step_runs_as_rank_0_of_four(device):
    from linnet import nest
    from linnet.data.packing import Row
    from linnet.torch import fully_shard
    from linnet.torch.train import train

    sim = sim_world.install(4)  # 360 GB/s: the tiny model's collectives take microseconds
    try:
        dist.init_process_group("gloo")
        model = nest.load("tiny-llama", generics={"Batch": 1, "MaxSeq": 64, "T": "f32"}, cast_dtype=True,
                          trainable=True, weights="random", device=device, entry="loss_packed")
        fully_shard(model)
        assert model.sharding.world == 4
        tokens = np.random.default_rng(0).integers(0, 512, 64, dtype=np.int32)
        row = Row(tokens=tokens, targets=np.roll(tokens, -1), positions=np.arange(64, dtype=np.int32),
                  segments=np.zeros(64, np.int32), weights=np.r_[np.ones(63), 0.0].astype(np.float32), filled=64)
        optimizer = torch.optim.AdamW(list(model.parameters()), lr=1e-3)
        # train all-reduces the rows' count: it stops unless every one of the four ranks has one
        history = train(model, iter([row]), optimizer=optimizer, steps=1, on_step=lambda s: None)
        assert len(history.steps) == 1  # finite: every simulated rank holds rank 0's parts
        groups = 1 + 2 + 1  # the embedding, two layers, the final norm (the head is tied)
        assert sim.calls["all_gather"] >= groups and sim.calls["reduce_scatter"] >= groups
        # train's two a step, and the ranks' agreement on the inputs (linnet/torch/agree.py)
        assert sim.calls["all_reduce"] == 3
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()
        sim_world.uninstall()


def test_machines_a_group_inside_one_moves_at_the_bus_bandwidth_and_one_across_them_at_the_networks():
    sim = sim_world.Sim(8, 100.0, 0.0, machine_size=4, net_gbps=10.0)
    assert sim.duration("all_gather", GB, 4, [0, 1, 2, 3]) == pytest.approx(0.0075)  # 3/4 GB at 100 GB/s
    assert sim.duration("all_reduce", GB, 2, [0, 4]) == pytest.approx(0.1)  # 2 x 1/2 GB at 10 GB/s
    assert sim.duration("all_gather", GB, 8, list(range(8))) == pytest.approx(0.0875)  # a flat ring crosses the network
    assert sim_world.Sim(8, 100.0, 0.0).duration("all_gather", GB, 8, list(range(8))) == pytest.approx(0.00875)
    assert sim_world.Sim(8, float("inf"), 0.0, machine_size=4).duration("all_reduce", GB, 2, [0, 4]) == 0.0
    with pytest.raises(ValueError, match="SIM_MACHINE_SIZE must divide SIM_WORLD=8, got 3"):
        sim_world.Sim(8, 100.0, 0.0, machine_size=3)


def test_a_hybrid_mesh_times_each_group_on_its_link_and_both_links_at_once():
    """Rank 0 of 2 machines of 2: the shard group inside machine 0 at 5 MB/s, the replicate group across at
    2.5 MB/s; a gather inside and an all-reduce across, issued together, end together, not one after the other."""
    from torch.distributed.device_mesh import init_device_mesh

    sim = sim_world.install(4, bus_gbps=0.005, latency_us=0.0, machine_size=2, net_gbps=0.0025)
    try:
        dist.init_process_group("gloo")
        mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("replicate", "shard"))
        shard, replicate = mesh.get_group("shard"), mesh.get_group("replicate")
        part, full, counts = torch.ones(2**17), torch.empty(2**18), torch.full((2**16,), 2.0)
        inside = sim.duration("all_gather", 2**20, 2, [0, 1])  # 1 MiB, half on the bus: 0.105 s
        across = sim.duration("all_reduce", 2**18, 2, [0, 2])  # 256 KiB, all of it on the network: 0.105 s
        assert across == pytest.approx(2 * 2**18 / 2 / 0.0025e9) and inside == pytest.approx(2**20 / 2 / 0.005e9)
        start = time.perf_counter()
        works = [dist.all_gather_into_tensor(full, part, group=shard, async_op=True),
                 dist.all_reduce(counts, group=replicate, async_op=True)]
        for work in works:
            work.wait()
        assert max(inside, across) * 0.95 <= elapsed(start) < inside + across - 0.05
        assert torch.all(counts == 4.0)  # the SUM of the replicate group's two ranks
        assert sim.link_seconds == pytest.approx({"machine": inside, "network": across})
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()
        sim_world.uninstall()
