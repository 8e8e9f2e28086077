"""linnet/torch/compile_once.py: a layer compiled once has its schema found by one trace, not one a call,
while schemas_once() holds; elsewhere torch finds it at every call, as it did."""

from __future__ import annotations

import threading

import pytest
import torch

from linnet.torch.compile_once import schemas_once

LAYERS = 6


@torch.compiler.nested_compile_region
def layer(x, w):
    return torch.sin(x @ w)


def layers(x, weights):
    for w in weights:
        x = layer(x, w)
    return (x * x).sum()  # a tangent laid out as the layers' own (a sum's expanded one is a second backward)


@pytest.fixture
def traced(monkeypatch):
    """The subgraph identifiers that invoke_subgraph traced to find a schema."""
    from torch._higher_order_ops.invoke_subgraph import invoke_subgraph

    seen, own = [], type(invoke_subgraph).gen_schema
    monkeypatch.setattr(type(invoke_subgraph), "gen_schema",
                        lambda self, *args: seen.append(args[1]) or own(self, *args))
    return seen


def compile_and_run():
    torch._dynamo.reset()
    weights = [torch.randn(8, 8, requires_grad=True) for _ in range(LAYERS)]
    torch.compile(layers, backend="aot_eager", fullgraph=True)(torch.randn(4, 8), weights).backward()
    return [w.grad for w in weights]


def test_held_the_layer_is_traced_once(traced):
    with schemas_once():
        compile_and_run()
    assert traced and len(traced) == len(set(traced)), traced
    traced.clear()
    compile_and_run()  # not held (the op keeps the remembering gen_schema, which passes through)
    assert len(traced) >= LAYERS, traced


def test_another_thread_finds_its_own_schemas(traced):
    """Held on one thread, a compile on another traces at every call, as torch does."""
    on_other = []
    with schemas_once():
        thread = threading.Thread(target=lambda: on_other.append(compile_and_run()))
        thread.start()
        thread.join()
    assert on_other and len(traced) >= LAYERS, traced
