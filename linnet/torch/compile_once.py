"""The check torch makes at each call of a layer compiled once, made once a layer's kind.

Under autograd, each call of a higher-order op that cannot train with its inputs mutated asks the op for
its schema (torch/_ops.py, `maybe_run_autograd`), and `invoke_subgraph` finds it by tracing its subgraph
again. A layer compiled once (`@torch.compiler.nested_compile_region`) is one subgraph called for every
layer, so AOT autograd would trace the same layer once a layer, in each of its two passes (the metadata and
the joint graph): at 8B, most of the first step's compile (docs/design/compile_time.md). While
`schemas_once()` holds on a thread, a call there whose subgraph identifier and operands (their kind, shape,
strides, dtype, device, and whether they require grad) were met before gets the schema found then; the
first still traces, so a layer that mutates its inputs is still refused. Elsewhere, and on other threads,
the op finds its schema as it always does."""

from __future__ import annotations

import functools
import threading
from contextlib import contextmanager

import torch

_held = threading.local()  # .schemas: this thread's memo while schemas_once() holds, else absent
_install = threading.Lock()


def _operand_key(operand) -> tuple:
    if isinstance(operand, torch.Tensor):
        return (type(operand).__name__, tuple(map(str, operand.shape)), tuple(map(str, operand.stride())),
                operand.dtype, operand.device, operand.requires_grad)
    return (type(operand).__name__, str(operand))


def _remembering(op):
    """`op`'s gen_schema (its class's, looked up at each call), answered from this thread's memo where one
    is held."""

    def found(*args):
        return type(op).gen_schema(op, *args)

    def gen_schema(subgraph, identifier, *operands):
        schemas = getattr(_held, "schemas", None)
        if schemas is None or identifier is None:  # not held here, or no identity to know the subgraph by
            return found(subgraph, identifier, *operands)
        key = (identifier, *map(_operand_key, operands))
        if key not in schemas:
            schemas[key] = found(subgraph, identifier, *operands)
        return schemas[key]

    gen_schema.linnet_remembers = True
    return gen_schema


@functools.cache  # asked at every call of a compiled entry: the import and the lock once a process
def _installed() -> bool:
    """Puts the remembering gen_schema on the op, once a process; False on a torch without one."""
    try:
        from torch._higher_order_ops.invoke_subgraph import invoke_subgraph
    except ImportError:  # no nested compile regions
        return False
    with _install:
        current = getattr(invoke_subgraph, "gen_schema", None)
        if current is None:
            return False
        if not getattr(current, "linnet_remembers", False):
            invoke_subgraph.gen_schema = _remembering(invoke_subgraph)  # on the instance, over the class's method
    return True


@contextmanager
def schemas_once():
    # held already (a nested entry), or nothing to do
    if getattr(_held, "schemas", None) is not None or not _installed():
        yield
        return
    _held.schemas = {}
    try:
        yield
    finally:
        del _held.schemas
