"""fully_shard over a 2-D mesh ("replicate", "shard"), over Gloo: training equals unsharded single-process
training on the same global batch, as the flat sharding of tests/test_fully_shard.py does, and its
checkpoints (each part written once, by the first replica) resume on other meshes and world sizes."""

from __future__ import annotations

import shutil

import numpy as np
import pytest
import torch

from distributed import free_port, run
from test_checkpoint import HALF, halves, join, zero_weight
from linnet import nest
from linnet.torch.train import row_tensors
from test_fully_shard import card as card, untied as untied  # fixtures: "as" marks them used for pyflakes
from test_fully_shard import EPS, LR, STEPS, load, mean_of_the_ranks_losses, reference, relative_error, rows


def on_a_mesh(card, shape: tuple[int, int] = (2, 2), compile: str | None = None, **settings):
    """The card loaded (load's settings) and sharded on a ("replicate", "shard") mesh of `shape` (with
    fully_shard's `settings`)."""
    from torch.distributed.device_mesh import init_device_mesh

    from linnet.torch import fully_shard

    mesh = init_device_mesh("cpu", shape, mesh_dim_names=("replicate", "shard"))
    return fully_shard(load(card, compile=compile), mesh=mesh, **settings)


def hybrid_training(rank: int, world: int, card, shape: tuple[int, int], compile: str | None, recompute: str,
                    prefetch: int, reduce_dtype: torch.dtype = torch.float32, reshard_after_forward: bool = True):
    from linnet.torch.shard import gathered_weights
    from linnet.torch.train import train

    # One thread a rank: inductor's CPU kernels then add each embedding gradient in one order (with two,
    # in the order the threads' atomic adds land; AdamW carried that to 1.5e-5 in a weight once, in CI).
    torch.set_num_threads(1)
    model = on_a_mesh(card, shape, compile, recompute=recompute, prefetch=prefetch, reduce_dtype=reduce_dtype,
                      reshard_after_forward=reshard_after_forward)
    assert (model.sharding.replicas, model.sharding.world) == shape
    optimizer = torch.optim.AdamW(list(model.parameters()), lr=LR, weight_decay=0.0, eps=EPS)
    history = train(model, iter(rows(world)[rank::world]), optimizer=optimizer, steps=STEPS, on_step=lambda s: None)
    weights = {name: tensor.numpy() for name, tensor in gathered_weights(model, torch.float32)}
    return [s.loss for s in history.steps], weights


@pytest.mark.parametrize("shape, compile, recompute, prefetch", [
    ((2, 2), None, "gather", 1),
    ((2, 2), None, "full", 0),
    ((4, 1), None, "gather", 1),  # replicas only: data parallel
    ((2, 2), "inductor", "gather", 1),
    ((2, 2), "inductor", "full", 0),  # no head held by the loop: gathered, and averaged, at once
])
def test_a_2d_mesh_trains_as_single_process(card, shape, compile, recompute, prefetch):
    expected_losses, expected_weights = reference(card, 4)
    for losses, weights in run(hybrid_training, 4, card, shape, compile, recompute, prefetch,
                               timeout=900 if compile else 300):
        np.testing.assert_allclose(losses, expected_losses, rtol=1e-5)
        for name, tensor in weights.items():
            assert relative_error(tensor, expected_weights[name].numpy()) < 1e-5, name


@pytest.mark.parametrize("compile", [None, "inductor"])
def test_a_2d_mesh_keeping_its_gathers_trains_as_single_process(card, compile):
    """reshard_after_forward=False on a (2, 2) mesh, no prefetch (so that by default every layer is gathered
    again in the backward): the backward reduces and averages what the forward's gathers kept."""
    expected_losses, expected_weights = reference(card, 4)
    for losses, weights in run(hybrid_training, 4, card, (2, 2), compile, "gather", 0, torch.float32, False,
                               timeout=900 if compile else 300):
        np.testing.assert_allclose(losses, expected_losses, rtol=1e-5)
        for name, tensor in weights.items():
            assert relative_error(tensor, expected_weights[name].numpy()) < 1e-5, name


