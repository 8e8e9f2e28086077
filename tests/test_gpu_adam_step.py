"""Linnet's CUDA Adam step (csrc/cuda/adam_step.cu) against torch.optim's fused Adam and AdamW, on a GPU."""

from __future__ import annotations

import pytest
import torch

from linnet.torch import ops

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")

SETTINGS = dict(lr=1e-2, betas=(0.8, 0.99), eps=1e-6)


def placed(x, offset):
    """A copy of x that starts `offset` elements into a buffer of its own: off 16-byte alignment if odd."""
    buffer = x.new_zeros(x.numel() + offset)
    buffer[offset:] = x
    return buffer[offset:]


def stepped_by_linnet(param, gradients, kind, weight_decay, *, lr=None, gradient_dtype=torch.float32, offset=0):
    mine, exp_avg, exp_avg_sq = (placed(x, offset) for x in (param, torch.zeros_like(param), torch.zeros_like(param)))
    step = torch.zeros((), device="cuda")
    lr = torch.tensor(SETTINGS["lr"], dtype=torch.float64) if lr is None else lr
    for gradient in gradients:
        ops.adam_step(mine, exp_avg, exp_avg_sq, step, placed(gradient.to(gradient_dtype), offset), lr,
                      *SETTINGS["betas"], weight_decay, SETTINGS["eps"], decoupled=kind is torch.optim.AdamW)
    return mine, exp_avg, exp_avg_sq, step


def stepped_by_torch(param, gradients, kind, weight_decay):
    param = torch.nn.Parameter(param.detach().clone())
    optimizer = kind([param], weight_decay=weight_decay, fused=True, **SETTINGS)
    for gradient in gradients:
        param.grad = gradient
        optimizer.step()
    state = optimizer.state[param]
    return param.detach(), state["exp_avg"], state["exp_avg_sq"], state["step"]


# 4099: a tail past the last whole vector; (1 << 20) + 3: many blocks; one element into a buffer: no vectors
@pytest.mark.parametrize("numel, offset", [(4099, 0), ((1 << 20) + 3, 0), (4096, 1)])
@pytest.mark.parametrize("kind, weight_decay",
                         [(torch.optim.AdamW, 0.1), (torch.optim.Adam, 0.1), (torch.optim.AdamW, 0.0)])
def test_the_cuda_step_is_fused_adams(numel, offset, kind, weight_decay):
    generator = torch.Generator(device="cuda").manual_seed(0)
    param = torch.randn(numel, device="cuda", generator=generator)
    gradients = [torch.randn(numel, device="cuda", generator=generator) for _ in range(3)]
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as profile:
        mine = stepped_by_linnet(param, gradients, kind, weight_decay, offset=offset)
        torch.cuda.synchronize()
    kernels = {event.name for event in profile.events() if event.device_type == torch.autograd.DeviceType.CUDA}
    assert any("adam_kernel" in name for name in kernels), sorted(kernels)  # linnet's kernel, not ATen's
    reference = stepped_by_torch(param, gradients, kind, weight_decay)
    for got, expected in zip(mine, reference):
        if kind is torch.optim.Adam and weight_decay:
            # Adam's L2 term (the gradient plus weight_decay times the parameter) rounds differently in ATen's
            # kernel, written either way here (fused, or rounded twice): 2.4e-7 at most on values of about 1
            # after three steps (an H100). AdamW's decoupled decay, Linnet's default, is the same to the bit.
            torch.testing.assert_close(got, expected, rtol=1e-6, atol=1e-6)
        else:
            assert torch.equal(got, expected), float((got - expected).abs().max())


