"""On a CUDA machine: flex attention over packed rows, and sharded training
over NCCL at world size 1, against the same computations done plainly.
Skipped where there is no GPU (CI)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from linnet import nest
from linnet.packing import Example, pack

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
ROW = 256


def rows(count: int) -> list:
    rng = np.random.default_rng(5)
    examples = [Example.prompted(rng.integers(6, 512, rng.integers(3, 40)).tolist(), rng.integers(6, 512, rng.integers(2, 30)).tolist())
                for _ in range(40 * count)]
    return list(pack(examples, ROW))[:count]


def inputs(row, device="cuda"):
    return [torch.from_numpy(getattr(row, f))[None].to(device) for f in ("tokens", "targets", "positions", "segments", "weights")]


@pytest.mark.parametrize("compile", [None, "inductor"])
def test_flex_attention_on_packed_rows_equals_exact(compile):
    generics = {"Batch": 1, "MaxSeq": ROW, "T": "f32"}
    exact = nest.load("tiny-llama", device="cuda", generics=generics, entry="loss_packed", numerics="exact")
    fast = nest.load("tiny-llama", device="cuda", generics=generics, entry="loss_packed", numerics="fast", compile=compile)
    for row in rows(3):
        torch.testing.assert_close(fast(*inputs(row)), exact(*inputs(row)), rtol=2e-5, atol=2e-5)


@pytest.fixture
def nccl_world_of_one():
    import torch.distributed as dist

    dist.init_process_group("nccl", store=dist.HashStore(), rank=0, world_size=1, device_id=torch.device("cuda", 0))
    yield
    dist.destroy_process_group()


@pytest.mark.parametrize("compile", [None, "inductor"])
def test_sharded_training_over_nccl_equals_unsharded(nccl_world_of_one, compile):
    from linnet.torch import fully_shard
    from linnet.train import train

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
