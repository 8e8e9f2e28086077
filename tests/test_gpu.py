"""On a CUDA machine: flex attention over packed rows, and sharded training
over NCCL at world size 1, and at 2 and 4 ranks where the machine has that
many GPUs, against the same computations done plainly. Skipped where there is
no GPU (CI)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from linnet import nest
from linnet.data.packing import Example, pack
from linnet.torch.train import row_tensors

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
ROW = 256


def rows(count: int) -> list:
    rng = np.random.default_rng(5)
    examples = [Example.prompted(rng.integers(6, 512, rng.integers(3, 40)).tolist(),
                                 rng.integers(6, 512, rng.integers(2, 30)).tolist())
                for _ in range(40 * count)]
    return list(pack(examples, ROW))[:count]


@pytest.mark.parametrize("compile", [None, "inductor"])
def test_flex_attention_on_packed_rows_equals_exact(compile):
    generics = {"Batch": 1, "MaxSeq": ROW, "T": "f32"}
    exact = nest.load("tiny-llama", device="cuda", generics=generics, entry="loss_packed", numerics="exact")
    fast = nest.load("tiny-llama", device="cuda", generics=generics, entry="loss_packed", numerics="fast",
                     compile=compile)
    for row in rows(3):
        torch.testing.assert_close(fast(*row_tensors(row, "cuda")), exact(*row_tensors(row, "cuda")),
                                   rtol=2e-5, atol=2e-5)


@pytest.fixture
def nccl_world_of_one():
    import torch.distributed as dist

    dist.init_process_group("nccl", store=dist.HashStore(), rank=0, world_size=1, device_id=torch.device("cuda", 0))
    yield
    dist.destroy_process_group()


@pytest.mark.parametrize("compile", [None, "inductor"])
def test_sharded_training_over_nccl_equals_unsharded(nccl_world_of_one, compile):
    from linnet.torch import fully_shard
    from linnet.torch.train import train

    def load():
        return nest.load("tiny-llama", device="cuda", numerics="fast", generics={"Batch": 1, "MaxSeq": ROW, "T": "f32"},
                         cast_dtype=True, trainable=True, weights="random", entry="loss_packed", compile=compile)

    data = rows(5)
    plain = load()
    optimizer = torch.optim.AdamW(list(plain.parameters()), lr=3e-3, eps=1e-6)
    expected = [s.loss for s in train(plain, iter(data), optimizer=optimizer, steps=5, on_step=lambda s: None).steps]
    sharded = fully_shard(load())
    optimizer = torch.optim.AdamW(list(sharded.parameters()), lr=3e-3, eps=1e-6)
    got = [s.loss for s in train(sharded, iter(data), optimizer=optimizer, steps=5, on_step=lambda s: None).steps]
    np.testing.assert_allclose(got, expected, rtol=1e-5)


def trained_after_and_within(compile: str | None, reshard_after_forward: bool, steps: int = 4,
                             eps: float = 1e-6) -> list[tuple[list[float], list[torch.Tensor]]]:
    """The tiny card's losses and parts after `steps` of train in bf16 (on the CUDA device of a process group
    of one), stepping after the backward, then in it: fused AdamW (a host lr tensor read by the CUDA kernel)
    with an lr that changes each step. Also benchmarks/step_in_backward_diff.py's."""
    from linnet.torch import fully_shard
    from linnet.torch.train import train

    results = []
    for in_backward in (False, True):
        model = fully_shard(nest.load("tiny-llama", device="cuda", numerics="fast",
                                      generics={"Batch": 1, "MaxSeq": ROW, "T": "bf16"}, cast_dtype=True,
                                      trainable=True, weights="random", entry="loss_packed", compile=compile),
                            reshard_after_forward=reshard_after_forward)
        # eps=1e-6 (test_fully_shard.EPS): under AdamW's default 1e-8 an element whose gradient is ~1e-9
        # takes a full step of either sign, and a sum's last bit can move it by twice the learning rate.
        optimizer = torch.optim.AdamW(list(model.parameters()), lr=3e-3, weight_decay=0.1, eps=eps, fused=True)
        schedule = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 1 / (step + 1))
        history = train(model, iter(rows(steps)), optimizer=optimizer, steps=steps, schedule=schedule,
                        on_step=lambda s: None, step_in_backward=in_backward)
        results.append(([s.loss for s in history.steps], [p.detach().cpu() for p in model.parameters()]))
    return results