@pytest.mark.parametrize("shape, compile", [((2, 2), None), ((2, 2), "inductor"), ((4, 1), None)])
def test_a_looked_up_embedding_on_a_2d_mesh_trains_as_single_process(untied, shape, compile):
    """The untied table is looked up, not gathered: its rows' gradients come from every rank, across
    the replicas too, instead of an all-reduce of its part (held, as the flat lookup's, to 5e-5: the
    table's and, through it, the layers' weights; v_proj's 1.7e-5 on an AMD EPYC)."""
    expected_losses, expected_weights = reference(untied, 4)
    for losses, weights in run(hybrid_training, 4, untied, shape, compile, "gather", 1,
                               timeout=900 if compile else 300):
        np.testing.assert_allclose(losses, expected_losses, rtol=1e-5)
        for name, tensor in weights.items():
            assert relative_error(tensor, expected_weights[name].numpy()) < 5e-5, name


def test_a_bf16_reduction_applies_inside_and_across_machines(card):
    """reduce_dtype=bfloat16 reduce-scatters inside the shard group and all-reduces across the replicas
    in bf16 (compiled: the all-reduce waited for at once, to be cast back to f32): the losses follow
    single-process training within 1e-3 relative (as the flat bf16 reduction's do) and are not the same."""
    expected_losses, _ = reference(card, 4)
    (losses, _), *_ = run(hybrid_training, 4, card, (2, 2), "inductor", "gather", 1, torch.bfloat16, timeout=900)
    np.testing.assert_allclose(losses, expected_losses, rtol=1e-3)
    assert not np.allclose(losses, expected_losses, rtol=1e-7, atol=0)


class _AdamWOfItsOwn(torch.optim.AdamW):
    """An optimizer train cannot know steps each parameter alone (not of replicas.PER_PARAMETER)."""


def _hooked_adamw(params, **settings) -> torch.optim.AdamW:
    """An AdamW whose step has a hook, which two steps would run twice."""
    optimizer = torch.optim.AdamW(params, **settings)
    optimizer.register_step_post_hook(lambda optimizer, args, kwargs: None)
    return optimizer


def steps_taken(rank: int, world: int, card, compile: str | None, optimizer_class,
                in_backward: bool | None = None) -> tuple:
    """Train on 2 x 2: for each optimizer.step(), the names of the parts that had a gradient; and the losses."""
    from linnet.torch.train import train

    model = on_a_mesh(card, compile=compile)
    names = {id(model.params["embedding"]): "embedding", id(model.params["head"]): "head",
             **{id(p): f"layer {i}" for i, p in enumerate(model.params["layers"])}}
    optimizer = optimizer_class(list(model.parameters()), lr=LR, weight_decay=0.0, eps=EPS)
    calls, step = [], optimizer.step

    def recorded(*args, **kwargs):
        calls.append(sorted(names[id(p)] for p in model.parameters() if p.grad is not None))
        return step(*args, **kwargs)

    optimizer.step = recorded
    history = train(model, iter(rows(world)[rank::world]), optimizer=optimizer, steps=2, on_step=lambda s: None,
                    step_in_backward=in_backward)
    return calls, [s.loss for s in history.steps]


@pytest.mark.parametrize("compile", [None, "inductor"])
def test_train_steps_the_parts_reduced_last_once_the_rest_are_stepped(card, compile):
    """The first layer's and the tied embedding's parts are reduced last: train averages them across the replicas
    under the optimizer's step of every other part (taken in the backward, or, asked to, by the first step()),
    then steps them; the losses are single-process training's."""
    expected_losses, _ = reference(card, 4)
    everything = ["embedding", "head", "layer 0", "layer 1"]
    for calls, losses in run(steps_taken, 4, card, compile, torch.optim.AdamW, timeout=900 if compile else 300):
        assert calls == [[], ["embedding", "layer 0"]] * 2  # the others stepped in the backward
        np.testing.assert_allclose(losses, expected_losses[:2], rtol=1e-5)
    if compile is None:
        for calls, losses in run(steps_taken, 4, card, None, torch.optim.AdamW, False, timeout=300):
            assert calls == [["head", "layer 1"], ["embedding", "layer 0"]] * 2
            np.testing.assert_allclose(losses, expected_losses[:2], rtol=1e-5)
    for optimizer_class in (_AdamWOfItsOwn, _hooked_adamw):
        for calls, losses in run(steps_taken, 4, card, None, optimizer_class, timeout=300):
            assert calls == [everything] * 2  # averaged by the parts' hooks during the backward: one step
            np.testing.assert_allclose(losses, expected_losses[:2], rtol=1e-5)


