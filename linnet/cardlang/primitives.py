"""The primitives a card may call, with their type rules.

Each emitter gives every primitive an implementation of the same name and
parameters (linnet/emit/prims_torch.py, linnet/emit/prims_jax.py); adding a
primitive is adding a rule here and a function to each of those. A rule also
refuses the settings of the instance card that its primitive does not compute
(`rope`'s scaling), so that a card fails when it is checked, not when it runs."""

from __future__ import annotations

import json
from collections import Counter
from dataclasses import dataclass
from typing import Callable

from linnet.cardlang.types import ConstValue, Dim, DimValue, MaskType, TensorType, TupleType


@dataclass(frozen=True)
class Primitive:
    params: tuple[str, ...]
    keywords: tuple[str, ...]
    rule: Callable  # (CallTypes) -> result type


class CallTypes:
    """The argument types of one primitive call, and ways to demand of them.

    `fail` comes from the checker and raises a CardError at the call's line;
    `fail_setting` raises one at the instance card, naming a [config] key."""

    def __init__(self, name, args, keywords, known, compute, fail, fail_setting):
        self.name, self.args, self.keywords = name, args, keywords
        self.known, self.compute, self.fail, self.fail_setting = known, compute, fail, fail_setting

    def tensor(self, index: int, dtype: str | None = None, rank: int | None = None) -> TensorType:
        value, what = self.args[index], self.what(index)
        if not isinstance(value, TensorType):
            self.fail(f"{what} must be a tensor, got {value}")
        if dtype is not None and value.dtype != dtype:
            self.fail(f"{what} must have dtype {dtype}, got {value}")
        if rank is not None and value.rank != rank:
            self.fail(f"{what} must have {rank} dimensions, got {value}")
        return value

    def mask(self, index: int) -> MaskType:
        value = self.args[index]
        if not isinstance(value, MaskType):
            self.fail(f"{self.what(index)} must be a Mask, got {value}")
        return value

    def dim(self, index: int) -> Dim:
        value = self.args[index]
        if not isinstance(value, DimValue):
            self.fail(f"{self.what(index)} must be a dimension, got {value}")
        return value.dim

    def const(self, keyword: str) -> ConstValue:
        value = self.keywords.get(keyword)
        if not isinstance(value, ConstValue):
            self.fail(f"{self.name}() needs {keyword}= set to a const of the card, got {value}")
        return value

    def unsupported(self, value: ConstValue, message: str):
        """The instance card's setting `value` is one this primitive does not compute."""
        self.fail_setting(value, f"{self.name}() {message}")

    def same(self, a: Dim, b: Dim, what: str) -> None:
        if a.substitute(self.known) != b.substitute(self.known):
            self.fail(f"shape mismatch in {self.name}(): {what}: {a} = {_show(a, self.known)} "
                      f"vs {b} = {_show(b, self.known)}")

    def divide(self, dim: Dim, by: Dim, what: str) -> Dim:
        """dim / by, exactly: symbolically if the names allow, else in numbers."""
        names, divisor = Counter(dim.names), Counter(by.names)
        if not divisor - names and dim.coefficient % by.coefficient == 0:
            return Dim(dim.coefficient // by.coefficient, tuple(sorted((names - divisor).elements())))
        top, bottom = dim.substitute(self.known), by.substitute(self.known)
        if top.names or bottom.names or top.coefficient % bottom.coefficient:
            self.fail(f"{self.name}(): {what}: {dim} = {_show(dim, self.known)} "
                      f"does not divide by {by} = {_show(by, self.known)}")
        return Dim.const(top.coefficient // bottom.coefficient)

    def what(self, index: int) -> str:
        return f"{self.name}() argument {index + 1}"


def _show(dim: Dim, known: dict[str, int]) -> str:
    return str(dim.substitute(known))


def _same_dims(call: CallTypes, a: TensorType, b: TensorType, what: str) -> None:
    if a.rank != b.rank:
        call.fail(f"{call.name}(): {what}: {a} and {b} differ in rank")
    for x, y in zip(a.dims, b.dims):
        call.same(x, y, what)


def _embedding(call: CallTypes):
    tokens = call.tensor(0, dtype="i32")
    table = call.tensor(1, dtype=call.compute, rank=2)
    return TensorType(call.compute, tokens.dims + table.dims[1:])


def _rms_norm(call: CallTypes):
    x = call.tensor(0, dtype=call.compute)
    weight = call.tensor(1, dtype=call.compute, rank=1)
    eps = call.const("eps")
    if not _positive_number(eps.value):
        call.unsupported(eps, "needs a positive number for eps")
    call.same(x.dims[-1], weight.dims[0], "the input's last dimension against the weight")
    return x


def _linear(call: CallTypes):
    x = call.tensor(0, dtype=call.compute)
    weight = call.tensor(1, dtype=call.compute, rank=2)
    call.same(x.dims[-1], weight.dims[1], "the input's last dimension against the weight's inputs (W[Out, In])")
    return TensorType(call.compute, x.dims[:-1] + weight.dims[:1])


def _linear_bias(call: CallTypes):
    out = _linear(call)
    bias = call.tensor(2, dtype=call.compute, rank=1)
    call.same(bias.dims[0], out.dims[-1], "the bias against the weight's outputs (W[Out, In])")
    return out


def _split_heads(call: CallTypes):
    x = call.tensor(0, rank=3)
    heads = call.dim(1)
    batch, seq, width = x.dims
    return TensorType(x.dtype, (batch, heads, seq, call.divide(width, heads, "the width over the heads")))


def _merge_heads(call: CallTypes):
    x = call.tensor(0, rank=4)
    batch, heads, seq, head_dim = x.dims
    return TensorType(x.dtype, (batch, seq, heads * head_dim))


# The frequency scalings rope() computes, each with the keys it reads (transformers' rope_type).
_ROPE_SCALINGS = {
    "default": (),
    "llama3": ("factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings"),
}


def _rope(call: CallTypes):
    positions = call.tensor(0, dtype="i32", rank=2)
    head_dim = call.dim(1)
    call.divide(head_dim, Dim.const(2), "the head dimension, rotated in halves")
    theta = call.const("theta")
    if not _positive_number(theta.value):
        call.unsupported(theta, "needs a positive number for theta")
    _rope_scaling(call, call.const("scaling"))
    table = TensorType("f32", positions.dims + (head_dim,))
    return TupleType((table, table))


def _rope_scaling(call: CallTypes, scaling: ConstValue) -> None:
    """None (absent: transformers' default) or a table whose rope_type rope() computes, with every key it reads."""
    value = scaling.value
    if value is None:
        return
    supported = " or ".join(f'"{kind}"' for kind in _ROPE_SCALINGS)
    if not isinstance(value, dict) or "rope_type" not in value:
        call.unsupported(scaling, f"needs a table with rope_type ({supported}), or no rope_scaling")
    kind = value["rope_type"]
    if kind not in _ROPE_SCALINGS:
        call.unsupported(scaling, f"computes rope_type {supported}, not {json.dumps(kind, default=repr)}")
    missing = [key for key in _ROPE_SCALINGS[kind] if key not in value]
    if missing:
        call.unsupported(scaling, f"needs {', '.join(missing)} in a {kind} scaling")
    numbers = [key for key in _ROPE_SCALINGS[kind] if not _positive_number(value[key])]
    if numbers:
        call.unsupported(scaling, f"needs positive numbers for {', '.join(numbers)}")
    if kind == "llama3" and not value["low_freq_factor"] < value["high_freq_factor"]:
        call.unsupported(scaling, "needs low_freq_factor < high_freq_factor in a llama3 scaling")
    if value.get("partial_rotary_factor", 1.0) != 1.0:  # transformers 5.x keeps it among the rope settings
        call.unsupported(scaling, "rotates every dimension of a head: partial_rotary_factor must be 1.0")


def _positive_number(value) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and value > 0


def _rotate(call: CallTypes):
    x = call.tensor(0, rank=4)
    for index in (1, 2):
        table = call.tensor(index, dtype="f32", rank=3)
        call.same(table.dims[0], x.dims[0], "the batch of the table against x (Batch, Heads, Seq, HeadDim)")
        call.same(table.dims[1], x.dims[2], "the sequence of the table against x")
        call.same(table.dims[2], x.dims[3], "the head dimension of the table against x")
    return x


def _attention(call: CallTypes):
    q = call.tensor(0, dtype=call.compute, rank=4)
    k = call.tensor(1, dtype=call.compute, rank=4)
    v = call.tensor(2, dtype=call.compute, rank=4)
    mask = call.mask(3)
    _same_dims(call, k, v, "keys against values")
    call.same(q.dims[0], k.dims[0], "the batch of queries against keys")
    call.same(q.dims[3], k.dims[3], "the head dimension of queries against keys")
    call.divide(q.dims[1], k.dims[1], "query heads over key-value heads")
    call.same(mask.dims[0], q.dims[0], "the batch of the mask against the queries")
    call.same(mask.dims[1], q.dims[2], "the sequence of the mask against the queries")
    return q


def _elementwise(call: CallTypes):
    return call.tensor(0)


def _positions(call: CallTypes):
    tokens = call.tensor(0, dtype="i32", rank=2)
    return TensorType("i32", tokens.dims)


def _mask(call: CallTypes):
    return MaskType(call.tensor(0, dtype="i32", rank=2).dims)


def _to_f32(call: CallTypes):
    return TensorType("f32", call.tensor(0).dims)


def _cross_entropy(call: CallTypes):
    hidden = call.tensor(0, dtype=call.compute, rank=3)
    head = call.tensor(1, dtype=call.compute, rank=2)
    targets = call.tensor(2, dtype="i32", rank=2)
    weights = call.tensor(3, dtype="f32", rank=2)
    call.same(hidden.dims[2], head.dims[1], "the hidden width against the head's inputs")
    for other in (targets, weights):
        call.same(other.dims[0], hidden.dims[0], "the batch of targets and weights against the hidden states")
        call.same(other.dims[1], hidden.dims[1], "the sequence of targets and weights against the hidden states")
    return TensorType("f32", ())


def _token_statistics(call: CallTypes):
    hidden = call.tensor(0, dtype=call.compute, rank=3)
    head = call.tensor(1, dtype=call.compute, rank=2)
    targets = call.tensor(2, dtype="i32", rank=2)
    call.same(hidden.dims[2], head.dims[1], "the hidden width against the head's inputs")
    call.same(targets.dims[0], hidden.dims[0], "the batch of targets against the hidden states")
    call.same(targets.dims[1], hidden.dims[1], "the sequence of targets against the hidden states")
    return TensorType("f32", hidden.dims[:2] + (Dim.const(3),))


PRIMITIVES: dict[str, Primitive] = {
    "embedding": Primitive(("tokens", "table"), (), _embedding),
    "rms_norm": Primitive(("x", "weight"), ("eps",), _rms_norm),
    "linear": Primitive(("x", "weight"), (), _linear),
    "linear_bias": Primitive(("x", "weight", "bias"), (), _linear_bias),
    "split_heads": Primitive(("x", "heads"), (), _split_heads),
    "merge_heads": Primitive(("x",), (), _merge_heads),
    "rope": Primitive(("positions", "head_dim"), ("theta", "scaling"), _rope),
    "rotate": Primitive(("x", "cos", "sin"), (), _rotate),
    "attention": Primitive(("q", "k", "v", "mask"), (), _attention),
    "silu": Primitive(("x",), (), _elementwise),
    "arange_positions": Primitive(("tokens",), (), _positions),
    "causal_mask": Primitive(("tokens",), (), _mask),
    "document_mask": Primitive(("segments",), (), _mask),
    "to_f32": Primitive(("x",), (), _to_f32),
    "cross_entropy": Primitive(("hidden", "head", "targets", "weights"), (), _cross_entropy),
    "token_statistics": Primitive(("hidden", "head", "targets"), (), _token_statistics),
}
