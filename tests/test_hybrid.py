"""fully_shard over a 2-D mesh ("replicate", "shard"), over Gloo: training equals unsharded single-process
training on the same global batch, as the flat sharding of tests/test_fully_shard.py does."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from distributed import run
from test_fully_shard import EPS, LR, STEPS, card, load, reference, relative_error, rows  # noqa: F401 (card: a fixture)


def hybrid_training(rank: int, world: int, card, shape: tuple[int, int], compile: str | None, recompute: str, prefetch: int):
    from torch.distributed.device_mesh import init_device_mesh

    from linnet.checkpoint import Checkpointer
    from linnet.torch import fully_shard
    from linnet.torch.shard import gathered_weights
    from linnet.train import train

    mesh = init_device_mesh("cpu", shape, mesh_dim_names=("replicate", "shard"))
    model = fully_shard(load(card, compile=compile), mesh=mesh, recompute=recompute, prefetch=prefetch)
    assert (model.sharding.replicas, model.sharding.world) == shape
    optimizer = torch.optim.AdamW(list(model.parameters()), lr=LR, weight_decay=0.0, eps=EPS)
    history = train(model, iter(rows(world)[rank::world]), optimizer=optimizer, steps=STEPS, on_step=lambda s: None)
    weights = {name: tensor.numpy() for name, tensor in gathered_weights(model, torch.float32)}
    try:
        Checkpointer("unused", model, optimizer)
        refused = None
    except NotImplementedError as error:
        refused = str(error)
    return [s.loss for s in history.steps], weights, refused


@pytest.mark.parametrize("shape, compile, recompute, prefetch", [
    ((2, 2), None, "gather", 1),
    ((2, 2), None, "full", 0),
    ((4, 1), None, "gather", 1),  # replicas only: data parallel
    ((2, 2), "inductor", "gather", 1),
])
def test_a_2d_mesh_trains_as_single_process(card, shape, compile, recompute, prefetch):
    expected_losses, expected_weights = reference(card, 4)
    for losses, weights, refused in run(hybrid_training, 4, card, shape, compile, recompute, prefetch,
                                        timeout=900 if compile else 300):
        np.testing.assert_allclose(losses, expected_losses, rtol=1e-5)
        for name, tensor in weights.items():
            assert relative_error(tensor, expected_weights[name].numpy()) < 1e-5, name
        assert refused.startswith("checkpoints of a model sharded over a 2-D mesh")


def bad_mesh(rank: int, world: int, card, shape: tuple[int, ...], names: tuple[str, ...], with_group: bool) -> str:
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    from linnet.torch import fully_shard

    mesh = init_device_mesh("cpu", shape, mesh_dim_names=names)
    try:
        fully_shard(load(card), mesh=mesh, group=dist.group.WORLD if with_group else None)
    except ValueError as error:
        return str(error)
    return "accepted"


@pytest.mark.parametrize("shape, names, with_group, message", [
    ((1, 2), ("shard", "replicate"), False, "a mesh of one dimension, or of two named ('replicate', 'shard'); got 2 dimensions named ('shard', 'replicate')"),
    ((2, 1, 1), ("a", "replicate", "shard"), False, "got 3 dimensions"),
    ((2,), ("shard",), True, "fully_shard takes group= or mesh=, not both"),
])
def test_a_mesh_it_cannot_use_is_refused(card, shape, names, with_group, message):
    for said in run(bad_mesh, 2, card, shape, names, with_group, timeout=120):
        assert message in said
