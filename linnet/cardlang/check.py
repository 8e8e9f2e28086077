"""Checks an architecture program against an instance card's numbers.

Binds the dimensions and constants that the instance card fixes, then types
every function body: each name, call and operator gets a type, and anything
that does not fit is a CardError at its line, before any source is emitted."""

from __future__ import annotations

import ast
import json
from dataclasses import dataclass

from linnet.cardlang.errors import CardError
from linnet.cardlang.primitives import PRIMITIVES, CallTypes
from linnet.cardlang.program import FunctionDecl, Program, WeightDecl, reserved
from linnet.cardlang.types import ConstValue, Dim, DimValue, GroupType, MaskType, TensorType, TupleType

_OPERATORS = {ast.Add: "+", ast.Sub: "-", ast.Mult: "*", ast.Div: "/"}


@dataclass(frozen=True)
class Checked:
    """A program bound to an instance card's numbers, checked."""

    program: Program
    dims: dict[str, int]  # every dimension the instance card fixes
    consts: dict[str, object]
    assigned: dict[int, object]  # id(assignment node) -> the type it binds (for shape comments)

    def weight_shape(self, weight: WeightDecl) -> tuple[int, ...]:
        return tuple(d.value(self.dims) for d in weight.dims)

    def is_tied(self, weight: WeightDecl) -> bool:
        return weight.tied_to is not None and bool(self.consts[weight.tied_if])

    def repeat(self, group_name: str) -> int:
        repeat = self.program.groups[group_name].repeat
        return 1 if repeat is None else repeat.value(self.dims)


def check_program(program: Program, config: dict, config_path: str) -> Checked:
    dims, consts = {}, {}
    for decl in program.dims.values():
        if decl.config_key is None:
            continue
        value = config.get(decl.config_key)
        if value is None and decl.default is not None:  # absent (or null): transformers' default
            value = _dim_default(decl, decl.default, dims, program, config_path)
        if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
            raise CardError(
                config_path, None,
                f"[config] {decl.config_key} must be a positive integer (dimension {decl.name} of "
                f"{program.path}:{decl.line}), got {value!r}",
            )
        dims[decl.name] = value
    for decl in program.consts.values():
        if decl.config_key in config:
            value = config[decl.config_key]
        elif decl.has_default:
            value = decl.default
        else:
            raise CardError(config_path, None,
                            f"[config] lacks {decl.config_key} (const {decl.name} of {program.path}:{decl.line})")
        if not decl.supports(value):
            raise CardError(
                config_path, None,
                f"[config] {decl.config_key} = {_json(value)} is not supported: {program.path.rsplit('/', 1)[-1]} "
                f"computes {decl.config_key} = {decl.supported()} only (const {decl.name}, {program.path}:{decl.line})",
            )
        consts[decl.name] = value
    checked = Checked(program, dims, consts, {})
    for group in program.groups.values():
        if group.repeat is not None and group.repeat.substitute(dims).names:
            raise CardError(program.path, group.line,
                            f"group {group.name} repeats {group.repeat} times, which is not fixed by the instance card")
        for weight in group.weights:
            free = [n for d in weight.dims for n in d.substitute(dims).names]
            if free:
                raise CardError(program.path, weight.line,
                                f"weight {weight.name} has generic dimensions {free}; weights need fixed shapes")
            if weight.tied_if is not None and not isinstance(consts[weight.tied_if], bool):
                decl = program.consts[weight.tied_if]
                raise CardError(config_path, None,
                                f"[config] {decl.config_key} = {_json(consts[weight.tied_if])} must be true or false: "
                                f"it says whether weight {weight.name} is tied to {'.'.join(weight.tied_to)} "
                                f"({program.path}:{weight.line})")
    for function in program.functions.values():
        _FunctionChecker(checked, function, config_path).run()
    _reject_recursion(program)
    return checked


