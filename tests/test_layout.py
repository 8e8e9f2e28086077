"""The package's layout rule, checked on every import statement (at the top of a module or inside a function):

- the neutral core (everything but the wings and the face) imports neither wing;
- the wings, linnet.torch and linnet.jax, never import each other;
- only the face (linnet itself, nest, cli, recipes, and the two modules kept for the first example scripts,
  linnet.train and linnet.packing) imports the face;
- linnet.errors imports nothing of linnet;
- no module reaches itself again through its imports.
"""

from __future__ import annotations

import pytest

import ast
from pathlib import Path

pytestmark = pytest.mark.quick

PACKAGE = Path(__file__).resolve().parents[1] / "linnet"
WINGS = ("linnet.torch", "linnet.jax")
FACE = ("linnet", "linnet.nest", "linnet.cli", "linnet.recipes", "linnet.train", "linnet.packing")


def _module_name(path: Path) -> str:
    parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _modules() -> dict[str, Path]:
    return {_module_name(path): path for path in PACKAGE.rglob("*.py")}


def _imports(path: Path, name: str, modules: dict[str, Path]) -> set[str]:
    """The linnet modules that `path` imports: `from a.b import c` is a.b.c where that is a module, else a.b."""
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            found |= {alias.name for alias in node.names}
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parent = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join(parent + ([base] if base else []))
            for alias in node.names:
                found.add(f"{base}.{alias.name}" if f"{base}.{alias.name}" in modules else base)
    return {module for module in found if module in modules and module != name}


def _graph() -> dict[str, set[str]]:
    modules = _modules()
    return {name: _imports(path, name, modules) for name, path in modules.items()}


def _within(module: str, areas: tuple[str, ...]) -> str | None:
    return next((area for area in areas if module == area or module.startswith(area + ".")), None)


def _face(module: str) -> bool:
    return module == "linnet" or _within(module, FACE[1:]) is not None


def test_each_import_runs_the_way_the_layout_allows():
    broken = []
    for module, imported in sorted(_graph().items()):
        wing = _within(module, WINGS)
        for target in sorted(imported):
            target_wing = _within(target, WINGS)
            if module == "linnet.errors":
                broken.append(f"{module} imports {target}: linnet.errors imports nothing of linnet")
            elif _face(module):
                continue
            elif _face(target) and target != "linnet":
                broken.append(f"{module} imports {target}: only the face imports the face")
            elif wing is None and target_wing is not None:
                broken.append(f"{module} imports {target}: the neutral core imports neither wing")
            elif wing is not None and target_wing not in (None, wing):
                broken.append(f"{module} imports {target}: the wings never import each other")
    assert not broken, "\n".join(broken)


def test_no_module_reaches_itself_through_its_imports():
    graph = _graph()
    circles, state = [], {}

    def visit(module: str, path: list[str]) -> None:
        state[module] = "open"
        for target in sorted(graph[module]):
            if _is_own_package(module, target):
                continue
            if state.get(target) == "open":
                circles.append(" -> ".join(path[path.index(target):] + [target]))
            elif target not in state:
                visit(target, path + [target])
        state[module] = "done"

    for module in sorted(graph):
        if module not in state:
            visit(module, [module])
    assert not circles, "\n".join(circles)


def _is_own_package(module: str, target: str) -> bool:
    """A module's own package's __init__ runs before it whatever it imports: that edge is no circle."""
    return module.startswith(target + ".")


def test_each_wing_exports_its_entry_points():
    import linnet.jax
    import linnet.torch

    assert {"fully_shard", "train", "evaluate"} <= set(linnet.torch.__all__)
    assert {"train", "evaluate"} <= set(linnet.jax.__all__)
    assert all(callable(getattr(linnet.torch, name)) for name in linnet.torch.__all__)
    assert all(callable(getattr(linnet.jax, name)) for name in linnet.jax.__all__)


def test_the_first_example_scripts_imports_still_work():
    from linnet import nest  # noqa: F401
    from linnet.jax.train import train as jax_train
    from linnet.packing import Example, pack  # noqa: F401
    from linnet.torch import fully_shard  # noqa: F401
    from linnet.train import Example as TorchExample, cosine_schedule, pack as torch_pack, train  # noqa: F401

    assert jax_train is __import__("linnet.jax", fromlist=["train"]).train
    assert train is __import__("linnet.torch", fromlist=["train"]).train
    assert TorchExample is Example and torch_pack is pack
