"""The loss from the last hidden states in one op (csrc/linear_cross_entropy.cpp; on CUDA the kernel of
csrc/cuda/cross_entropy.cu): against the generated code's reference, F.linear, upcast, F.cross_entropy and the
weighted mean, in f64, on the CPU and (where there is one) the GPU; opcheck; torch.compile; bad input."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch.utils._python_dispatch import TorchDispatchMode

from linnet.torch import ops

DEVICES = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])


def reference(hidden, head, targets, weights):
    """The generated code's cross_entropy (linnet/emit/prims_torch.py, exact numerics), on flat rows."""
    logits = F.linear(hidden, head).float()
    losses = F.cross_entropy(logits, targets.long(), reduction="none")
    return (losses * weights).sum() / weights.sum().clamp_min(torch.finfo(torch.float32).tiny)


def rows(device, dtype, count=96, width=32, vocabulary=1000, seed=0):
    """Hidden states, head, targets (one ignored) and weights (one zero), as a packed row has them."""
    generator = torch.Generator().manual_seed(seed)
    hidden = torch.randn(count, width, generator=generator, dtype=torch.float64)
    head = torch.randn(vocabulary, width, generator=generator, dtype=torch.float64) / width**0.5
    targets = torch.randint(0, vocabulary, (count,), generator=generator, dtype=torch.int32)
    targets[3] = -100
    weights = torch.rand(count, generator=generator)
    weights[5] = 0.0
    return [x.to(device) for x in (hidden.to(dtype), head.to(dtype), targets, weights)]


def loss_and_gradients(loss_of, hidden, head, targets, weights, scale=1.0):
    hidden, head = (x.detach().clone().requires_grad_() for x in (hidden, head))
    loss = loss_of(hidden, head, targets, weights)
    (loss * scale).backward()
    return loss.detach(), hidden.grad, head.grad


def relative(actual, expected):
    return float((actual.double() - expected.double()).abs().max() / expected.double().abs().max())


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("chunk_rows", [1, 7, 32, 96, 500])
def test_loss_and_gradients_match_the_reference_in_f64(device, chunk_rows):
    hidden, head, targets, weights = rows(device, torch.float64)
    expected = loss_and_gradients(reference, hidden, head, targets, weights, scale=3.0)
    actual = loss_and_gradients(lambda *a: ops.linear_cross_entropy(*a, chunk_rows=chunk_rows),
                                hidden, head, targets, weights, scale=3.0)
    # Each row's weight over their sum is taken in f32 (the weights' dtype), so not to f64's last bit.
    assert float(actual[0]) == pytest.approx(float(expected[0]), rel=1e-12)
    for mine, theirs in zip(actual[1:], expected[1:]):
        assert relative(mine, theirs) < 1e-6


@pytest.mark.parametrize("device", DEVICES)
def test_bf16_rounds_no_worse_than_the_generated_code(device):
    """In bf16 both round the logits and their gradient to bf16; the op also rounds the head's gradient once a
    chunk (4 here). Against f64, its error stays within 1.5 times that of the reference computed in bf16."""
    exact = rows(device, torch.float64, count=256, width=64, vocabulary=2000)
    expected = loss_and_gradients(reference, *exact)
    narrow = [x.to(torch.bfloat16) if x.is_floating_point() and x.dim() == 2 else x for x in exact]
    today = loss_and_gradients(reference, *narrow)
    mine = loss_and_gradients(lambda *a: ops.linear_cross_entropy(*a, chunk_rows=64), *narrow)
    assert abs(float(mine[0]) - float(expected[0])) <= 1.5 * abs(float(today[0]) - float(expected[0])) + 1e-6
    for index in (1, 2):
        assert relative(mine[index], expected[index]) <= 1.5 * relative(today[index], expected[index])
        assert mine[index].dtype == torch.bfloat16


@pytest.mark.parametrize("device", DEVICES)
def test_zero_weights_give_zero_loss_and_gradients(device):
    hidden, head, targets, weights = rows(device, torch.float32)
    loss, grad_hidden, grad_head = loss_and_gradients(ops.linear_cross_entropy, hidden, head, targets,
                                                      torch.zeros_like(weights))
    assert float(loss) == 0.0 and not grad_hidden.any() and not grad_head.any()


