"""The communication schedule of sharded PyTorch code, in one place: where
each layer's gather is launched and waited for, and where its gradient's
reduce-scatter is waited for. The emitter (linnet/emit/source.py) asks this
module for the lines of a sharded layer loop, so the printed source
(`linnet torch CARD --fully-shard`) shows the schedule as it runs.

With prefetch depth d, before layer i computes, the gathers of layers up to
i + d are in flight; in the backward, before layer i's gradient is computed,
the gathers of layers down to i - d are. A layer's reduce-scatter is launched
where the backward reaches its wait (as soon as its weight gradients exist)
and waited for once the layer d below has its gradient. The order is carried
by data, not by where lines sit, so no compiler pass can undo it:

    x = after(x, forward_deps, backward_deps)

is a copy of x made only once `forward_deps` exist, whose gradient is a copy
made only once `backward_deps` exist. Each launch hands out a token (an empty
tensor from the same call) to depend on, so depending on a launch keeps no
gathered buffer alive; in the backward, a token is made again by launching
its gather again, which is how the backward's gathers are placed. And

    x, part = hold(x, part)

passes both through, and in the backward waits for the part's gradient when
x's gradient passes (which the layers below need): where the wait goes. It
also takes the part (`take`, which a loop on one rank calls at each layer's
start): where `train` steps the optimizer in the backward, the part's step is
made there, so that the backward reaches it once the gradient is complete
(linnet/torch/step_in_backward.py).

The layers whose backward comes first (the last prefetch + 1) keep their
gathered weights from the forward (`keep=True`), as FSDP2 keeps its root's,
rather than gather them again while nothing else is in flight. When the
caller reads one group next, after the loop (the head: `then`), the loop
launches its gather as it would a next layer's, kept, and puts it in the
caller's copy of params for its wait_gather; its reduce-scatter is then waited
for under the last layer's backward instead of at once.

With replicas (hybrid sharding: each part held by one rank of every
machine), a part's gradient, reduce-scattered inside the machine, is then
summed across the replicas by an all-reduce that the reduce-scatter's launch
chains to its end (a side stream waits for it), and

    parts = across_replicas(params['layers'])

(the first line of the function that holds the loop, so that its backward
comes last, after the embedding's) waits for every part's all-reduce where
the backward ends: each runs under the backward of the layers below, and
`hold` hands the gradient on without waiting. The first layer has no layers
below it: its launch says `late=True`, and so does the gather of a group that
an entry gathers first (the tied embedding). Their reductions stay inside the
machine, and the mean across the replicas follows the backward
(linnet/torch/hybrid.py), under the optimizer's step of the other parts
where `train` steps it, instead of ending the backward with nothing to hide it.

SHARDED_CALLS below names every function sharded source may call beyond its
own; the wing that runs the source binds them (PyTorch: linnet/torch/collectives.py;
JAX: linnet/jax/train.py), and `check_bindings` refuses source that calls one
not bound, or a binding that is not in the list."""

from __future__ import annotations

import ast
import builtins
from dataclasses import dataclass

# What sharded source may call, by name, and what each does; a new schedule or a new binding starts here.
SHARDED_CALLS = {
    "gather": "a group's weights, gathered (cast, on one rank) where a function first uses them",
    "checkpointed": "a function that takes a group, run in a region whose backward recomputes it",
    "over_layers": "JAX: a layer loop as one call, over a list of layers or lax.scan over one stacked array",
    "launch_gather": "a layer's gather, launched `prefetch` layers ahead",
    "wait_gather": "the weights of a launched gather, once it is done",
    "launch_of": "the tokens of launches that work ordered after them depends on",
    "hold": "(x, part) passed through; the backward waits for the part's gradient as x's passes",
    "take": "a layer's part as the loop hands it over (where the optimizer steps in the backward)",
    "after": "x, made once its forward dependencies exist; its gradient once its backward ones do",
    "across_replicas": "the parts whose gradients are averaged across replicas, waited for where the backward ends",
    "lookup": "an untied table's rows for the tokens, without gathering the table",
    "linears": "x times weights that lie side by side in a gathered buffer, as one product",
}


def check_bindings(source: str, namespace: dict, where: str) -> None:
    """Raises RuntimeError where `source` calls a function it neither defines nor finds among the builtins or
    `namespace`, or where `namespace` binds a name that is not in SHARDED_CALLS, naming each and `where`."""
    nodes = list(ast.walk(ast.parse(source)))
    defined = {node.name for node in nodes if isinstance(node, (ast.FunctionDef, ast.ClassDef))}
    defined |= {node.arg for node in nodes if isinstance(node, ast.arg)}
    defined |= {node.id for node in nodes if isinstance(node, ast.Name) and isinstance(node.ctx, ast.Store)}
    defined |= {(alias.asname or alias.name).split(".")[0] for node in nodes
                if isinstance(node, (ast.Import, ast.ImportFrom)) for alias in node.names}
    called = {node.func.id for node in nodes if isinstance(node, ast.Call) and isinstance(node.func, ast.Name)}
    unbound = sorted(called - defined - set(dir(builtins)) - set(namespace))
    unlisted = sorted(set(namespace) - set(SHARDED_CALLS))
    if unbound or unlisted:
        problems = ([f"calls {', '.join(unbound)}, which nothing binds"] if unbound else []) + (
            [f"is given {', '.join(unlisted)}, which linnet.sharding.schedule.SHARDED_CALLS does not list"]
            if unlisted else [])
        raise RuntimeError(f"the generated source of {where} {' and '.join(problems)}")


