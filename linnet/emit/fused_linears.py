"""Products of one input computed as one matrix product, in sharded PyTorch code.

A Llama layer projects its normed input three times (q, k, v) and, later,
twice (gate, up). Sharded, a layer's weights lie side by side in the buffer
its gather fills, in the card's order, so the weights of such products form
one matrix there without a copy: one product over it, split, computes all of
them, and a large matrix product is quicker than several small ones
(benchmarks/fused_linears.py: q, k and v of Llama 3.2 1B, forward and
backward, 21% quicker on an H100). The emitter writes

    h_q_proj, h_k_proj, h_v_proj = linears(h, w, ('q_proj', 'k_proj', 'v_proj'))

where the card wrote three `linear(h, w.q_proj)`, ...; fully_shard views each
run's weights as one matrix (linnet/torch/collectives.py, `_views`), and the binding
`linears` makes one product where that view exists, one a weight otherwise.

A run: weights consecutive in their group's declaration, each read once by
`linear(x, w.name)` with the same value of x (no assignment to x between),
with the same trailing dimensions (so that they stack into one matrix)."""

from __future__ import annotations

import ast
from collections.abc import Sequence
from dataclasses import dataclass

from linnet.cardlang.check import Checked
from linnet.cardlang.program import FunctionDecl, GroupDecl
from linnet.cardlang.types import GroupType


@dataclass(frozen=True)
class Run:
    """Products of one input by consecutive weights of one group, made as one."""

    input: str  # the variable they read
    group_variable: str  # the function's parameter that holds the group
    group: str  # the group's name
    names: tuple[str, ...]  # its weights, in the group's order
    statement: int  # the first statement (of the function's body) that reads one of them
    version: int  # how many times `input` was assigned before that statement

    def outputs(self) -> tuple[str, ...]:
        return tuple(f"{self.input}_{name}" for name in self.names)

    def line(self) -> str:
        """The statement that makes them: `h_q_proj, h_k_proj = linears(h, w, ('q_proj', 'k_proj'))`."""
        return (f"{', '.join(self.outputs())} = linears({self.input}, {self.group_variable}, {self.names!r})"
                f"  # one product: side by side in the buffer")


def runs_in(function: FunctionDecl, checked: Checked) -> list[Run]:
    """The runs of `function`'s top-level statements, in the order they are first read."""
    program = checked.program
    groups = {p.name: program.groups[p.type.name] for p in function.params if isinstance(p.type, GroupType)}
    version = Versions()
    reads: dict[tuple[str, int, str], list[tuple[str, int]]] = {}  # (input, its version, group var) -> (weight, stmt)
    for index, statement in enumerate(function.body):
        products = [] if isinstance(statement, ast.For) else [linear_read(n) for n in ast.walk(statement)]
        for x, variable, weight in (p for p in products if p is not None and p[1] in groups):
            # (a loop's body is emitted on its own: its products are left as written)
            reads.setdefault((x, version[x], variable), []).append((weight, index))
        version.assigned_by(statement)
    runs = []
    taken = ({n.id for s in function.body for n in ast.walk(s) if isinstance(n, ast.Name)}
             | {p.name for p in function.params})
    for (x, x_version, variable), read in reads.items():
        names = [name for name, _ in read]
        if len(set(names)) != len(names):  # a weight read twice by the same input: left as the card wrote it
            continue
        first = {name: index for name, index in read}
        untied = {n for n in names if not checked.is_tied(next(w for w in groups[variable].weights if w.name == n))}
        for names_run in _consecutive(groups[variable], untied):
            run = Run(x, variable, groups[variable].name, names_run, min(first[n] for n in names_run), x_version)
            if not taken & set(run.outputs()):  # (a name the card uses: left as the card wrote it)
                runs.append(run)
    return sorted(runs, key=lambda run: run.statement)


def runs_by_group(checked: Checked, functions: list[FunctionDecl]) -> dict[str, tuple[tuple[str, ...], ...]]:
    """Each group's runs over `functions`: the matrices fully_shard views its gathered buffer as."""
    found: dict[str, list[tuple[str, ...]]] = {}
    for function in functions:
        for run in runs_in(function, checked):
            if run.names not in found.setdefault(run.group, []):
                found[run.group].append(run.names)
    return {group: tuple(names) for group, names in found.items()}


class Versions(dict):
    """How many times each variable has been assigned, statement by statement (0 before the first)."""

    def __missing__(self, name: str) -> int:
        return 0

    def assigned_by(self, statement: ast.stmt) -> None:
        for target in (n for n in ast.walk(statement) if isinstance(n, ast.Name) and isinstance(n.ctx, ast.Store)):
            self[target.id] += 1


def replaced(runs: Sequence[Run], statement: int, version: Versions) -> dict[tuple[str, str, str], str]:
    """(input, group variable, weight) -> the run's output, for the products `statement` reads from a run
    made at or before it (its input still the value the run read)."""
    return {(run.input, run.group_variable, name): output for run in runs
            if run.statement <= statement and version[run.input] == run.version
            for name, output in zip(run.names, run.outputs())}


def linear_read(node: ast.AST) -> tuple[str, str, str] | None:
    """(x, g, name) where `node` is `linear(x, g.name)` with x and g plain names, else None."""
    if not (isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id == "linear"
            and len(node.args) == 2 and not node.keywords):
        return None
    x, weight = node.args
    if isinstance(x, ast.Name) and isinstance(weight, ast.Attribute) and isinstance(weight.value, ast.Name):
        return x.id, weight.value.id, weight.attr
    return None


def _consecutive(group: GroupDecl, read: set[str]) -> list[tuple[str, ...]]:
    """The maximal runs, two weights or more, of `read` that are consecutive in `group` and stack."""
    runs, current = [], []
    for weight in group.weights:
        stacks = current and weight.dims[1:] == current[-1].dims[1:] and len(weight.dims) == 2
        if weight.name in read and (not current or stacks):
            current.append(weight)
            continue
        if len(current) > 1:
            runs.append(tuple(w.name for w in current))
        current = [weight] if weight.name in read and len(weight.dims) == 2 else []
    if len(current) > 1:
        runs.append(tuple(w.name for w in current))
    return runs
