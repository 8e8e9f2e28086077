"""Binding a card's generics at load, and checking entry inputs against them.

Generic dimensions are upper bounds: an entry declared over `[Batch, MaxSeq]`
takes any batch up to `Batch` and any length up to `MaxSeq`, the same in
every input of one call; dimensions the instance card fixes must match."""

from __future__ import annotations

from linnet.cardlang.check import Checked
from linnet.cardlang.errors import GenericsError
from linnet.cardlang.types import Dim, TensorType

DTYPES = ("f32", "bf16", "f16")


def bind_generics(checked: Checked, generics: dict) -> dict:
    """The generics as given, checked: every declared one, nothing else, of the right kind."""
    program = checked.program
    if not isinstance(generics, dict):
        raise GenericsError(f"generics must be a dict such as {example(checked)}, got {type(generics).__name__}")
    declared = program.generic_dims + list(program.dtypes)
    missing = [name for name in declared if name not in generics]
    unknown = [name for name in generics if name not in declared]
    if missing or unknown:
        raise GenericsError(
            f"{program.path} declares the generics {declared}: "
            + "; ".join(filter(None, [missing and f"missing {missing}", unknown and f"unknown {unknown}"]))
            + f". For example generics={example(checked)}"
        )
    for name in program.generic_dims:
        value = generics[name]
        if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
            raise GenericsError(f"generic {name} is a dimension and must be a positive integer, got {value!r}")
    for name in program.dtypes:
        if generics[name] not in DTYPES:
            raise GenericsError(f"generic {name} is a dtype and must be one of {list(DTYPES)}, got {generics[name]!r}")
    return dict(generics)


def example(checked: Checked) -> dict:
    program = checked.program
    return {**{name: 1 for name in program.generic_dims}, **{name: "bf16" for name in program.dtypes}}


def check_inputs(checked: Checked, generics: dict, entry: str, shapes: list[tuple[int, ...]], kinds: list[str]) -> None:
    """shapes and kinds ("int", "float") of one call's inputs, against the entry's signature."""
    function = checked.program.functions[entry]
    if len(shapes) != len(function.params):
        names = ", ".join(p.name for p in function.params)
        raise TypeError(f"{entry}() takes {len(function.params)} inputs ({names}), got {len(shapes)}")
    seen: dict[str, int] = {}
    for param, shape, kind in zip(function.params, shapes, kinds):
        declared: TensorType = param.type
        signature = f"{entry}({param.name}: {declared})"
        if len(shape) != declared.rank:
            raise ValueError(f"{signature}: expected {declared.rank} dimensions, got shape {tuple(shape)}")
        wanted = "int" if declared.dtype == "i32" else "float"
        if kind != wanted:
            raise TypeError(f"{signature}: expected an {wanted} tensor, got {kind}")
        for dim, size in zip(declared.dims, shape):
            _check_dim(dim, size, checked.dims, generics, seen, signature, shape)


def _check_dim(dim: Dim, size: int, fixed: dict, generics: dict, seen: dict, signature: str, shape) -> None:
    if len(dim.names) == 1 and dim.coefficient == 1 and dim.names[0] in generics:
        name = dim.names[0]
        if size > generics[name]:
            raise ValueError(f"{signature}: got shape {tuple(shape)}, but {name} is at most {generics[name]} "
                             f"(bound at load)")
        if seen.setdefault(name, size) != size:
            raise ValueError(f"{signature}: {name} is {size} here but {seen[name]} in an earlier input")
        return
    expected = dim.value({**fixed, **generics})
    if size != expected:
        raise ValueError(f"{signature}: got shape {tuple(shape)}, but {dim} is {expected}")