def test_no_gradient_is_made_where_none_is_wanted():
    hidden, head, targets, weights = rows("cpu", torch.float32)
    calls = []

    class Record(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            if func is torch.ops.linnet.linear_cross_entropy_forward.default:
                calls.append(args[-1])
            return func(*args, **(kwargs or {}))

    with torch.no_grad(), Record():
        loss = ops.linear_cross_entropy(hidden.requires_grad_(), head, targets, weights)
    with Record():
        ops.linear_cross_entropy(hidden.detach(), head, targets, weights)
    assert calls == [False, False]
    assert float(loss) == pytest.approx(float(reference(hidden.detach(), head, targets, weights)), rel=1e-6)


def test_opcheck():
    hidden, head, targets, weights = rows("cpu", torch.float32, count=12, vocabulary=40)
    torch.library.opcheck(torch.ops.linnet.linear_cross_entropy.default,
                          (hidden.requires_grad_(), head.requires_grad_(), targets, weights, 5))
    torch.library.opcheck(torch.ops.linnet.linear_cross_entropy_forward.default,
                          (hidden.detach(), head.detach(), targets, weights, 5, True))


@pytest.mark.parametrize("device", DEVICES)
def test_compiled_equals_eager(device):
    hidden, head, targets, weights = rows(device, torch.bfloat16)

    def loss_of(hidden, head, targets, weights):
        return ops.linear_cross_entropy(torch.tanh(hidden), head * 2, targets, weights, chunk_rows=40)

    torch._dynamo.reset()
    eager = loss_and_gradients(loss_of, hidden, head, targets, weights)
    compiled = loss_and_gradients(torch.compile(loss_of, fullgraph=True), hidden, head, targets, weights)
    for mine, theirs in zip(compiled, eager):
        torch.testing.assert_close(mine, theirs, rtol=1e-2, atol=1e-4)


@pytest.mark.parametrize("device", DEVICES)
def test_bad_input_is_named(device):
    hidden, head, targets, weights = rows(device, torch.float32)
    with pytest.raises(RuntimeError, match="hidden must be .rows, width. and head .vocabulary, width."):
        ops.linear_cross_entropy(hidden, head[:, :-1], targets, weights)
    with pytest.raises(RuntimeError, match="share a dtype"):
        ops.linear_cross_entropy(hidden, head.double(), targets, weights)
    with pytest.raises(RuntimeError, match="weights must be one per row"):
        ops.linear_cross_entropy(hidden, head, targets, weights[1:])
    for wrong in (torch.cat([targets, targets]), targets[1:], targets[None]):  # more were read as none
        with pytest.raises(RuntimeError, match=r"targets must be one per row \(\d+\) on hidden's device, got shape"):
            ops.linear_cross_entropy(hidden, head, wrong, weights)
    with pytest.raises(RuntimeError, match="targets must be integers, one per row"):
        ops.linear_cross_entropy(hidden, head, targets.float(), weights)
    with pytest.raises(RuntimeError, match="chunk_rows must be at least 1"):
        ops.linear_cross_entropy(hidden, head, targets, weights, chunk_rows=0)


def test_a_target_outside_the_vocabulary_is_refused_on_the_cpu():
    hidden, head, targets, weights = rows("cpu", torch.float32)
    targets[7] = head.shape[0]
    with pytest.raises(RuntimeError, match=r"a target outside \[0, 1000\)"):
        ops.linear_cross_entropy(hidden, head, targets, weights)


@pytest.mark.parametrize("compile", [None, "inductor"])
def test_as_the_generated_codes_loss_it_trains_a_card_alike(monkeypatch, compile):
    """prims_torch.cross_entropy_in_one_op in place of the fast numerics' loss (benchmarks/step.py --loss op),
    its chunks of 10 rows set as step.py --loss-rows sets them: tiny-llama's loss and weight gradients as the
    generated code's, in f32."""
    import functools

    from linnet import nest
    from linnet.emit import prims_torch

    def loss_and_gradients_of(model):
        generator = torch.Generator().manual_seed(1)
        tokens, targets = (torch.randint(0, 512, (2, 24), generator=generator, dtype=torch.int32) for _ in "tt")
        weights = torch.rand(2, 24, generator=generator)
        loss = model.loss(tokens, targets, weights)
        loss.backward()
        return loss.detach(), {name: p.grad for name, p in model.named_weights()}

    def load():
        torch._dynamo.reset()
        return nest.load("tiny-llama", numerics="fast", generics={"Batch": 2, "MaxSeq": 24, "T": "f32"},
                         weights="random", trainable=True, compile=compile, entry="loss")

    expected = loss_and_gradients_of(load())
    monkeypatch.setitem(prims_torch.FAST, "cross_entropy",
                        functools.partial(prims_torch.cross_entropy_in_one_op, rows=10))
    model = load()
    assert "torch.ops.linnet.linear_cross_entropy" in model.source and "rows=10" in model.source
    actual = loss_and_gradients_of(model)
    torch.testing.assert_close(actual[0], expected[0], rtol=1e-6, atol=0)
    assert expected[1] and all(gradient is not None for gradient in expected[1].values())
    for name, gradient in expected[1].items():
        torch.testing.assert_close(actual[1][name], gradient, rtol=1e-5, atol=1e-7, msg=name)