def reductions_made(rank: int, world: int, card, own_loop: bool) -> list:
    """(shard ranks, replicas) of each reduction of a gradient (linnet::reduce_scatter) in one eager step on 2 x 2,
    in train or in a user's loop."""
    from torch.utils._python_dispatch import TorchDispatchMode

    from linnet.torch.train import train

    made = []

    class Reductions(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            if func is torch.ops.linnet.reduce_scatter.default:
                made.append((args[3], args[6] if len(args) > 6 else 1))
            return func(*args, **(kwargs or {}))

    model = on_a_mesh(card)
    optimizer = torch.optim.AdamW(list(model.parameters()), lr=LR)
    row = rows(world)[rank]
    with Reductions():
        if own_loop:
            model.loss_packed(*row_tensors(row)).backward()
        else:
            train(model, iter([row]), optimizer=optimizer, steps=1, on_step=lambda s: None)
    return sorted(made)


@pytest.mark.parametrize("own_loop", [False, True])
def test_each_part_is_reduced_once_inside_its_machine_and_once_across(card, own_loop):
    """A mean across the replicas taken twice would change no value (the replicas' parts are equal by
    then), so the training tests cannot see it: counted here. The head and layer 1 are reduce-scattered
    with their all-reduce across the replicas chained; layer 0 and the tied embedding (late) are
    reduce-scattered inside the shard group alone, and then averaged across the replicas once."""
    for made in run(reductions_made, 4, card, own_loop, timeout=300):
        assert made == [(1, 2), (1, 2), (2, 1), (2, 1), (2, 2), (2, 2)]


def own_loop_on_a_mesh(rank: int, world: int, card, compile: str | None):
    """A user's loop on 2 x 2, each step's row in two halves of the loss, each with its own backward: the
    gradients accumulate, and each half of a part reduced last is averaged across the replicas once."""
    from linnet.torch.shard import gathered_weights

    model = on_a_mesh(card, compile=compile)
    optimizer = torch.optim.AdamW(list(model.parameters()), lr=LR, weight_decay=0.0, eps=EPS)
    data = rows(world)
    for step in range(STEPS):
        row = data[step * world + rank]
        for half in (0.25, 0.75):
            (half * model.loss_packed(*row_tensors(row))).backward()
        optimizer.step()
        optimizer.zero_grad()
    return {name: tensor.numpy() for name, tensor in gathered_weights(model, torch.float32)}


@pytest.mark.parametrize("compile", [None, "inductor"])
def test_a_users_own_loop_on_a_2d_mesh_trains_on_the_mean_of_the_ranks_losses(card, compile):
    expected = mean_of_the_ranks_losses(card, 4)
    for weights in run(own_loop_on_a_mesh, 4, card, compile, timeout=900 if compile else 300):
        for name, tensor in weights.items():
            assert relative_error(tensor, expected[name].numpy()) < 1e-5, name


def rows_across(world: int) -> list:
    """Global rows, rank-strided: 4 a step for the 4 steps before the checkpoint, then a fifth step whose
    global batch is the same at world 4 (rows A, B, C and a weightless one) and at world 3 (A, B, C: a
    rank of 3 skips 6, 5 and 5 of the 16 rows used, so the next rows, 16 to 18, are all three)."""
    data = [join(row) for row in halves(2)]
    return data[:16] + data[16:19] + ([zero_weight(data[19])] if world == 4 else [])


def resume_on(rank: int, world: int, shape: tuple[int, int] | None, folder: str, steps: int, save_every: int | None):
    from torch.distributed.device_mesh import init_device_mesh

    from linnet.torch import fully_shard
    from linnet.torch.shard import gathered_weights
    from linnet.torch.train import train

    model = nest.load("tiny-llama", numerics="exact", generics={"Batch": 1, "MaxSeq": 2 * HALF, "T": "f32"},
                      cast_dtype=True, trainable=True, weights="random", entry="loss_packed")
    fully_shard(model, mesh=None if shape is None
                else init_device_mesh("cpu", shape, mesh_dim_names=("replicate", "shard")))
    optimizer = torch.optim.AdamW(list(model.parameters()), lr=3e-3, weight_decay=0.0, eps=1e-6)
    history = train(model, iter(rows_across(world)[rank::world]), optimizer=optimizer, steps=steps,
                    on_step=lambda s: None, checkpoint=folder, checkpoint_every=save_every)
    weights = {name: t.numpy() for name, t in gathered_weights(model, torch.float32)}
    return {s.step: s.loss for s in history.steps}, weights, history.resumed_from


def test_a_2d_checkpoint_holds_each_part_once_and_resumes_on_other_meshes(tmp_path):
    import json

    saved = tmp_path / "saved"
    run(resume_on, 4, (2, 2), str(saved), 4, 4, timeout=300)  # four steps on 2 x 2, saved at step 4
    step = saved / "step-00000004"
    assert sorted(p.name for p in step.glob("*.pt")) == ["rank-00000-of-00002.pt", "rank-00001-of-00002.pt"]
    assert json.loads((step / "MANIFEST.json").read_text())["parts_world"] == 2
    shutil.copytree(saved, tmp_path / "reference")
    uninterrupted = run(resume_on, 4, (2, 2), str(tmp_path / "reference"), 5, None, timeout=300)[0]
    for world, shape in ((4, (1, 4)), (4, (4, 1)), (3, None)):
        copy = tmp_path / f"on-{shape}"
        shutil.copytree(saved, copy)
        (losses_by_step, weights, resumed_from), *_ = run(resume_on, world, shape, str(copy), 5, None, timeout=300)
        assert resumed_from == 4 and list(losses_by_step) == [5], shape
        np.testing.assert_allclose(losses_by_step[5], uninterrupted[0][5], rtol=1e-5)
        for name, tensor in weights.items():
            assert relative_error(tensor, uninterrupted[1][name]) < 1e-5, (shape, name)


def save_on_a_mesh(rank: int, world: int, card, folder: str, blocked: str) -> tuple[int, dict, str | None]:
    """save_weights on a 2 x 2 mesh: (the writes this rank made, the gathered weights); then into a path
    under a file, what this rank raised."""
    import linnet.hf.write
    from linnet.torch.shard import gathered_weights

    model = on_a_mesh(card)
    writes, write = [], linnet.hf.write.write_hf_checkpoint
    linnet.hf.write.write_hf_checkpoint = lambda *args, **kwargs: writes.append(1) or write(*args, **kwargs)
    model.save_weights(folder, dtype=torch.float32)
    written = len(writes)
    weights = {name: tensor.numpy() for name, tensor in gathered_weights(model, torch.float32)}
    try:
        model.save_weights(blocked)
        raised = None
    except Exception as error:  # noqa: BLE001  (the test looks at what each rank raised)
        raised = f"{type(error).__name__}: {error}"
    return written, weights, raised


def test_on_a_2d_mesh_one_rank_writes_the_weights_and_every_rank_learns_of_a_failed_write(card, tmp_path):
    from transformers import AutoModelForCausalLM

    (tmp_path / "a-file").write_text("not a folder")
    ranks = run(save_on_a_mesh, 4, card, str(tmp_path / "saved"), str(tmp_path / "a-file" / "saved"), timeout=300)
    assert [writes for writes, _, _ in ranks] == [1, 0, 0, 0]  # the first rank of the first replica alone
    loaded = AutoModelForCausalLM.from_pretrained(tmp_path / "saved", torch_dtype=torch.float32).state_dict()
    for name, tensor in ranks[0][1].items():
        np.testing.assert_array_equal(loaded[name].numpy(), tensor, err_msg=name)
    mine = ranks[0][2]
    assert mine is not None and "Not a directory" in mine  # the writing rank's own error
    for rank, (_, _, other) in enumerate(ranks[1:], start=1):  # the other replica's too
        assert other.startswith("RuntimeError: could not write the weights to") and "rank 0: " in other, (rank, other)


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
    ((1, 2), ("shard", "replicate"), False,
     "a mesh of one dimension, or of two named ('replicate', 'shard'); got 2 dimensions named ('shard', 'replicate')"),
    ((2, 1, 1), ("a", "replicate", "shard"), False, "got 3 dimensions"),
    ((2,), ("shard",), True, "fully_shard takes group= or mesh=, not both"),
])
def test_a_mesh_it_cannot_use_is_refused(card, shape, names, with_group, message):
    for said in run(bad_mesh, 2, card, shape, names, with_group, timeout=120):
        assert message in said