@pytest.mark.parametrize("compile", [None, "inductor"])
@pytest.mark.parametrize("reshard_after_forward", [True, False])
def test_the_step_in_the_backward_equals_the_step_after_on_the_gpu(nccl_world_of_one, compile, reshard_after_forward):
    """In bf16, the parts as the step after the backward leaves them. With reshard_after_forward=False the
    step also writes each part's cast, which the next forward takes (linnet/torch/collectives.py,
    `_casts_from_the_step`)."""
    (losses_after, parts_after), (losses_within, parts_within) = trained_after_and_within(
        compile, reshard_after_forward)
    # Eager, the two trainings add alike (equal to the bit on an H100); held to 1e-5, for atomics. Compiled,
    # they are two functions (one steps in its backward), which inductor fuses apart: their bf16 gradients
    # can round differently, element by element. A gradient's last bit moves its Adam step by up to about
    # lr * 2^-8: over these four steps (lr 3e-3 / step) 2.4e-5 an element, 1.2e-3 of the table's norm were
    # every element moved so (its elements are ~0.02). Seen on H100s: 7.0e-4 (the tied table) and 2.5e-5.
    # A step gone wrong (a gradient lost or misplaced, a stale learning rate) moves elements by ~lr: ~0.1.
    parts_noise, losses_noise = (2e-3, 1e-4) if compile else (1e-5, 1e-5)
    for index, (within, after) in enumerate(zip(parts_within, parts_after)):
        assert float((within - after).norm() / after.norm()) < parts_noise, f"part {index} {tuple(after.shape)}"
    np.testing.assert_allclose(losses_within, losses_after, rtol=losses_noise)


def test_causal_attention_runs_cudnns_kernel_and_equals_exact():
    """The fast numerics' causal attention, compiled, in bf16 with Llama 3.1 8B's heads: cuDNN's
    kernel runs (SDPA alone would choose FlashAttention-2, 1.8x slower on Hopper), and the output
    and gradients match exact attention in f32."""
    from linnet.emit import prims_torch

    torch.manual_seed(0)
    seq, heads, kv_heads, head_dim = 1024, 32, 8, 128
    q, k, v = (torch.randn(1, n, seq, head_dim, device="cuda", dtype=torch.bfloat16, requires_grad=True)
               for n in (heads, kv_heads, kv_heads))
    grad = torch.randn(1, heads, seq, head_dim, device="cuda", dtype=torch.bfloat16)
    fast = torch.compile(lambda q, k, v: prims_torch.attention_fast(q, k, v, None), fullgraph=True)
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as profile:
        out = fast(q, k, v)
        grads = torch.autograd.grad(out, (q, k, v), grad)
        torch.cuda.synchronize()
    kernels = {event.name for event in profile.events() if event.device_type == torch.autograd.DeviceType.CUDA}
    assert any("cudnn" in name.lower() for name in kernels), sorted(kernels)
    f32 = [x.detach().float().requires_grad_() for x in (q, k, v)]
    causal = torch.ones(seq, seq, dtype=torch.bool, device="cuda").tril()[None, None]
    reference = prims_torch.attention_exact(*f32, causal)
    ref_grads = torch.autograd.grad(reference, f32, grad.float())
    for got, want in zip((out, *grads), (reference, *ref_grads)):
        error = (got.float() - want).abs().max() / want.abs().max()
        assert error < 2e-2, f"relative error {error:.1e}"


def several_gpus(world: int):
    return pytest.mark.skipif(torch.cuda.device_count() < world, reason=f"needs {world} GPUs")