class _FunctionChecker:
    def __init__(self, checked: Checked, function: FunctionDecl, config_path: str):
        self.checked, self.program, self.function = checked, checked.program, function
        self.config_path = config_path
        self.env = {}
        self.node: ast.AST | None = None
        for param in function.params:
            self.node = param
            self.check_assignable(param.name)
            self.env[param.name] = param.type

    def fail(self, message: str):
        line = getattr(self.node, "lineno", None) or getattr(self.node, "line", None) or self.function.line
        raise CardError(self.program.path, line, f"in {self.function.name}: {message}")

    def fail_setting(self, value: ConstValue, message: str):
        """A setting of the instance card that a primitive does not compute: the card's mistake, named there
        (a number written in the program is the program's)."""
        if value.key is None:
            self.fail(f"{value.name}: {message}")
        line = getattr(self.node, "lineno", None) or self.function.line
        raise CardError(self.config_path, None, f"[config] {value.key} = {_json(value.value)}: {message} "
                                                f"(in {self.function.name}, {self.program.path}:{line})")

    def run(self) -> None:
        body = self.function.body
        if not body or not isinstance(body[-1], ast.Return):
            self.node = body[-1] if body else None
            self.fail("a function must end with `return`")
        for node in ast.walk(ast.Module(body[:-1], [])):
            if isinstance(node, ast.Return):
                self.node = node
                self.fail("`return` only as a function's last statement (a function returns once, after its loops)")
        self.block(body)

    def block(self, statements: list[ast.stmt]) -> None:
        for statement in statements:
            self.node = statement
            self.statement(statement)

    def statement(self, node: ast.stmt) -> None:
        if isinstance(node, ast.Assign) and len(node.targets) == 1:
            value = self.expr(node.value)
            self.node = node
            self.bind(node.targets[0], value)
            self.checked.assigned[id(node)] = value
        elif isinstance(node, ast.Return) and node.value is not None:
            value = self.expr(node.value)
            self.node = node
            if not self.same(value, self.function.returns):
                self.fail(f"returns {value}, but the signature says {self.function.returns}")
        elif isinstance(node, ast.For) and not node.orelse:
            group = self.program.groups.get(getattr(node.iter, "id", None))
            if group is None or group.repeat is None or not isinstance(node.target, ast.Name):
                self.fail("a loop must be `for w in Group:` over a repeated group")
            body = node.body
            carried = body[0].targets[0].id if len(body) == 1 and isinstance(body[0], ast.Assign) \
                and len(body[0].targets) == 1 and isinstance(body[0].targets[0], ast.Name) else None
            if carried is None or carried not in self.env or not any(
                    isinstance(n, ast.Name) and n.id == carried for n in ast.walk(body[0].value)):
                self.fail(f"a loop over {group.name} must be one assignment, `x = layer(x, w, ...)`, of a value "
                          f"made before the loop, from itself: sharded, each layer's weights are gathered "
                          f"around it")
            self.check_assignable(node.target.id)
            self.env[node.target.id] = GroupType(group.name)
            before = dict(self.env)
            self.block(node.body)
            self.node = node
            for name, value in before.items():  # what one pass leaves is what the next pass starts from
                if not self.same(self.env[name], value):
                    self.fail(f"`{name}` is {value} before the loop and {self.env[name]} after a pass of it: a value "
                              f"carried from one {group.name} to the next must keep its type")
        else:
            self.fail(f"expected an assignment, a `for w in Group:` loop or `return`, "
                      f"got `{ast.unparse(node).splitlines()[0]}`")

    def bind(self, target: ast.expr, value) -> None:
        if isinstance(target, ast.Name):
            self.check_assignable(target.id)
            self.env[target.id] = value
        elif isinstance(target, ast.Tuple) and all(isinstance(t, ast.Name) for t in target.elts):
            if not isinstance(value, TupleType) or len(value.items) != len(target.elts):
                self.fail(f"cannot unpack {value} into {len(target.elts)} names")
            for name, item in zip(target.elts, value.items):
                self.check_assignable(name.id)
                self.env[name.id] = item
        else:
            self.fail("assign to a name or a tuple of names")

    def check_assignable(self, name: str) -> None:
        if self.program.declared(name) or name in PRIMITIVES:
            self.fail(f"`{name}` is declared by the card; choose another name for a local value")
        if why := reserved(name):
            self.fail(f"{why}; choose another")

    def same(self, a, b) -> bool:
        known = self.checked.dims
        if isinstance(a, TensorType) and isinstance(b, TensorType):
            return a.dtype == b.dtype and a.rank == b.rank and all(x.substitute(known) == y.substitute(known)
                                                                   for x, y in zip(a.dims, b.dims))
        if isinstance(a, MaskType) and isinstance(b, MaskType):
            return len(a.dims) == len(b.dims) and all(x.substitute(known) == y.substitute(known)
                                                      for x, y in zip(a.dims, b.dims))
        return a == b

    # Expressions.

    def expr(self, node: ast.expr):
        self.node = node
        if isinstance(node, ast.Name):
            return self.name(node.id)
        if isinstance(node, ast.Constant) and isinstance(node.value, (int, float)) and not isinstance(node.value, bool):
            return ConstValue(repr(node.value), node.value)
        if isinstance(node, ast.Attribute):
            return self.weight(node)
        if isinstance(node, ast.Call):
            return self.call(node)
        if isinstance(node, ast.BinOp) and type(node.op) in _OPERATORS:
            return self.binary(node)
        if isinstance(node, ast.UnaryOp) and isinstance(node.op, ast.USub):
            value = self.expr(node.operand)
            if not isinstance(value, (TensorType, ConstValue)):
                self.fail(f"cannot negate {value}")
            return value
        self.fail(f"unsupported expression `{ast.unparse(node)}`")

    def name(self, name: str):
        if name in self.env:
            return self.env[name]
        if name in self.program.dims:
            return DimValue(Dim.named(name))
        if name in self.program.consts:
            return ConstValue(name, self.checked.consts[name], self.program.consts[name].config_key)
        if name in self.program.groups:
            group = self.program.groups[name]
            if group.repeat is not None:
                self.fail(f"{name} is a repeated group: loop over it with `for w in {name}:`")
            return GroupType(name)
        self.fail(f"unknown name `{name}`")

    def weight(self, node: ast.Attribute) -> TensorType:
        value = self.expr(node.value)
        self.node = node
        if not isinstance(value, GroupType):
            self.fail(f"`.{node.attr}` is taken of a group's weights, but `{ast.unparse(node.value)}` is {value}")
        group = self.program.groups[value.name]
        weight = next((w for w in group.weights if w.name == node.attr), None)
        if weight is None:
            self.fail(f"group {group.name} has no weight `{node.attr}`; "
                      f"it has {', '.join(w.name for w in group.weights)}")
        return TensorType(self.program.compute_dtype, weight.dims)

    def call(self, node: ast.Call):
        if not isinstance(node.func, ast.Name):
            self.fail(f"call a primitive or a function of the card by name, not `{ast.unparse(node.func)}`")
        name = node.func.id
        args = [self.expr(a) for a in node.args]
        keywords = {k.arg: self.expr(k.value) for k in node.keywords}
        self.node = node
        if name in PRIMITIVES:
            primitive = PRIMITIVES[name]
            if len(args) != len(primitive.params):
                self.fail(f"{name}() takes {len(primitive.params)} arguments ({', '.join(primitive.params)}), "
                          f"got {len(args)}")
            unknown = set(keywords) - set(primitive.keywords)
            if unknown:
                self.fail(f"{name}() takes no keyword {sorted(unknown)[0]}=; "
                          f"it takes {list(primitive.keywords) or 'none'}")
            return primitive.rule(CallTypes(name, args, keywords, self.checked.dims, self.program.compute_dtype,
                                            self.fail, self.fail_setting))
        function = self.program.functions.get(name)
        if function is None:
            self.fail(f"unknown operation `{name}`: expected a primitive ({', '.join(sorted(PRIMITIVES))}) "
                      f"or a function of the card")
        if function.entry:
            self.fail(f"{name} is an entry; entries are called from outside, not from the card")
        if keywords or len(args) != len(function.params):
            self.fail(f"{name}() takes {len(function.params)} positional arguments, "
                      f"got {len(args)} and {len(keywords)} keywords")
        for param, value in zip(function.params, args):
            if not self.same(value, param.type):
                self.fail(f"shape mismatch: {name}() parameter {param.name} is {param.type}, got {value}")
        return function.returns

    def binary(self, node: ast.BinOp):
        left, right = self.expr(node.left), self.expr(node.right)
        self.node = node
        symbol = _OPERATORS[type(node.op)]
        if isinstance(left, TensorType) and isinstance(right, TensorType):
            if not self.same(left, right):
                self.fail(f"shape mismatch: {left} {symbol} {right} (operands must have the same type)")
            return left
        for tensor, other in ((left, right), (right, left)):
            if (isinstance(tensor, TensorType) and isinstance(other, ConstValue)
                    and isinstance(other.value, (int, float))):
                return tensor
        self.fail(f"cannot compute {left} {symbol} {right}")