def example(tmp_path, torchrun: list[str], *options: str) -> list[str]:
    """The PyTorch example's output lines under `torchrun` (several launches: one a machine, started together),
    with the script's `options` too."""
    import os
    import subprocess
    import sys
    from pathlib import Path

    root = Path(__file__).resolve().parent.parent
    script = ["examples/sft/sft_torch.py", "--card", "tiny-llama", "--data", "examples/sft/data/tasks.jsonl",
              "--tokens", "256", "--steps", "4", "--lr", "3e-3", "--held-out", "40", *options]
    launches = [subprocess.Popen([sys.executable, "-m", "torch.distributed.run", *args, *script], cwd=root, text=True,
                                 stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                 env={**os.environ, "GLOO_SOCKET_IFNAME": "lo"})
                for args in torchrun]
    outputs = [launch.communicate(timeout=600) for launch in launches]
    for launch, (_, stderr) in zip(launches, outputs):
        assert launch.returncode == 0, stderr[-3000:]
    return "".join(stdout for stdout, _ in outputs).splitlines()


def test_two_machines_on_the_loopback_pick_hybrid_sharding_and_train_as_one(tmp_path):
    """Two machines of two processes each train as four processes on one machine do; the hybrid run's
    step-2 checkpoint resumes on the one machine, flat, to the same losses."""
    import shutil
    port = free_port()
    machines = example(tmp_path, [["--nnodes=2", f"--node-rank={node}", "--nproc_per_node=2", "--rdzv-backend=c10d",
                                   f"--rdzv-endpoint=127.0.0.1:{port}", "--rdzv-id=linnet-test"] for node in (0, 1)],
                       "--checkpoint", str(tmp_path / "hybrid"), "--checkpoint-every", "2")
    one = example(tmp_path, [["--standalone", "--nproc_per_node=4"]])
    shutil.copytree(tmp_path / "hybrid" / "step-00000002", tmp_path / "flat" / "step-00000002")
    resumed = example(tmp_path, [["--standalone", "--nproc_per_node=4"]], "--checkpoint", str(tmp_path / "flat"))
    assert "each weight in 2 parts, one copy on each of 2 machines" in machines
    assert "each weight in 4 parts" in one and "each weight in 4 parts" in resumed
    losses = [[float(line.split("loss ")[1].split(",")[0]) for line in lines if line.startswith("step ")]
              for lines in (machines, one, resumed)]
    assert len(losses[0]) == 4 and len(losses[2]) == 2
    np.testing.assert_allclose(losses[0], losses[1], atol=2e-3)  # printed to 3 decimals
    np.testing.assert_allclose(losses[2], losses[1][2:], atol=2e-3)


def mesh_chosen(rank: int, world: int, local: int, sharding: str) -> str:
    import os

    from linnet.errors import UserError
    from linnet.torch.mesh import torchrun_mesh

    os.environ["LOCAL_WORLD_SIZE"] = str(local)
    try:
        mesh = torchrun_mesh("cpu", sharding)
    except UserError as error:
        return str(error)
    return "flat" if mesh is None else f"{tuple(mesh.shape)} {mesh.mesh_dim_names}"


@pytest.mark.parametrize("local, sharding, chosen", [
    (2, "auto", "(2, 2) ('replicate', 'shard')"),
    (4, "auto", "flat"),
    (2, "flat", "flat"),
    (4, "hybrid", "(1, 4) ('replicate', 'shard')"),
    (3, "hybrid", "4 processes do not divide into machines of LOCAL_WORLD_SIZE=3"),
])
def test_the_mesh_follows_what_torchrun_reports(local, sharding, chosen):
    for said in run(mesh_chosen, 4, local, sharding, timeout=120):
        assert chosen in said