def nccl_training(rank: int, world: int, card, compile: str | None, prefetch: int, folder: str | None,
                  mesh: tuple[int, int] | None = None):
    """test_fully_shard's sharded training, on GPU `rank` over NCCL (on a ("replicate", "shard") mesh of
    shape `mesh` if given); then save_weights into `folder`."""
    from test_fully_shard import EPS, LR, STEPS, load, rows as global_rows
    from torch.distributed.device_mesh import init_device_mesh

    from linnet.torch import fully_shard
    from linnet.torch.shard import gathered_weights
    from linnet.torch.train import train

    mesh = None if mesh is None else init_device_mesh("cuda", mesh, mesh_dim_names=("replicate", "shard"))
    model = fully_shard(load(card, compile=compile, device="cuda"), prefetch=prefetch, mesh=mesh)
    optimizer = torch.optim.AdamW(list(model.parameters()), lr=LR, weight_decay=0.0, eps=EPS)
    history = train(model, iter(global_rows(world)[rank::world]), optimizer=optimizer, steps=STEPS,
                    on_step=lambda s: None)
    weights = {name: tensor.numpy() for name, tensor in gathered_weights(model, torch.float32)}
    if folder is not None:
        model.save_weights(folder)
    return [s.loss for s in history.steps], weights


@pytest.mark.parametrize("world", [1, pytest.param(2, marks=several_gpus(2)), pytest.param(4, marks=several_gpus(4))])
@pytest.mark.parametrize("compile, prefetch", [(None, 1), ("inductor", 1), ("inductor", 0)])
def test_sharded_training_over_nccl_on_several_gpus_equals_one_process(tmp_path, world, compile, prefetch):
    """NCCL's collectives (csrc/collectives.cpp's CUDA path, which one GPU never runs: at world 1 this
    checks the test's own plumbing) train as one process on GPU 0 does on the same global batch (on
    the GPU: random weights are drawn by the device's generator, which the CPU's does not match). f32
    throughout, TF32 off (torch's default for matmuls): only the order of the sums differs, so the
    bounds are test_fully_shard's 1e-5 widened to 1e-4 for the GPU's kernels. The weights save_weights
    wrote (bf16) load in transformers as the gathered ones rounded to bf16."""
    from distributed import run
    from test_fully_shard import reference, relative_error
    from hf_models import write_tied_card

    (tmp_path / "card").mkdir()
    card = write_tied_card(tmp_path / "card")
    expected_losses, expected_weights = reference(card, world, device="cuda")
    results = run(nccl_training, world, card, compile, prefetch, str(tmp_path / "saved"), timeout=900, backend="nccl")
    for losses, weights in results:
        np.testing.assert_allclose(losses, expected_losses, rtol=1e-4)
        for name, tensor in weights.items():
            assert relative_error(tensor, expected_weights[name].numpy()) < 1e-4, name
    from transformers import AutoModelForCausalLM

    loaded = AutoModelForCausalLM.from_pretrained(tmp_path / "saved", torch_dtype=torch.float32)
    state = loaded.state_dict()
    for name, tensor in results[0][1].items():
        torch.testing.assert_close(state[name].to(torch.bfloat16), torch.from_numpy(tensor).to(torch.bfloat16))


@pytest.mark.parametrize("mesh", [pytest.param((2, 1), marks=several_gpus(2)),
                                  pytest.param((2, 2), marks=several_gpus(4))])
@pytest.mark.parametrize("compile", [None, "inductor"])
def test_hybrid_training_over_nccl_equals_one_process(tmp_path, mesh, compile):
    """Hybrid sharding over NCCL trains as one process does, to the bounds of
    test_sharded_training_over_nccl_on_several_gpus_equals_one_process: on 2 x 1 (no shard group to
    speak of) each gather's reduction across the replicas; on 2 x 2 the all-reduce across the replicas
    that a reduce-scatter launches on a side stream when it ends, and the means of the late parts that
    train launches after the backward, under the optimizer's step of the other parts (linnet/torch/hybrid.py)."""
    from distributed import run
    from test_fully_shard import reference, relative_error
    from hf_models import write_tied_card

    (tmp_path / "card").mkdir()
    card = write_tied_card(tmp_path / "card")
    world = mesh[0] * mesh[1]
    expected_losses, expected_weights = reference(card, world, device="cuda")
    for losses, weights in run(nccl_training, world, card, compile, 1, None, mesh, timeout=900, backend="nccl"):
        np.testing.assert_allclose(losses, expected_losses, rtol=1e-4)
        for name, tensor in weights.items():
            assert relative_error(tensor, expected_weights[name].numpy()) < 1e-4, name