def _dim_default(decl, node: ast.expr, dims: dict[str, int], program: Program, config_path: str) -> int:
    """The value of a dimension's default= (checked by the parser: integers, dims declared above, `*`, `//`)."""
    if isinstance(node, ast.Constant):
        return node.value
    if isinstance(node, ast.Name):
        return dims[node.id]
    left = _dim_default(decl, node.left, dims, program, config_path)
    right = _dim_default(decl, node.right, dims, program, config_path)
    if isinstance(node.op, ast.Mult):
        return left * right
    if left % right:
        raise CardError(config_path, None,
                        f"[config] lacks {decl.config_key}, and its default ({_spelled(node, program)} = "
                        f"{left} // {right}, dimension {decl.name} of {program.path}:{decl.line}) does not "
                        f"divide exactly: give {decl.config_key}")
    return left // right


def _spelled(node: ast.expr, program: Program) -> str:
    """A dimension's default in the instance card's words: `hidden_size // num_attention_heads`."""
    if isinstance(node, ast.Constant):
        return str(node.value)
    if isinstance(node, ast.Name):
        return program.dims[node.id].config_key
    return (f"{_spelled(node.left, program)} {'*' if isinstance(node.op, ast.Mult) else '//'} "
            f"{_spelled(node.right, program)}")


def _json(value) -> str:
    return json.dumps(value, default=repr)


def _reject_recursion(program: Program) -> None:
    calls = {
        f.name: {n.func.id for s in f.body for n in ast.walk(s)
                 if isinstance(n, ast.Call) and isinstance(n.func, ast.Name) and n.func.id in program.functions}
        for f in program.functions.values()
    }

    def visit(name: str, path: list[str]) -> None:
        for callee in calls[name]:
            if callee in path:
                function = program.functions[name]
                raise CardError(program.path, function.line,
                                f"recursion: {' -> '.join(path + [callee])}; card functions may not call themselves")
            visit(callee, path + [callee])

    for name in calls:
        visit(name, [name])
