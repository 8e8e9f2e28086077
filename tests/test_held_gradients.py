"""Held gradients (linnet/torch/held_gradients.py): micro-batches whose backwards hold each group's whole
gradient, then one that does not, give the gradients of micro-batches each reduce-scattered, with one
reduce-scatter a part for the held ones together: over 2 and 3 ranks, a 2-D mesh, a looked-up embedding,
eager and compiled."""

from __future__ import annotations

import numpy as np
import pytest

from distributed import run
from test_fully_shard import card as card, untied as untied  # fixtures: "as" marks them used for pyflakes
from test_fully_shard import load, rows

from linnet.torch.train import row_tensors

MICRO_BATCHES = 3


def reduce_scatters(function) -> int:
    """function(), and how many reduce-scatters it launched (as the profiler saw them called)."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU]) as seen:
        function()
    return sum(event.count for event in seen.key_averages() if event.key == "linnet::reduce_scatter")


def held_and_synced(rank: int, world: int, card, compile: str | None, mesh_shape: tuple | None) -> dict:
    """The gradients of MICRO_BATCHES micro-batches, each reduce-scattered, then held but the last; and
    the reduce-scatters each way took."""
    from torch.distributed.device_mesh import init_device_mesh

    from linnet.torch import fully_shard

    mesh = None if mesh_shape is None else init_device_mesh("cpu", mesh_shape, mesh_dim_names=("replicate", "shard"))
    model = fully_shard(load(card, compile=compile), mesh=mesh)
    data = rows(world)
    micro_batches = [row_tensors([data[index * world + rank]]) for index in range(MICRO_BATCHES)]

    def accumulate(hold: bool) -> list:
        for index, inputs in enumerate(micro_batches):
            if hold:
                model.hold_gradients(index < MICRO_BATCHES - 1)
            model.loss_packed(*inputs).backward()
        gradients = [part.grad.clone() for part in model.parameters()]
        for part in model.parameters():
            part.grad = None
        return gradients

    def released_without_a_backward() -> list:
        """Held, released, held again before any backward added the first release: both are added."""
        for index, inputs in enumerate(micro_batches):
            if index < MICRO_BATCHES - 1:
                model.hold_gradients(True)
            model.loss_packed(*inputs).backward()
            model.hold_gradients(False)
        gradients = [part.grad.clone() for part in model.parameters()]
        for part in model.parameters():
            part.grad = None
        return gradients

    synced = accumulate(hold=False)  # compiles the plain entry
    held = accumulate(hold=True)  # and the held one
    again = released_without_a_backward()
    counts = {"synced": reduce_scatters(lambda: accumulate(hold=False)),
              "held": reduce_scatters(lambda: accumulate(hold=True))}
    return dict(synced=synced, held=held, again=again, counts=counts, parts=len(list(model.parameters())))


def assert_held_as_synced(results: list) -> None:
    for result in results:
        for synced, held, again in zip(result["synced"], result["held"], result["again"], strict=True):
            np.testing.assert_allclose(held.numpy(), synced.numpy(), rtol=1e-5, atol=1e-7)
            np.testing.assert_allclose(again.numpy(), synced.numpy(), rtol=1e-5, atol=1e-7)
        counts = result["counts"]
        per_backward = counts["synced"] // MICRO_BATCHES
        assert per_backward > 0 and counts["synced"] == MICRO_BATCHES * per_backward
        # the last micro-batch's, and one a part for the held ones (with replicas, a backward also averages the
        # late parts across them: linnet/torch/hybrid.py)
        assert counts["held"] == per_backward + result["parts"], counts


@pytest.mark.parametrize("world, mesh_shape", [(2, None), (3, None), (4, (2, 2))])
def test_held_micro_batches_give_the_synced_gradients(card, world, mesh_shape):
    assert_held_as_synced(run(held_and_synced, world, card, None, mesh_shape, timeout=300))


def test_held_with_a_looked_up_embedding(untied):
    """The untied embedding's rows are gathered, not its table: its gradient reaches its part every
    micro-batch, held or not."""
    results = run(held_and_synced, 2, untied, None, None, timeout=300)
    for result in results:
        for synced, held in zip(result["synced"], result["held"], strict=True):
            np.testing.assert_allclose(held.numpy(), synced.numpy(), rtol=1e-5, atol=1e-7)
        counts = result["counts"]
        per_backward = counts["synced"] // MICRO_BATCHES
        assert counts["held"] == per_backward + result["parts"] - 1, counts  # the table's part holds nothing


@pytest.mark.slow
def test_held_compiled_gives_the_synced_gradients(card):
    assert_held_as_synced(run(held_and_synced, 2, card, "inductor", None, timeout=900))


def holding_on_one_rank(rank: int, world: int, card) -> bool:
    from linnet.torch import fully_shard

    model = fully_shard(load(card))
    model.hold_gradients(True)
    return model.held_gradients is None


def test_one_rank_holds_nothing(card):
    """Nothing is reduce-scattered over one rank: there is nothing to hold."""
    assert run(holding_on_one_rank, 1, card) == [True]


def test_holding_refuses_a_model_not_sharded(card):
    with pytest.raises(RuntimeError, match="fully_shard"):
        load(card).hold_gradients(True)
