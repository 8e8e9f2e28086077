"""Parses an architecture program (a typed subset of Python) with `ast`.

The module level holds declarations only:

    D = dim(config="hidden_size")      # fixed by the instance card
    HeadDim = dim(config="head_dim", default=D // Heads)  # where [config] lacks it
    Batch = dim()                      # a generic, bound at load
    norm_eps = const(config="rms_norm_eps")
    act = const(config="hidden_act", default="silu", allowed=["silu"])  # all the family computes
    T = dtype()                        # the generic compute dtype
    class Layer(Group, repeat=Layers):  # weights gathered together
        q_proj: W[Heads * HeadDim, D] = "model.layers.{i}.self_attn.q_proj.weight"
    @entry
    def logits(tokens: i32[Batch, MaxSeq]) -> f32[Batch, MaxSeq, Vocab]: ...

A repeated group's checkpoint names hold `{i}`, the layer's number; no other
group's do, and no two weights share one. An entry takes tensors only. Function
bodies are kept as syntax for the checker (linnet/cardlang/check.py: a body is
assignments, then one `return`; a loop over a repeated group is one assignment,
`x = layer(x, w, ...)`, whose `x` keeps its type); the shapes of everything
else are resolved here, and every mistake names the file and line."""

from __future__ import annotations

import ast
import string

from linnet.cardlang.errors import CardError
from linnet.cardlang.primitives import PRIMITIVES
from linnet.cardlang.program import (
    ConstDecl,
    DimDecl,
    DtypeDecl,
    FunctionDecl,
    GroupDecl,
    Param,
    Program,
    WeightDecl,
    reserved,
)
from linnet.cardlang.types import CONCRETE_DTYPES, Dim, GroupType, MaskType, TensorType

_RESERVED = {"dim", "const", "dtype", "Group", "W", "weight", "entry", "Mask", *CONCRETE_DTYPES}


def parse_program(source: str, path: str) -> Program:
    try:
        module = ast.parse(source, filename=path)
    except SyntaxError as error:
        raise CardError(path, error.lineno, f"syntax error: {error.msg}") from None
    parser = _Parser(Program(path=path))
    for index, node in enumerate(module.body):
        if index == 0 and _is_docstring(node):
            continue
        parser.declaration(node)
    if len(parser.program.dtypes) != 1:
        raise CardError(path, None, "expected exactly one generic dtype (`T = dtype()`), the dtype weights compute in")
    if not parser.program.entries:
        raise CardError(path, None, "expected at least one `@entry` function")
    return parser.program


def _is_docstring(node: ast.stmt) -> bool:
    return isinstance(node, ast.Expr) and isinstance(node.value, ast.Constant) and isinstance(node.value.value, str)