@dataclass(frozen=True)
class Schedule:
    prefetch: int = 1  # layers whose gathers run ahead of the one computing; 0 launches each where it is waited for
    communicates: bool = True  # False on one rank: each gather is the cast of the whole part, where it is used
    replicas: int = 1  # copies of each part (hybrid sharding: machines), whose gradients are averaged across them

    def __post_init__(self):
        if not isinstance(self.prefetch, int) or self.prefetch < 0:
            raise ValueError(f"prefetch must be a whole number of layers >= 0, got {self.prefetch!r}")
        if not isinstance(self.replicas, int) or self.replicas < 1:
            raise ValueError(f"replicas must be a whole number >= 1, got {self.replicas!r}")

    @property
    def reduces_late(self) -> bool:
        """Whether the parts reduced last leave their mean across the replicas to after the backward (`late=True`)."""
        return self.replicas > 1 and self.communicates

    @property
    def one_rank(self) -> bool:
        """Whether the code runs on one rank alone: no shard group, no replicas."""
        return not self.communicates and self.replicas == 1

    def describe(self) -> str:
        """The schedule in the generated module's first line."""
        if not self.communicates:
            return "sharded over one rank: each group's gather is the cast of its part, the whole buffer, to T"
        across = f", each part on {self.replicas} replicas" if self.replicas > 1 else ""
        return f"sharded: gathers each group where it is first used, layers {self.prefetch} ahead{across}"

    def _explained(self) -> list[str]:
        d = self.prefetch
        if d == 0:
            return ["Prefetch depth 0: each layer's gather is launched just before the layer computes, and",
                    "again just before its gradient is; its reduce-scatter is waited for at once."]
        below = "next layer's" if d == 1 else f"next {d} layers'"
        return [f"Prefetch depth {d}: layer i + {d}'s gather runs while layer i computes, and in the",
                f"backward layer i - {d}'s while layer i's gradient is computed; a layer's reduce-scatter",
                f"runs under the {below} backward. The last {d + 1} layers keep their gathers for the backward."]

    def replica_waits(self, *, layers: str, indent: str, then: tuple[str, str] | None = None) -> list[str]:
        """With replicas, the first lines of the function that holds the layer loop: each part's
        gradient waited for where the backward ends, after every other gradient of the function
        (the embedding's among them), since autograd reaches what was made first last. `then`'s
        group is put back into params, the caller's copy (as the loop puts its launch there)."""
        if self.replicas == 1 or not self.communicates:
            return []
        return [
            f"{indent}# Across the {self.replicas} replicas: each layer's gradient is summed as soon as its",
            f"{indent}# reduce-scatter ends, and waited for where the backward ends; the first layer's",
            f"{indent}# (late: reduced last) after the backward.",
            f"{indent}parts = across_replicas({layers})  # the layer loop's",
            *([f"{indent}params[{then[0]!r}] = across_replicas(params[{then[0]!r}])"]
              if then is not None and self.prefetch > 0 else []),
        ]

    def layer_loop(self, *, layers: str, group: str, loop_var: str, carried: str, body: list[str], indent: str,
                   then: tuple[str, str] | None = None) -> list[str]:
        """The lines of `for loop_var in layers: carried = ...body...`, with the gathers scheduled.

        layers: the source of the group's parts (`params['layers']`); body: the translated
        statements of one iteration, which read the layer's launched gather as `loop_var`
        and wait for it first thing; carried: the variable one layer hands the next; then:
        (params key, group name) of the group the caller reads next, or None."""
        d, inner = self.prefetch, indent + "    "
        keep = f", keep=i + {d} >= len(parts) - {d + 1}" if d > 0 else ""
        keep += f", late=(i == {-d})" if self.reduces_late else ""  # the first layer's: reduced last
        lines = [
            *(f"{indent}# {line}" for line in self._explained()),
            *([f"{indent}parts = {layers}"] if self.replicas == 1 else []),  # else made by replica_waits
        ]
        lines += [
            f"{indent}gathers = []",
            f"{indent}for i in range(-{d}, len(parts)):",
            f"{inner}if i + {d} < len(parts):",
            f"{inner}    {carried}, part = hold({carried}, parts[i + {d}])",
            f"{inner}    gathers.append(launch_gather(part, {group!r}{keep}))",
        ]
        if then is not None and d > 0:
            key, name = then
            lines += [
                f"{inner}elif i + {d} == len(parts):  # the caller's {name}, launched as a next layer's would be",
                f"{inner}    {carried}, part = hold({carried}, params[{key!r}])",
                f"{inner}    gathers.append(launch_gather(part, {name!r}, keep=True))",
                f"{inner}    params[{key!r}] = gathers[-1]",
            ]
        lines += [
            f"{inner}if i >= 0:",
            f"{inner}    {carried} = after({carried}, launch_of(gathers, i + {d}), launch_of(gathers, i - {d + 1}))",
            f"{inner}    {loop_var} = gathers[i]",
            *(inner + "    " + line for line in body),
        ]
        if d == 0:  # the last layer's gather, launched again where the backward starts
            lines.append(f"{indent}{carried} = after({carried}, [], launch_of(gathers, len(parts) - 1))")
        return lines
