"""Types of card values: symbolic dimensions, tensors, masks, groups.

A dimension is a product of an integer and named dimensions (`Heads * HeadDim`).
Dimensions that the instance card fixes are substituted before two dimensions
are compared, so `Heads * HeadDim` equals `D` exactly when the numbers agree;
generic dimensions (`Batch`, `MaxSeq`) stay symbolic until load."""

from __future__ import annotations

from dataclasses import dataclass, field

# Dtypes a card can name. "T"-like names are generics, bound at load.
CONCRETE_DTYPES = ("f32", "bf16", "f16", "i32", "bool")


@dataclass(frozen=True)
class Dim:
    """coefficient * product of named dimensions (sorted, with multiplicity)."""

    coefficient: int = 1
    names: tuple[str, ...] = ()

    @staticmethod
    def named(name: str) -> Dim:
        return Dim(1, (name,))

    @staticmethod
    def const(value: int) -> Dim:
        return Dim(value, ())

    def __mul__(self, other: Dim) -> Dim:
        return Dim(self.coefficient * other.coefficient, tuple(sorted(self.names + other.names)))

    def substitute(self, values: dict[str, int]) -> Dim:
        coefficient, names = self.coefficient, []
        for name in self.names:
            if name in values:
                coefficient *= values[name]
            else:
                names.append(name)
        return Dim(coefficient, tuple(names))

    def value(self, values: dict[str, int]) -> int:
        dim = self.substitute(values)
        if dim.names:
            raise KeyError(f"dimension {self} is not bound: {', '.join(dim.names)}")
        return dim.coefficient

    def __str__(self) -> str:
        parts = ([str(self.coefficient)] if self.coefficient != 1 or not self.names else []) + list(self.names)
        return " * ".join(parts)


@dataclass(frozen=True)
class TensorType:
    dtype: str
    dims: tuple[Dim, ...]

    @property
    def rank(self) -> int:
        return len(self.dims)

    def __str__(self) -> str:
        return f"{self.dtype}[{', '.join(str(d) for d in self.dims)}]" if self.dims else self.dtype


@dataclass(frozen=True)
class MaskType:
    """Which positions attend to which: causal, or causal within documents."""

    dims: tuple[Dim, ...]

    def __str__(self) -> str:
        return f"Mask[{', '.join(str(d) for d in self.dims)}]"


@dataclass(frozen=True)
class GroupType:
    """A group of weights gathered together (one layer, the embedding, ...)."""

    name: str

    def __str__(self) -> str:
        return self.name


@dataclass(frozen=True)
class DimValue:
    """A dimension passed as an argument (`split_heads(x, Heads)`)."""

    dim: Dim

    def __str__(self) -> str:
        return f"dim {self.dim}"


@dataclass(frozen=True)
class ConstValue:
    """A number or setting from the instance card (`eps=norm_eps`)."""

    name: str
    value: object = field(compare=False)
    key: str | None = field(default=None, compare=False)  # the [config] key it comes from

    def __str__(self) -> str:
        return f"constant {self.name}"


@dataclass(frozen=True)
class TupleType:
    items: tuple

    def __str__(self) -> str:
        return f"({', '.join(str(t) for t in self.items)})"


def dims_equal(a: Dim, b: Dim, known: dict[str, int]) -> bool:
    return a.substitute(known) == b.substitute(known)