class _Parser:
    def __init__(self, program: Program):
        self.program = program
        self.checkpoint_names: dict[str, str] = {}  # a weight's checkpoint name -> Group.weight

    def error(self, node: ast.AST | None, message: str) -> CardError:
        return self.error_at(getattr(node, "lineno", None), message)

    def error_at(self, line: int | None, message: str) -> CardError:
        return CardError(self.program.path, line, message)

    # Module-level declarations.

    def declaration(self, node: ast.stmt) -> None:
        if isinstance(node, ast.Assign):
            self.assignment(node)
        elif isinstance(node, ast.ClassDef):
            self.group(node)
        elif isinstance(node, ast.FunctionDef):
            self.function(node)
        else:
            raise self.error(
                node,
                f"expected a declaration (`X = dim(...)`, `X = const(...)`, `T = dtype()`, "
                f"a `class ...(Group)` or a `def`), got {type(node).__name__.lower()}",
            )

    def assignment(self, node: ast.Assign) -> None:
        if len(node.targets) != 1:
            raise self.error(node, "expected one name (or a tuple of names) on the left of `=`")
        target, value = node.targets[0], node.value
        if isinstance(target, ast.Tuple) and isinstance(value, ast.Tuple):
            if len(target.elts) != len(value.elts):
                raise self.error(node, f"{len(target.elts)} names but {len(value.elts)} declarations")
            pairs = list(zip(target.elts, value.elts))
        else:
            pairs = [(target, value)]
        for name_node, call in pairs:
            if not isinstance(name_node, ast.Name):
                raise self.error(node, "expected a plain name on the left of `=`")
            self.declare(name_node.id, call, node)

    def declare(self, name: str, call: ast.expr, node: ast.stmt) -> None:
        self.check_new_name(name, node)
        if not (isinstance(call, ast.Call) and isinstance(call.func, ast.Name)):
            raise self.error(node, f"expected `{name} = dim(...)`, `const(config=...)` or `dtype()`")
        kind = call.func.id
        allowed = {"dim": {"config", "default"},
                   "const": {"config", "default", "allowed", "each"}}.get(kind, {"config"})
        keywords = self.keywords(call, allowed=allowed)
        if call.args:
            raise self.error(node, f"{kind}() takes only keywords: {', '.join(f'{k}=' for k in sorted(allowed))}")
        config = keywords.get("config")
        if config is not None and not (isinstance(config, ast.Constant) and isinstance(config.value, str)):
            raise self.error(node, "config= must name a key of the instance card's [config] as a string")
        key = config.value if config is not None else None
        line = node.lineno
        if kind == "dim":
            default = keywords.get("default")
            if default is not None:
                if key is None:
                    raise self.error(node, f"dim {name} is a generic, bound at load: default= needs config=")
                self.dim_default(default)
            self.program.dims[name] = DimDecl(name, key, line, default)
        elif kind == "const":
            if key is None:
                raise self.error(node, f"const() needs config=: which [config] key gives {name}")
            self.program.consts[name] = self.const(name, key, keywords, node)
        elif kind == "dtype":
            if key is not None:
                raise self.error(node, "dtype() is a generic, bound at load; it takes no config=")
            self.program.dtypes[name] = DtypeDecl(name, line)
        else:
            raise self.error(node, f"unknown declaration {kind}(): expected dim, const or dtype")

    def dim_default(self, node: ast.expr) -> None:
        """A dimension's default: integers and dimensions the card fixes, declared above, with `*` and `//`."""
        if (isinstance(node, ast.Constant) and isinstance(node.value, int) and not isinstance(node.value, bool)
                and node.value > 0):
            return
        if isinstance(node, ast.Name):
            decl = self.program.dims.get(node.id)
            if decl is None or decl.config_key is None:
                raise self.error(node, f"default=: `{node.id}` is not a dimension of the instance card declared above")
            return
        if isinstance(node, ast.BinOp) and isinstance(node.op, (ast.Mult, ast.FloorDiv)):
            self.dim_default(node.left)
            self.dim_default(node.right)
            return
        raise self.error(node, f"default= of a dim: expected a positive integer, a dimension declared above, or "
                               f"a product or quotient (`*`, `//`) of them, got `{ast.unparse(node)}`")

    def const(self, name: str, key: str, keywords: dict[str, ast.expr], node: ast.stmt) -> ConstDecl:
        values = {}
        for keyword in ("default", "allowed", "each"):
            if keyword in keywords:
                try:
                    values[keyword] = ast.literal_eval(keywords[keyword])
                except ValueError:
                    raise self.error(node, f"const {name}: {keyword}= must be a literal value, got "
                                           f"`{ast.unparse(keywords[keyword])}`") from None
        for keyword in ("allowed", "each"):
            if keyword in values and not (isinstance(values[keyword], list) and values[keyword]):
                raise self.error(node, f"const {name}: {keyword}= must be a non-empty list of values, "
                                       f"got {values[keyword]!r}")
        decl = ConstDecl(name, key, node.lineno, "default" in values, values.get("default"),
                         tuple(values["allowed"]) if "allowed" in values else None,
                         tuple(values["each"]) if "each" in values else None)
        if decl.has_default and not decl.supports(decl.default):
            raise self.error(node, f"const {name}: its default {decl.default!r} is not among the values it allows")
        return decl

    def check_new_name(self, name: str, node: ast.AST) -> None:
        if name in _RESERVED:
            raise self.error(node, f"`{name}` is a word of the card language and cannot be redeclared")
        if why := reserved(name):
            raise self.error(node, f"{why}; choose another name")
        if name in PRIMITIVES:
            raise self.error(node, f"`{name}` is a primitive of the card language; choose another name")
        if self.program.declared(name):
            raise self.error(node, f"`{name}` is declared twice")

    def keywords(self, call: ast.Call, allowed: set[str]) -> dict[str, ast.expr]:
        out = {}
        for keyword in call.keywords:
            if keyword.arg not in allowed:
                raise self.error(call, f"unexpected keyword {keyword.arg}=; expected one of {sorted(allowed)}")
            out[keyword.arg] = keyword.value
        return out

    # Groups of weights.

    def group(self, node: ast.ClassDef) -> None:
        self.check_new_name(node.name, node)
        if [ast.unparse(b) for b in node.bases] != ["Group"]:
            raise self.error(node, f"class {node.name} must derive from Group: `class {node.name}(Group):`")
        repeat = None
        for keyword in node.keywords:
            if keyword.arg != "repeat":
                raise self.error(node, f"unexpected keyword {keyword.arg}= in class {node.name}; expected repeat=")
            repeat = self.dim(keyword.value)
        weights: list[WeightDecl] = []
        for index, item in enumerate(node.body):
            if index == 0 and _is_docstring(item):
                continue
            weights.append(self.weight(item, node.name, weights))
            self.check_checkpoint_name(weights[-1], node.name, repeated=repeat is not None)
        if not weights:
            raise self.error(node, f"group {node.name} declares no weights")
        self.program.groups[node.name] = GroupDecl(node.name, repeat, tuple(weights), node.lineno)

    def weight(self, item: ast.stmt, group: str, earlier: list[WeightDecl]) -> WeightDecl:
        if not (isinstance(item, ast.AnnAssign) and isinstance(item.target, ast.Name) and item.value is not None):
            raise self.error(item, f'expected `name: W[dims] = "checkpoint.name"` in group {group}')
        name = item.target.id
        if any(w.name == name for w in earlier):
            raise self.error(item, f"weight {name} is declared twice in group {group}")
        annotation = item.annotation
        if not (isinstance(annotation, ast.Subscript) and ast.unparse(annotation.value) == "W"):
            raise self.error(item, f"weight {name} must be typed W[dims], got {ast.unparse(annotation)}")
        dims = self.dims(annotation.slice)
        value = item.value
        if isinstance(value, ast.Constant) and isinstance(value.value, str):
            return WeightDecl(name, dims, value.value, "normal", None, None, item.lineno)
        if not (isinstance(value, ast.Call) and ast.unparse(value.func) == "weight"):
            raise self.error(item, f'weight {name}: expected a checkpoint name string or weight("name", ...)')
        if len(value.args) != 1 or not (isinstance(value.args[0], ast.Constant)
                                        and isinstance(value.args[0].value, str)):
            raise self.error(item, f"weight {name}: weight() takes the checkpoint name as its one positional argument")
        keywords = self.keywords(value, allowed={"init", "tied_to", "tied_if"})
        init = "normal"
        if "init" in keywords:
            init_node = keywords["init"]
            if not (isinstance(init_node, ast.Constant) and init_node.value in ("normal", "ones")):
                raise self.error(item, f'weight {name}: init= must be "normal" or "ones"')
            init = init_node.value
        tied_to = tied_if = None
        if ("tied_to" in keywords) != ("tied_if" in keywords):
            raise self.error(item, f"weight {name}: tied_to= and tied_if= go together")
        if "tied_to" in keywords:
            tied_to = self.tied_target(keywords["tied_to"], dims, item)
            tied_if_node = keywords["tied_if"]
            if not (isinstance(tied_if_node, ast.Name) and tied_if_node.id in self.program.consts):
                raise self.error(item, f"weight {name}: tied_if= must name a declared const")
            tied_if = tied_if_node.id
        return WeightDecl(name, dims, value.args[0].value, init, tied_to, tied_if, item.lineno)

    def check_checkpoint_name(self, weight: WeightDecl, group: str, repeated: bool) -> None:
        """A repeated group's names hold the layer's number, `{i}`; no name is another's."""
        where = f"weight {weight.name}: its checkpoint name {weight.checkpoint_name!r}"
        try:
            fields = {field for _, field, _, _ in string.Formatter().parse(weight.checkpoint_name) if field is not None}
        except ValueError as error:
            raise self.error_at(weight.line, f"{where} is not a name template ({error})") from None
        if fields - {"i"} or (fields and not repeated):
            raise self.error_at(weight.line, f"{where} may hold {{i}}, the layer's number, in a repeated group only; "
                                             f"got {', '.join(sorted(f'{{{f}}}' for f in fields))}")
        if repeated and not fields:
            raise self.error_at(weight.line, f"{where} lacks {{i}}: group {group} repeats, and each layer's weights "
                                             f"need names of their own")
        other = self.checkpoint_names.setdefault(weight.checkpoint_name, f"{group}.{weight.name}")
        if other != f"{group}.{weight.name}":
            raise self.error_at(weight.line, f"{where} is {other}'s too")

    def tied_target(self, node: ast.expr, dims: tuple[Dim, ...], item: ast.stmt) -> tuple[str, str]:
        if not (isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name)):
            raise self.error(item, "tied_to= must be Group.weight of an earlier group")
        group = self.program.groups.get(node.value.id)
        target = group and next((w for w in group.weights if w.name == node.attr), None)
        if target is None:
            raise self.error(item, f"tied_to={ast.unparse(node)} names no weight of an earlier group")
        if group.repeat is not None:
            raise self.error(item, "tied_to= cannot name a weight of a repeated group")
        if target.dims != dims:
            raise self.error(item, f"tied_to={ast.unparse(node)} has shape W[{_dims_str(target.dims)}], "
                                   f"not W[{_dims_str(dims)}]")
        return group.name, target.name

    # Types and dimensions.

    def dims(self, node: ast.expr) -> tuple[Dim, ...]:
        elements = node.elts if isinstance(node, ast.Tuple) else [node]
        return tuple(self.dim(e) for e in elements)

    def dim(self, node: ast.expr) -> Dim:
        if isinstance(node, ast.Constant) and isinstance(node.value, int) and not isinstance(node.value, bool):
            return Dim.const(node.value)
        if isinstance(node, ast.Name):
            if node.id not in self.program.dims:
                raise self.error(node, f"unknown dimension `{node.id}`: declare it with `{node.id} = dim(...)`")
            return Dim.named(node.id)
        if isinstance(node, ast.BinOp) and isinstance(node.op, ast.Mult):
            return self.dim(node.left) * self.dim(node.right)
        raise self.error(node, f"expected a dimension (a name, an integer or a product), got `{ast.unparse(node)}`")

    def type(self, node: ast.expr | None, what: str):
        if node is None:
            raise self.error(None, f"{what} needs a type annotation")
        if isinstance(node, ast.Name):
            if node.id in self.program.groups:
                return GroupType(node.id)
            if node.id in CONCRETE_DTYPES or node.id in self.program.dtypes:
                return TensorType(node.id, ())
        if isinstance(node, ast.Subscript) and isinstance(node.value, ast.Name):
            head = node.value.id
            empty = isinstance(node.slice, ast.Tuple) and not node.slice.elts
            dims = () if empty else self.dims(node.slice)
            if head == "Mask":
                return MaskType(dims)
            if head in CONCRETE_DTYPES or head in self.program.dtypes:
                return TensorType(head, dims)
        raise self.error(
            node,
            f"{what}: expected a type such as T[Batch, D], i32[Batch, MaxSeq], Mask[Batch, MaxSeq] "
            f"or a group name, got `{ast.unparse(node)}`",
        )

    # Functions.

    def function(self, node: ast.FunctionDef) -> None:
        self.check_new_name(node.name, node)
        decorators = [ast.unparse(d) for d in node.decorator_list]
        if decorators not in ([], ["entry"]):
            raise self.error(node, f"function {node.name}: the only decorator is @entry, got @{decorators[0]}")
        arguments = node.args
        if arguments.vararg or arguments.kwarg or arguments.kwonlyargs or arguments.defaults or arguments.posonlyargs:
            raise self.error(node, f"function {node.name}: only plain positional parameters with types are allowed")
        params = [Param(a.arg, self.type(a.annotation, f"parameter {a.arg} of {node.name}"), a.lineno)
                  for a in arguments.args]
        for index, param in enumerate(params):
            if any(other.name == param.name for other in params[:index]):
                raise self.error_at(param.line, f"function {node.name}: parameter {param.name} is named twice")
            if decorators and not isinstance(param.type, TensorType):
                raise self.error_at(param.line,
                                    f"entry {node.name}: parameter {param.name} is {param.type}; an entry takes "
                                    f"tensors only (a mask is made inside, from the tokens or segments)")
        returns = self.type(node.returns, f"the return of {node.name}")
        body = list(node.body)
        if body and _is_docstring(body[0]):
            body = body[1:]
        self.program.functions[node.name] = FunctionDecl(node.name, params, returns, body, bool(decorators),
                                                         node.lineno)


def _dims_str(dims: tuple[Dim, ...]) -> str:
    return ", ".join(str(d) for d in dims)
