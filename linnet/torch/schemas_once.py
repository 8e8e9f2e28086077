"""The check torch makes at each call of a layer compiled once, made once a layer's kind.

Under autograd, each call of a higher-order op that cannot train with its inputs mutated asks the op for
its schema (torch/_ops.py, `maybe_run_autograd`), and `invoke_subgraph` finds it by tracing its subgraph
again. A layer compiled once (`@torch.compiler.nested_compile_region`) is one subgraph called for every
layer, so AOT autograd traced the same layer once a layer, in each of its two passes (the metadata and the
joint graph): at 8B on one H200 most of the first step's compile (benchmarks/NOTES.md, seventeenth
session). While `schemas_once()` holds, a call whose subgraph identifier and operands (their kind, shape,
strides, dtype, device, and whether they require grad) were met before gets the schema found then; the
first still traces, so a layer that mutates its inputs is still refused."""

from __future__ import annotations

from contextlib import contextmanager

import torch


def _operand_key(operand) -> tuple:
    if isinstance(operand, torch.Tensor):
        return (type(operand).__name__, tuple(map(str, operand.shape)), tuple(map(str, operand.stride())),
                operand.dtype, operand.device, operand.requires_grad)
    return (type(operand).__name__, str(operand))


@contextmanager
def schemas_once():
    try:
        from torch._higher_order_ops.invoke_subgraph import invoke_subgraph
    except ImportError:  # a torch without nested compile regions: nothing to do
        yield
        return
    if not hasattr(invoke_subgraph, "gen_schema") or "gen_schema" in vars(invoke_subgraph):  # none, or held already
        yield
        return
    found = invoke_subgraph.gen_schema  # the op's own, bound
    schemas: dict = {}

    def gen_schema(subgraph, identifier, *operands):
        if identifier is None:  # no identity to know the subgraph again by
            return found(subgraph, identifier, *operands)
        key = (identifier, *map(_operand_key, operands))
        if key not in schemas:
            schemas[key] = found(subgraph, identifier, *operands)
        return schemas[key]

    invoke_subgraph.gen_schema = gen_schema  # on the instance, over the class's method
    try:
        yield
    finally:
        del invoke_subgraph.gen_schema
