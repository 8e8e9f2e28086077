"""The parsed form of an architecture program: declarations and functions.

Function bodies stay as `ast` nodes; the checker types them and the emitters
translate them. Nothing here is ever executed."""

from __future__ import annotations

import ast
import json
from dataclasses import dataclass, field

from linnet.cardlang.types import Dim
from linnet.sharding.schedule import SHARDED_CALLS

# Names the emitted modules define or their callers inject (the functions sharded source calls,
# linnet.sharding.schedule.SHARDED_CALLS; the scheduled layer loop's locals), the suffix of the local
# that holds a group's weights, and that of a layer's function compiled once around its checkpoint: a
# card's own names may not use them.
RESERVED = frozenset(SHARDED_CALLS) | frozenset({
    "params", "one_layer", "torch", "F", "math", "jax", "jnp", "np", "parts", "part", "gathers", "i",
})
RESERVED_SUFFIX = "_weights"
REGION_SUFFIX = "_region"


def reserved(name: str) -> str | None:
    """Why generated code keeps `name` for itself, or None where a card may use it."""
    if name in RESERVED:
        return f"`{name}` is reserved for generated code"
    for suffix in (RESERVED_SUFFIX, REGION_SUFFIX):
        if name.endswith(suffix):
            return f"`{name}` is reserved for generated code, as is any name ending in {suffix}"
    return None


@dataclass(frozen=True)
class DimDecl:
    name: str
    config_key: str | None  # None: a generic, bound at load
    line: int
    default: ast.expr | None = None  # where [config] lacks the key: integers and earlier dims, `*` and `//`


@dataclass(frozen=True)
class ConstDecl:
    """A setting of the instance card's [config]. `allowed` and `each` state what the family computes:
    a value it does not is an error when the card is checked, never a different computation."""

    name: str
    config_key: str
    line: int
    has_default: bool = False
    default: object = None  # the value where [config] lacks the key: transformers' default
    allowed: tuple | None = None  # the values computed; None: any
    each: tuple | None = None  # a per-layer list is computed when each of its items is one of these

    def supports(self, value) -> bool:
        if self.allowed is None and self.each is None:
            return True
        if self.allowed is not None and any(same_setting(value, a) for a in self.allowed):
            return True
        return self.each is not None and isinstance(value, list) and all(
            any(same_setting(item, e) for e in self.each) for item in value)

    def supported(self) -> str:
        """What the family computes, in config.json's spelling."""
        options = [json.dumps(a) for a in self.allowed or ()]
        if self.each is not None:
            options.append(f"a list of {' or '.join(json.dumps(e) for e in self.each)}")
        return " or ".join(options)


def same_setting(a, b) -> bool:
    """Equal as settings: numbers by value (0 is 0.0), but false is not 0 and "1" is not 1."""
    if isinstance(a, bool) or isinstance(b, bool):
        return isinstance(a, bool) and isinstance(b, bool) and a == b
    if isinstance(a, (int, float)) and isinstance(b, (int, float)):
        return a == b
    return type(a) is type(b) and a == b


@dataclass(frozen=True)
class DtypeDecl:
    name: str
    line: int


@dataclass(frozen=True)
class WeightDecl:
    name: str  # the field name in its group
    dims: tuple[Dim, ...]
    checkpoint_name: str  # Hugging Face name; "{i}" is the layer index in a repeated group
    init: str  # "normal" or "ones": what random initialisation draws
    tied_to: tuple[str, str] | None  # (group, field) this weight is when tied
    tied_if: str | None  # the constant that says whether it is tied
    line: int


@dataclass(frozen=True)
class GroupDecl:
    name: str
    repeat: Dim | None  # a repeated group (the layers) or a single one
    weights: tuple[WeightDecl, ...]
    line: int

    @property
    def key(self) -> str:
        """Where the group's weights live in a model's parameters."""
        snake = "".join("_" + c.lower() if c.isupper() else c for c in self.name).lstrip("_")
        return snake + "s" if self.repeat is not None else snake


@dataclass(frozen=True)
class Param:
    name: str
    type: object
    line: int


@dataclass
class FunctionDecl:
    name: str
    params: list[Param]
    returns: object
    body: list[ast.stmt]
    entry: bool
    line: int


@dataclass
class Program:
    """One architecture program (a family, e.g. Llama)."""

    path: str
    dims: dict[str, DimDecl] = field(default_factory=dict)
    consts: dict[str, ConstDecl] = field(default_factory=dict)
    dtypes: dict[str, DtypeDecl] = field(default_factory=dict)
    groups: dict[str, GroupDecl] = field(default_factory=dict)
    functions: dict[str, FunctionDecl] = field(default_factory=dict)

    @property
    def generic_dims(self) -> list[str]:
        return [d.name for d in self.dims.values() if d.config_key is None]

    @property
    def entries(self) -> list[str]:
        return [f.name for f in self.functions.values() if f.entry]

    @property
    def compute_dtype(self) -> str:
        """The generic dtype weights are computed in (a card declares exactly one)."""
        return next(iter(self.dtypes))

    def declared(self, name: str) -> bool:
        return any(name in table for table in (self.dims, self.consts, self.dtypes, self.groups, self.functions))
