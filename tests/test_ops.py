"""Linnet's custom ops (torch.ops.linnet.*) on the CPU: each against plain
PyTorch, through torch.library.opcheck and under torch.compile(fullgraph=True);
the collectives over Gloo at world sizes 1 to 4. Also builds and runs the
GoogleTest tests of the C++ (tests/cpp) where cmake and GoogleTest are installed.

    python -m pytest -q tests/test_ops.py
"""

from __future__ import annotations

import os
import shutil
import subprocess
import warnings
from pathlib import Path

import pytest
import torch

from distributed import run
from linnet.torch import ops

ROOT = Path(__file__).resolve().parent.parent
NO_AUTOGRAD_KERNEL = "an autograd kernel was not registered"


def _random(numel: int, seed: int, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    return torch.randn(numel, generator=torch.Generator().manual_seed(seed)).to(dtype)


# The flat layout ------------------------------------------------------------


def _reference_layout(numels, align, world):
    offsets, end = [], 0
    for numel in numels:
        offsets.append(-(-end // align) * align)
        end = offsets[-1] + numel
    total = -(-end // (align * world)) * align * world
    return tuple(offsets), total, total // world


@pytest.mark.parametrize(
    "numels, align, world",
    [([3, 17, 0, 5], 16, 3), ([32, 64], 16, 2), ([3, 4, 5], 1, 1), ([], 16, 4), ([7, 10, 3], 4, 3)],
)
def test_flat_layout_matches_reference(numels, align, world):
    layout = ops.flat_layout(numels, align, world)
    assert (layout.offsets, layout.total, layout.part_size) == _reference_layout(numels, align, world)


@pytest.mark.parametrize(
    "numels, align, world, message",
    [([4, -1], 16, 2, r"numels\[1\] is -1"), ([4], 0, 2, "align must be at least 1"),
     ([4], 16, 0, "world must be at least 1")],
)
def test_flat_layout_rejects_bad_arguments(numels, align, world, message):
    with pytest.raises(ValueError, match=message):
        ops.flat_layout(numels, align, world)


def test_flat_layout_is_a_read_only_value():
    layout = ops.flat_layout([3, 17], 16, 2)
    assert isinstance(layout, ops.FlatLayout)
    assert repr(layout) == "FlatLayout(offsets=(0, 16), total=64, part_size=32)"
    for name in ("offsets", "total", "part_size", "extra"):
        with pytest.raises(AttributeError):
            setattr(layout, name, 0)
    with pytest.raises(TypeError, match="No constructor defined"):
        ops.FlatLayout()  # only flat_layout makes one


def test_flat_layout_is_a_constant_under_compile():
    outside = ops.flat_layout([3, 17], 16, 2)

    @torch.compile(fullgraph=True, backend="aot_eager")
    def scaled(x):
        inside = ops.flat_layout([x.numel(), 17], 16, 2)  # x's size is static here: a constant
        return x * inside.total + outside.offsets[1]

    torch.testing.assert_close(scaled(torch.ones(3)), torch.full((3,), 80.0))


# flatten, shard, group_views ------------------------------------------------


def _group(dtype=torch.float32, requires_grad=False):
    """Three tensors, one of them strided, and their flat layout over 3 ranks."""
    weight = _random(12, 0, dtype).reshape(4, 3).t()  # (3, 4), not contiguous
    tensors = [weight, _random(5, 1, dtype), _random(6, 2, dtype).reshape(2, 3)]
    if requires_grad:
        tensors = [t.detach().requires_grad_() for t in tensors]
    return tensors, ops.flat_layout([t.numel() for t in tensors], 4, 3)


def _reference_flatten(tensors, offsets, total):
    flat = torch.zeros(total, dtype=tensors[0].dtype)
    for tensor, offset in zip(tensors, offsets):
        flat[offset:offset + tensor.numel()] = tensor.reshape(-1)
    return flat


def _reference_shard(flat, rank, world):
    part_size = -(-flat.numel() // world)
    return torch.nn.functional.pad(flat, (0, part_size * world - flat.numel()))[rank * part_size:][:part_size]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_flatten_matches_reference(dtype):
    tensors, layout = _group(dtype)
    flat = ops.flatten(tensors, layout.offsets, layout.total)
    assert flat.dtype == dtype and flat.is_contiguous()
    torch.testing.assert_close(flat, _reference_flatten(tensors, layout.offsets, layout.total), rtol=0, atol=0)


def test_flatten_gradient_is_the_views_of_the_flat_gradient():
    tensors, layout = _group(requires_grad=True)
    weights = _random(layout.total, 3)
    (ops.flatten(tensors, layout.offsets, layout.total) * weights).sum().backward()
    for tensor, offset in zip(tensors, layout.offsets):
        torch.testing.assert_close(tensor.grad, weights[offset:offset + tensor.numel()].reshape(tensor.shape))


@pytest.mark.parametrize(
    "tensors, offsets, total, message",
    [
        ([torch.ones(2), torch.ones(2, dtype=torch.bfloat16)], [0, 4], 8, "expected every tensor to be Float"),
        ([torch.ones(4), torch.ones(2)], [0, 2], 8, "overlaps the tensor before it"),
        ([torch.ones(4)], [0], 3, "runs past total = 3"),
        ([torch.ones(4)], [0, 4], 8, "expected one offset per tensor"),
        ([torch.ones(4, dtype=torch.int32)], [0], 4, "floating dtype"),
    ],
)
def test_flatten_rejects_bad_arguments(tensors, offsets, total, message):
    with pytest.raises(RuntimeError, match=message):
        ops.flatten(tensors, offsets, total)


@pytest.mark.parametrize("numel, world", [(21, 4), (20, 4), (3, 4), (7, 1), (10, 3)])
def test_shard_matches_reference(numel, world):
    flat = _random(numel, 4)
    parts = [ops.shard(flat, rank, world) for rank in range(world)]
    for rank, part in enumerate(parts):
        torch.testing.assert_close(part, _reference_shard(flat, rank, world), rtol=0, atol=0)
    torch.testing.assert_close(torch.cat(parts)[:numel], flat, rtol=0, atol=0)


def test_shard_gradient_lands_on_the_part_it_came_from():
    flat = _random(21, 5).requires_grad_()
    ops.shard(flat, 3, 4).sum().backward()  # rank 3 holds elements 18..20 and 3 of padding
    torch.testing.assert_close(flat.grad, torch.cat([torch.zeros(18), torch.ones(3)]))


@pytest.mark.parametrize(
    "rank, world, message", [(4, 4, "expected 0 <= rank < world = 4"), (-1, 2, "got rank -1"), (0, 0, "world >= 1")]
)
def test_shard_rejects_bad_arguments(rank, world, message):
    with pytest.raises(RuntimeError, match=message):
        ops.shard(torch.ones(8), rank, world)


def test_group_views_match_reference_and_are_views():
    tensors, layout = _group()
    flat = ops.flatten(tensors, layout.offsets, layout.total)
    views = ops.group_views(flat, layout.offsets, [t.shape for t in tensors])
    for view, tensor, offset in zip(views, tensors, layout.offsets):
        torch.testing.assert_close(view, flat[offset:offset + tensor.numel()].view(tensor.shape), rtol=0, atol=0)
        torch.testing.assert_close(view, tensor, rtol=0, atol=0)
        assert view.untyped_storage().data_ptr() == flat.untyped_storage().data_ptr()


def test_group_views_gradient_reaches_the_flat_buffer():
    flat = _random(32, 6).requires_grad_()
    first, second = ops.group_views(flat, [0, 16], [(3, 2), (5,)])
    (first.sum() * 2 + second.sum()).backward()
    expected = torch.zeros(32)
    expected[:6], expected[16:21] = 2, 1
    torch.testing.assert_close(flat.grad, expected)


@pytest.mark.parametrize(
    "offsets, shapes, ndims, message",
    [([0, 16], [3, 2, 5], [2, 2], "runs past the 3 entries of shapes"),
     ([0, 30], [3, 2, 5], [2, 1], "does not fit in the flat buffer of 32"),
     ([0], [3, 2, 5], [2], "expected sum\\(ndims\\) == len\\(shapes\\)"),
     ([0, 16], [-3, 2, 5], [2, 1], "tensor 0 has a negative size in its shape \\[-3, 2\\]")],
)
def test_group_views_rejects_bad_arguments(offsets, shapes, ndims, message):
    with pytest.raises(RuntimeError, match=message):
        torch.ops.linnet.group_views(torch.ones(32), offsets, shapes, ndims)


def test_buffer_ops_opcheck():
    tensors, layout = _group(requires_grad=True)
    torch.library.opcheck(torch.ops.linnet.flatten.default, (tensors, layout.offsets, layout.total))
    torch.library.opcheck(torch.ops.linnet.shard.default, (_random(21, 7).requires_grad_(), 2, 4))
    torch.library.opcheck(
        torch.ops.linnet.group_views.default, (_random(32, 8).requires_grad_(), [0, 16], [3, 2, 5], [2, 1])
    )


def test_cast_into_sink_casts_and_sends_its_gradient_to_the_sink():
    part = _random(40, 9).requires_grad_()
    sink = torch.zeros((), dtype=torch.bfloat16).expand(40).requires_grad_()
    cast = ops.cast_into_sink(part, sink, torch.bfloat16)
    assert torch.equal(cast, part.detach().bfloat16())
    gradient = _random(40, 10, torch.bfloat16)
    cast.backward(gradient)
    assert part.grad is None and torch.equal(sink.grad, gradient)
    torch.library.opcheck(torch.ops.linnet.cast_into_sink.default, (part, torch.zeros(40, dtype=torch.bfloat16)
                                                                       .requires_grad_(), torch.bfloat16))
    with pytest.raises(RuntimeError, match=r"cast_into_sink: the sink must have the part's shape \[40\]"):
        ops.cast_into_sink(part, torch.zeros(39, dtype=torch.bfloat16), torch.bfloat16)


def test_buffer_ops_compile_with_their_gradients():
    def layout_round_trip(tensors, weights):
        layout = ops.flat_layout([t.numel() for t in tensors], 4, 3)
        flat = ops.flatten(tensors, layout.offsets, layout.total)
        part = ops.shard(flat, 1, 3)
        views = ops.group_views(flat, layout.offsets, [t.shape for t in tensors])
        return (part * weights).sum() + sum((v * v).sum() for v in views)

    weights = _random(12, 9)
    eager_inputs, _ = _group(requires_grad=True)
    compiled_inputs, _ = _group(requires_grad=True)
    expected = layout_round_trip(eager_inputs, weights)
    expected.backward()
    got = torch.compile(layout_round_trip, fullgraph=True, backend="inductor")(compiled_inputs, weights)
    got.backward()
    torch.testing.assert_close(got, expected)
    for compiled, eager in zip(compiled_inputs, eager_inputs):
        torch.testing.assert_close(compiled.grad, eager.grad)


# The collectives, over Gloo -------------------------------------------------


def _group_name() -> str:
    import torch.distributed as dist

    return dist.group.WORLD.group_name


def _collectives(rank: int, world: int) -> None:
    """Every collective at this world size, against plain PyTorch."""
    name = _group_name()
    part_size = 7  # odd: a gathered length that no world size above 1 divides evenly into 16s
    parts = [_random(part_size, 10 + r) for r in range(world)]

    # all_gather: the parts in rank order, cast; its gradient is the reduce-scatter of the gradients,
    # summed or averaged, in f32 or bf16.
    for dtype in (torch.bfloat16, torch.float32):
        for reduce_op, reduce_dtype in (("sum", None), ("avg", torch.float32), ("sum", torch.bfloat16)):
            part = parts[rank].clone().requires_grad_()
            full, token = ops.all_gather(part, dtype, world, name, reduce_op=reduce_op, reduce_dtype=reduce_dtype)
            full = ops.wait(full)
            assert full.dtype == dtype and token.numel() == 0
            torch.testing.assert_close(full, torch.cat(parts).to(dtype), rtol=0, atol=0)
            weights = [_random(part_size * world, 20 + r) for r in range(world)]
            (full.float() * weights[rank]).sum().backward()
            # Each rank's loss weighs its own full tensor; the cast back to `dtype` rounds the gradient.
            slot = slice(rank * part_size, (rank + 1) * part_size)
            expected = sum(w.to(dtype).float()[slot] for w in weights) / (world if reduce_op == "avg" else 1)
            bf16_sum = reduce_dtype == torch.bfloat16 and world > 1  # rounded at each of the sum's steps
            torch.testing.assert_close(part.grad, expected, **({"rtol": 2e-2, "atol": 1e-2} if bf16_sum else {}))
            reduced = ops.wait(ops.reduce_scatter(weights[rank].to(dtype), reduce_op, reduce_dtype or torch.float32,
                                                  world, name))
            torch.testing.assert_close(part.grad, reduced, rtol=0, atol=0)

    # reduce_scatter: summed or averaged in f32 or bf16, this rank's part, in f32; backward gathers the gradients.
    for dtype in (torch.bfloat16, torch.float32):
        for reduce_op in ("sum", "avg"):
            for reduce_dtype in (torch.float32, torch.bfloat16):
                fulls = [_random(part_size * world, 30 + r, dtype) for r in range(world)]
                full = fulls[rank].clone().requires_grad_()
                reduced = ops.wait(ops.reduce_scatter(full, reduce_op, reduce_dtype, world, name))
                assert reduced.dtype == torch.float32 and reduced.shape == (part_size,)
                total = sum(f.float() for f in fulls)
                expected = (total / world if reduce_op == "avg" else total)[rank * part_size:(rank + 1) * part_size]
                if reduce_dtype == torch.bfloat16 and world > 1:
                    torch.testing.assert_close(reduced, expected, rtol=2e-2, atol=2e-2)
                    continue
                torch.testing.assert_close(reduced, expected)
            grads = [_random(part_size, 40 + r) for r in range(world)]
            (reduced * grads[rank]).sum().backward()
            expected_grad = torch.cat(grads) / (world if reduce_op == "avg" else 1)
            torch.testing.assert_close(full.grad, expected_grad.to(dtype), rtol=0, atol=0)

    # What a collective reads is its own: the caller (or inductor, reusing a dead buffer) may
    # overwrite its input as soon as the launch returns, before the wait.
    fulls = [_random(part_size * world, 35 + r) for r in range(world)]
    full = fulls[rank].clone()
    reduced = ops.reduce_scatter(full, "sum", torch.float32, world, name)
    full.fill_(float("nan"))
    part = parts[rank].clone()
    gathered, _ = ops.all_gather(part, torch.float32, world, name)
    part.fill_(float("nan"))
    torch.testing.assert_close(ops.wait(reduced), sum(fulls)[rank * part_size:(rank + 1) * part_size])
    torch.testing.assert_close(ops.wait(gathered), torch.cat(parts), rtol=0, atol=0)

    # A group's whole life: lay out, flatten, keep the part, gather, view (numels that divide nothing).
    tensors = [_random(7, 50).reshape(7, 1), _random(10, 51), _random(3, 52)]
    layout = ops.flat_layout([t.numel() for t in tensors], 4, world)
    part = ops.shard(ops.flatten(tensors, layout.offsets, layout.total), rank, world)
    assert part.numel() == layout.part_size
    full = ops.wait(ops.all_gather(part, torch.bfloat16, world, name)[0])
    for view, tensor in zip(ops.group_views(full, layout.offsets, [t.shape for t in tensors]), tensors):
        torch.testing.assert_close(view, tensor.to(torch.bfloat16), rtol=0, atol=0)

    with pytest.raises(RuntimeError, match='reduce_op must be "sum" or "avg", got "max"'):
        ops.reduce_scatter(torch.ones(world * 2), "max", torch.float32, world, name)
    with pytest.raises(RuntimeError, match=f"expected a numel divisible by group_size = {world + 1}"):
        ops.reduce_scatter(torch.ones(world * 2 + 1), "sum", torch.float32, world + 1, name)
    with pytest.raises(RuntimeError, match=f"group_size is {world + 1} but the process group"):
        ops.all_gather(torch.ones(4), torch.bfloat16, world + 1, name)


@pytest.mark.parametrize("world", [1, 2, 3, 4])
def test_collectives_match_reference(world):
    run(_collectives, world)


def _across_replicas(rank: int, world: int, shape: tuple[int, int]) -> None:
    """reduce_scatter with replicas (a ("replicate", "shard") mesh): this rank's part of every rank's
    tensor, summed or averaged over the shard group and across the replicas; in bf16 too; a shard
    group of one rank (replicas only); what it reads is its own, as without replicas. all_gather's
    gradient, given the replicas, is that reduction."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh("cpu", shape, mesh_dim_names=("replicate", "shard"))
    shard, replicate = mesh.get_group("shard"), mesh.get_group("replicate")
    replicas, shards = shape
    shard_rank = dist.get_rank(shard)
    part_size = 7
    fulls = [_random(part_size * shards, 70 + r) for r in range(world)]
    total = sum(fulls)[shard_rank * part_size:(shard_rank + 1) * part_size]
    for reduce_op in ("sum", "avg"):
        for reduce_dtype in (torch.float32, torch.bfloat16):
            full = fulls[rank].clone()
            reduced = ops.reduce_scatter(full, reduce_op, reduce_dtype, shards, shard.group_name,
                                         replicate.group_name, replicas)
            full.fill_(float("nan"))
            reduced = ops.wait(reduced)
            assert reduced.dtype == torch.float32 and reduced.shape == (part_size,)
            expected = total / world if reduce_op == "avg" else total
            if reduce_dtype == torch.bfloat16:
                torch.testing.assert_close(reduced, expected, rtol=2e-2, atol=2e-2)
            else:
                torch.testing.assert_close(reduced, expected)
        # all_gather's backward: the same reduction of the gathered tensor's gradient, waited for
        part = torch.zeros(part_size, requires_grad=True)
        gathered, _ = ops.all_gather(part, torch.float32, shards, shard.group_name, reduce_op=reduce_op,
                                     replicate_group_name=replicate.group_name, replicas=replicas)
        ops.wait(gathered).backward(fulls[rank])
        torch.testing.assert_close(part.grad, total / world if reduce_op == "avg" else total)
    with pytest.raises(RuntimeError, match="no gradient through a reduction across replicas"):
        ops.reduce_scatter(fulls[rank].clone().requires_grad_(), "sum", torch.float32, shards, shard.group_name,
                           replicate.group_name, replicas)
    with pytest.raises(RuntimeError, match=f"group_size is {replicas + 1} but the process group"):
        ops.reduce_scatter(fulls[rank].clone(), "sum", torch.float32, shards, shard.group_name, replicate.group_name,
                           replicas + 1)


@pytest.mark.parametrize("shape", [(2, 2), (2, 1), (3, 1)])
def test_a_reduction_goes_on_across_replicas(shape):
    run(_across_replicas, shape[0] * shape[1], shape)


def _averaged_in_bf16_rounded_once(rank: int, world: int) -> None:
    # Each rank sends the same f32 gradient: its bf16 contribution is x / 3 rounded once (as the CUDA
    # kernel rounds it), and three equal contributions sum exactly (2y is exact) to one more rounding.
    full = _random(world * 64, 90)
    reduced = ops.wait(ops.reduce_scatter(full.clone(), "avg", torch.bfloat16, world, _group_name()))
    contribution = (full * (1 / world)).to(torch.bfloat16)
    expected = (contribution.float() * world).to(torch.bfloat16).float()[rank * 64:(rank + 1) * 64]
    assert torch.equal(reduced, expected), (reduced - expected).abs().max()


def test_an_average_in_bf16_rounds_each_contribution_once():
    run(_averaged_in_bf16_rounded_once, 3)


def _collectives_opcheck(rank: int, world: int) -> None:
    # At world 1 the ops run no collective, so every check applies. Above it,
    # an op's output is in flight until waited, and opcheck's AOT dispatch test
    # compares outputs without waiting: that check is left to the compiled
    # tests below, which wait.
    checks = ("test_schema", "test_autograd_registration", "test_faketensor")
    if world == 1:
        checks += ("test_aot_dispatch_dynamic",)
    name = _group_name()
    torch.library.opcheck(
        torch.ops.linnet.all_gather.default, (_random(8, 60).requires_grad_(), torch.bfloat16, world, name),
        test_utils=checks,
    )
    for reduce_op, reduce_dtype in (("sum", torch.float32), ("avg", torch.bfloat16)):
        torch.library.opcheck(
            torch.ops.linnet.reduce_scatter.default,
            (_random(8 * world, 61, torch.bfloat16).requires_grad_(), reduce_op, reduce_dtype, world, name),
            test_utils=checks,
        )
    # wait is _c10d_functional.wait_tensor underneath, which returns its
    # input while its schema and fake kernel promise a new tensor (PyTorch's
    # own op fails test_schema and test_faketensor for that reason); wait
    # keeps that contract, so only the other checks apply.
    torch.library.opcheck(
        torch.ops.linnet.wait.default, (_random(8, 62).requires_grad_(),),
        test_utils=("test_autograd_registration", "test_aot_dispatch_dynamic"),
    )


@pytest.mark.parametrize("world", [1, 2])
def test_collectives_opcheck(world):
    run(_collectives_opcheck, world)


def _scheduling_ops(rank: int, world: int) -> None:
    """after and wait_gathered, the two ops generated code schedules its collectives with."""
    name = _group_name()
    # after: a copy of x, whose gradient is a copy; its dependencies get no gradient.
    x, dep = _random(6, 100).requires_grad_(), _random(3, 101).requires_grad_()
    y = ops.after(x, [dep], [dep])
    assert y.data_ptr() != x.data_ptr()
    torch.testing.assert_close(y, x, rtol=0, atol=0)
    (y * torch.arange(6.0)).sum().backward()
    torch.testing.assert_close(x.grad, torch.arange(6.0), rtol=0, atol=0)
    assert dep.grad is None
    torch.library.opcheck(torch.ops.linnet.after.default, (_random(6, 102).requires_grad_(), [dep], [dep]))

    # wait_gathered: a gather launched from the detached part, waited for; the gradient reaches
    # the part reduce-scattered (averaged here) and un-waited, for the caller to wait.
    part_size = 5
    parts = [_random(part_size, 110 + r) for r in range(world)]
    part = parts[rank].clone().requires_grad_()
    gathered, _ = ops.all_gather(part.detach(), torch.bfloat16, world, name)
    full = ops.wait_gathered(gathered, part, "avg", torch.float32, world, name)
    torch.testing.assert_close(full, torch.cat(parts).bfloat16(), rtol=0, atol=0)
    weights = [_random(part_size * world, 120 + r) for r in range(world)]
    (gradient,) = torch.autograd.grad((full.float() * weights[rank]).sum(), part)
    slot = slice(rank * part_size, (rank + 1) * part_size)
    expected = sum(w.bfloat16().float()[slot] for w in weights) / world
    torch.testing.assert_close(ops.wait(gradient), expected)
    with pytest.raises(RuntimeError, match="the part must be float32"):
        ops.wait_gathered(gathered, part.detach().bfloat16().requires_grad_(), "avg", torch.float32, world, name)
    with pytest.raises(RuntimeError, match="expected a gathered buffer of group_size"):
        ops.wait_gathered(gathered[1:], part, "avg", torch.float32, world, name)


@pytest.mark.parametrize("world", [1, 3])
def test_scheduling_ops(world):
    run(_scheduling_ops, world)


class _RecordTargets:
    """An inductor post-grad pass that records which ops inductor was given."""

    def __init__(self):
        from torch._inductor.custom_graph_pass import CustomGraphPass

        class Record(CustomGraphPass):
            def __call__(pass_self, graph):
                self.targets.update(node.target for node in graph.nodes if node.op == "call_function")

            def uuid(pass_self):
                return None

        self.targets = set()
        self.graph_pass = Record()


def _wait_in_eager_and_compiled(rank: int, world: int) -> None:
    """wait: no autograd warning in eager; inductor sees _c10d_functional.wait_tensor and gives eager's gradients."""
    import torch._functorch.config
    import torch._inductor.config

    name = _group_name()
    part_size = 5
    x = _random(part_size * world, 70 + rank)

    def f(part):
        return (ops.wait(ops.all_gather(part, torch.bfloat16, world, name)[0]).float() * x).sum()

    eager_part = _random(part_size, 80 + rank).requires_grad_()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        eager_loss = f(eager_part)
        eager_loss.backward()
    assert not [w for w in caught if NO_AUTOGRAD_KERNEL in str(w.message)], [str(w.message) for w in caught]

    recorder = _RecordTargets()
    compiled_part = eager_part.detach().clone().requires_grad_()
    with torch._inductor.config.patch(fx_graph_cache=False, post_grad_custom_post_pass=recorder.graph_pass), \
            torch._functorch.config.patch(enable_autograd_cache=False):
        compiled_loss = torch.compile(f, fullgraph=True, backend="inductor")(compiled_part)
        compiled_loss.backward()
    torch.testing.assert_close(compiled_loss, eager_loss)
    torch.testing.assert_close(compiled_part.grad, eager_part.grad)
    linnet, functional = torch.ops.linnet, torch.ops._c10d_functional
    assert {linnet.all_gather.default, linnet.reduce_scatter.default,
            functional.wait_tensor.default} <= recorder.targets, recorder.targets
    assert linnet.wait.default not in recorder.targets


@pytest.mark.parametrize("world", [1, 2])
def test_wait_in_eager_and_compiled(world):
    run(_wait_in_eager_and_compiled, world)


def test_a_rank_error_is_raised_with_its_traceback():
    with pytest.raises(ZeroDivisionError) as raised:
        run(_fail_on_last_rank, 2)
    assert "in rank 1 of 2" in str(raised.value.__cause__)
    assert "_fail_on_last_rank" in str(raised.value.__cause__)


def _fail_on_last_rank(rank: int, world: int) -> int:
    return 1 // (world - 1 - rank)


# The CUDA kernels, against the CPU ones -------------------------------------

needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
CASTS = [(torch.float32, torch.bfloat16), (torch.bfloat16, torch.float32), (torch.float32, torch.float32),
         (torch.float16, torch.bfloat16), (torch.float64, torch.float32)]


@needs_cuda
@pytest.mark.parametrize("source, target", CASTS)
@pytest.mark.parametrize("numel", [1, 7, 16, 1000, 4099, 20_000_003])
def test_cuda_casts_match_cpu(source, target, numel):
    part = _random(numel + 1, 90, source)
    for cpu_part, cuda_part in ((part[:numel], part.cuda()[:numel]),  # aligned: the vector path
                                (part[1:], part.cuda()[1:])):  # one element in: the scalar path
        gathered = ops.all_gather(cuda_part, target, 1, "")[0]
        assert gathered.device == cuda_part.device and gathered.dtype == target
        torch.testing.assert_close(gathered.cpu(), ops.all_gather(cpu_part, target, 1, "")[0], rtol=0, atol=0)
        reduced = ops.wait(ops.reduce_scatter(cuda_part, "avg", torch.float32, 1, ""))
        torch.testing.assert_close(reduced.cpu(), ops.reduce_scatter(cpu_part, "avg", torch.float32, 1, ""),
                                   rtol=0, atol=0)


@needs_cuda
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("aligned", [True, False])
def test_cuda_flatten_and_shard_match_cpu(dtype, aligned):
    tensors, layout = _group(dtype)
    offsets, total = (layout.offsets, layout.total) if aligned else ([1, 14, 21], 30)
    flat = ops.flatten([t.cuda() for t in tensors], offsets, total)
    torch.testing.assert_close(flat.cpu(), ops.flatten(tensors, offsets, total), rtol=0, atol=0)
    for rank in range(4):
        torch.testing.assert_close(ops.shard(flat, rank, 4).cpu(), ops.shard(flat.cpu(), rank, 4), rtol=0, atol=0)


@needs_cuda
def test_cuda_gather_compiles_with_eager_gradients():
    x = _random(64, 91).cuda()

    def f(part):
        full = ops.wait(ops.all_gather(part, torch.bfloat16, 1, "")[0])
        first, second = ops.group_views(full, [0, 32], [(4, 8), (32,)])
        return (first.float().sum(0) * x[:8]).sum() + (second.float() * x[32:]).sum()

    eager_part = _random(64, 92).cuda().requires_grad_()
    compiled_part = eager_part.detach().clone().requires_grad_()
    f(eager_part).backward()
    torch.compile(f, fullgraph=True, backend="inductor")(compiled_part).backward()
    torch.testing.assert_close(compiled_part.grad, eager_part.grad)


# The GoogleTest tests of the C++ --------------------------------------------

CPP_TESTS = ["flat_layout_test", "collectives_test"]  # every binary tests/cpp/CMakeLists.txt makes


@pytest.fixture(scope="module")
def cpp_build() -> tuple[Path, str]:
    """tests/cpp configured against this torch and built in build/cpp-tests, which is kept: a
    second run recompiles only what changed. Returns the folder and cmake's warnings."""
    if shutil.which("cmake") is None:
        pytest.skip("cmake is not installed")
    build = ROOT / "build" / "cpp-tests"
    configure = subprocess.run(["cmake", "-S", ROOT / "tests" / "cpp", "-B", build,
                                f"-DCMAKE_PREFIX_PATH={torch.utils.cmake_prefix_path}"], capture_output=True, text=True)
    if configure.returncode != 0 and "GTest" in configure.stderr + configure.stdout:
        pytest.skip("GoogleTest is not installed (apt-get install libgtest-dev)")
    assert configure.returncode == 0, configure.stdout + configure.stderr
    compiled = subprocess.run(["cmake", "--build", build, "--parallel", str(os.cpu_count() or 1)],
                              capture_output=True, text=True)
    assert compiled.returncode == 0, compiled.stdout + compiled.stderr
    return build, configure.stderr


@pytest.mark.parametrize("binary", CPP_TESTS)
def test_cpp_googletest(cpp_build, binary):
    build, cmake_warnings = cpp_build
    if not (build / binary).exists():
        pytest.skip(f"{binary} was not built; cmake said: {cmake_warnings.strip()}")
    tests = subprocess.run([build / binary], capture_output=True, text=True, timeout=300)
    assert tests.returncode == 0, tests.stdout + tests.stderr