def test_a_bf16_gradient_steps_as_the_same_values_in_f32():
    """Read in its own dtype: the same step as the gradient widened first, to the bit."""
    generator = torch.Generator(device="cuda").manual_seed(1)
    param = torch.randn(10_001, device="cuda", generator=generator)
    gradients = [torch.randn(10_001, device="cuda", generator=generator).bfloat16() for _ in range(3)]
    narrow = stepped_by_linnet(param, gradients, torch.optim.AdamW, 0.1, gradient_dtype=torch.bfloat16)
    wide = stepped_by_linnet(param, [g.float() for g in gradients], torch.optim.AdamW, 0.1)
    for got, expected in zip(narrow, wide):
        assert torch.equal(got, expected)


def test_a_rate_on_the_device_steps_as_one_on_the_host():
    generator = torch.Generator(device="cuda").manual_seed(2)
    param = torch.randn(5000, device="cuda", generator=generator)
    gradients = [torch.randn(5000, device="cuda", generator=generator) for _ in range(2)]
    on_device = stepped_by_linnet(param, gradients, torch.optim.AdamW, 0.1,
                                  lr=torch.tensor(SETTINGS["lr"], device="cuda"))
    on_host = stepped_by_linnet(param, gradients, torch.optim.AdamW, 0.1)
    for got, expected in zip(on_device, on_host):
        assert torch.equal(got, expected)


def test_a_bf16_parameter_takes_atens_kernel():
    """Not an f32 part: the device-generic body (ATen's fused kernel), as the optimizer steps it."""
    generator = torch.Generator(device="cuda").manual_seed(3)
    param = torch.randn(3000, device="cuda", generator=generator).bfloat16()
    gradients = [torch.randn(3000, device="cuda", generator=generator).bfloat16() for _ in range(2)]
    mine = stepped_by_linnet(param, gradients, torch.optim.AdamW, 0.1, gradient_dtype=torch.bfloat16)
    reference = stepped_by_torch(param, gradients, torch.optim.AdamW, 0.1)
    for got, expected in zip(mine, reference):
        assert torch.equal(got, expected)


@pytest.mark.parametrize("numel, offset", [(4099, 0), ((1 << 20) + 3, 0), (4096, 1)])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_the_cast_the_step_writes_is_the_cast_of_the_stepped_part(numel, offset, dtype):
    """adam_step(..., copy_dtype): the kernel writes the stepped part's cast, which the part's next cast
    (cast_into_sink, Linnet's cast kernel otherwise) returns: the same values, to the bit, as that kernel
    casts from the stepped part, in the vectors, the tail and an unaligned part; and the step is the same as
    without it. (A write through .data after the step, which no version counts, tells the kept cast from a
    cast made then.)"""
    generator = torch.Generator(device="cuda").manual_seed(4)
    param = placed(torch.randn(numel, device="cuda", generator=generator), offset)
    exp_avg = placed(torch.zeros(numel, device="cuda"), offset)
    exp_avg_sq = placed(torch.zeros(numel, device="cuda"), offset)
    gradient = placed(torch.randn(numel, device="cuda", generator=generator).bfloat16(), offset)
    step, lr = torch.zeros((), device="cuda"), torch.tensor(1e-2, dtype=torch.float64)
    plain = [t.clone() for t in (param, exp_avg, exp_avg_sq)]
    ops.drop_stepped_casts([param])
    ops.adam_step(*plain, step.clone(), gradient, lr, 0.9, 0.99, 0.1, 1e-8)
    ops.adam_step(param, exp_avg, exp_avg_sq, step, gradient, lr, 0.9, 0.99, 0.1, 1e-8, copy_dtype=dtype)
    for got, expected in zip((param, exp_avg, exp_avg_sq), plain):
        assert torch.equal(got, expected)
    assert ops.stepped_casts_kept() == 1
    as_stepped = param.clone()
    param.data.add_(1.0)
    sink = torch.zeros((), dtype=dtype, device="cuda").expand(numel)
    taken = ops.cast_into_sink(param, sink, dtype)
    assert ops.stepped_casts_kept() == 0
    assert torch.equal(taken, ops.cast_into_sink(as_stepped, sink, dtype))  # Linnet's cast kernel: none kept for it
