"""What sharded PyTorch source calls, bound to a model's `Sharding`: the gathers (launched, waited for,
held for the backward), the ordering tokens, the lookups of an untied table, the fused products of a
group's buffer, and the wait across replicas. linnet.sharding.schedule lists the names and says where the
generated code calls each; `bindings(sharding)` binds every one of them, and the model checks that it does
when the source is installed.

Compiled (torch.compile), the schedule is the graph's: launches, waits and the `after` dependencies are
nodes, each launch that is not kept in a checkpoint region of its own so that the backward launches it
again rather than keep its buffer. Eager, the same source runs each gather where it is waited for, in the
layer's checkpointed region, and waits for each reduce-scatter at once: a checkpointed region must run the
same ops when the backward recomputes it, and a gather launched outside it would be kept, as its
argument, until then."""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from functools import partial
from typing import NamedTuple

import torch
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint, create_selective_checkpoint_contexts

from linnet.sharding.layout import GroupLayout
from linnet.sharding.schedule import Schedule
from linnet.torch import ops
from linnet.torch.held_gradients import Held, into_whole
from linnet.torch.recompute import checkpointed, recompute_all
from linnet.torch.step_in_backward import Stepped, taken

__all__ = ["Sharding", "bindings", "gathered_weights"]


@dataclass(frozen=True)
class Sharding:
    group_name: str  # the ranks that share the weights out (the mesh's "shard" dimension)
    rank: int  # in that group
    world: int  # that group's size: the parts a group of weights is cut into
    layouts: dict  # card group name -> GroupLayout
    recompute: str
    compute_dtype: torch.dtype
    reduce_dtype: torch.dtype  # what gradients are reduce-scattered (and all-reduced across replicas) in
    schedule: Schedule
    reshard_after_forward: bool = True  # False: each layer's gathered weights kept from its forward to its backward
    replicate_group_name: str | None = None  # the ranks that hold the same parts (the mesh's "replicate" dimension)
    replicas: int = 1
    replica: int = 0  # this rank's, in that group: replica 0 writes the parts into checkpoints
    # card group name -> the runs of its weights that the code multiplies one input by (linnet/emit/fused_linears.py):
    # each viewed as one matrix of the gathered buffer where its weights lie side by side
    products: dict = field(default_factory=dict)



def bindings(sharding: Sharding) -> dict:
    """The functions sharded source calls (linnet.sharding.schedule.SHARDED_CALLS), bound to `sharding`."""
    return {
        "gather": partial(_gather, sharding),
        "launch_gather": partial(_launch_gather, sharding),
        "wait_gather": partial(_wait_gather, sharding),
        "launch_of": _launch_of,
        "hold": partial(_hold, sharding),
        "take": partial(_take, sharding),
        "after": _after,
        "checkpointed": partial(checkpointed, sharding.recompute, sharding.reshard_after_forward),
        "lookup": partial(_lookup, sharding),
        "across_replicas": partial(_wait_across_replicas, sharding),
        "linears": _linears,
    }


def _across(sharding: Sharding, late: bool) -> tuple[str, int]:
    """(replicate group name, replicas) that a part's reduction goes on across: none for a part reduced
    last (`late`), whose mean across the replicas follows the backward (linnet/torch/hybrid.py)."""
    return ("", 1) if late else (sharding.replicate_group_name or "", sharding.replicas)


def _all_gather(sharding: Sharding, part: torch.Tensor, late: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """The gather whose backward averages the gradient over this shard group and across the replicas
    (only over this shard group where `late`)."""
    replicate_group_name, replicas = _across(sharding, late)
    return ops.all_gather(part, sharding.compute_dtype, sharding.world, sharding.group_name, reduce_op="avg",
                          reduce_dtype=sharding.reduce_dtype, replicate_group_name=replicate_group_name,
                          replicas=replicas)


def _views(sharding: Sharding, full: torch.Tensor, group: str) -> dict:
    """The group's weights as views of its gathered buffer, by name; and each run of them that the code
    multiplies one input by (Sharding.products) whose weights lie side by side, as one matrix, by the run's
    names (a tuple), its weights then views of that matrix's rows."""
    pieces = _pieces(sharding.layouts[group], sharding.products.get(group, ()))
    views = ops.group_views(full, [offset for _, offset, _ in pieces], [shape for _, _, shape in pieces])
    weights = {}
    for (names, _, _), view in zip(pieces, views):
        if isinstance(names, str):
            weights[names] = view
            continue
        weights[names], row = view, 0
        for name, rows in zip(names, _rows(sharding.layouts[group], names)):
            weights[name], row = view.narrow(0, row, rows), row + rows
    return weights


def _pieces(layout: GroupLayout, runs: tuple) -> list[tuple]:
    """(a weight's name or a run's names, offset, shape) for each view of a group's buffer: a run as one
    matrix where its weights follow one another with no gap and stack (the same trailing dimensions)."""
    where = {name: (offset, shape) for name, offset, shape in zip(layout.names, layout.offsets, layout.shapes)}
    joined = {}
    for names in runs:
        shapes = [where[name][1] for name in names]
        ends = [where[name][0] + math.prod(where[name][1]) for name in names]
        if (all(len(shape) == 2 and shape[1:] == shapes[0][1:] for shape in shapes)
                and all(end == where[name][0] for end, name in zip(ends, names[1:]))):
            joined[names[0]] = names
    pieces, inside = [], set()
    for name in layout.names:
        if name in joined:
            names = joined[name]
            inside.update(names)
            pieces.append((names, where[name][0], (sum(_rows(layout, names)), where[name][1][1])))
        elif name not in inside:
            pieces.append((name, *where[name]))
    return pieces


def _rows(layout: GroupLayout, names: tuple) -> list[int]:
    return [layout.shapes[layout.names.index(name)][0] for name in names]


def _linears(x: torch.Tensor, weights: dict, names: tuple) -> tuple:
    """x times each of the weights `names` (nn.Linear's product): one product and a split where `_views`
    found them side by side (one matrix), one product a weight otherwise."""
    matrix = weights.get(names)
    if matrix is None:
        return tuple(F.linear(x, weights[name]) for name in names)
    return tuple(F.linear(x, matrix).split([weights[name].shape[0] for name in names], dim=-1))


def _gather(sharding: Sharding, part, group: str, late: bool = False) -> dict[str, torch.Tensor]:
    """One group's weights, gathered from every rank, in the compute dtype: launched and waited for at once.
    late: the part is reduced last, its mean across the replicas left to after the backward. On one rank a
    stepped part is cast with its gradient going to the sink (`_take`): a layer's, and a tied table's, whose
    two gradients (the lookup's and the head's) autograd sums in the compute dtype either way. A Held part's
    gradient goes to its buffer (linnet/torch/held_gradients.py)."""
    part = _take(sharding, part)
    if isinstance(part, Held):
        return _views(sharding, into_whole(ops.wait(_launch(sharding, part)[0]), part), group)
    if isinstance(part, Sinking):
        return _views(sharding, ops.cast_into_sink(part.part, part.sink, sharding.compute_dtype), group)
    return _views(sharding, ops.wait(_all_gather(sharding, part, late)[0]), group)


class Sinking(NamedTuple):
    """On one rank, a part stepped in the backward as a layer's region receives it (`_take`): the part,
    detached, and the sink its cast's gradient goes to."""

    part: torch.Tensor
    sink: torch.Tensor  # a zero of the compute dtype expanded to the part's size: its gradient steps the part


def _take(sharding: Sharding, part):
    """A layer's part as its loop hands it to the layer, or a part as `_gather` first uses it (`taken`). On
    one rank, a part stepped in the backward is handed over Sinking: its gather, a cast (made again in the
    backward, unless reshard_after_forward=False keeps it), sends its gradient, in the compute dtype, to the
    sink, whose node steps the part with it as it is, where a gather's backward would first make it f32
    (its reduce-scatter on one rank: about 3 ms of the 1B's step on an H200). A layer's compiled region
    cannot step the part itself: torch refuses a region that changes its inputs.

    The step also writes the part's cast for the next forward (`_casts_from_the_step`)."""
    if not (isinstance(part, Stepped) and sharding.world == 1 and sharding.replicas == 1):
        return taken(part)
    sink = torch.zeros((), dtype=sharding.compute_dtype, device=part.part.device).expand(part.part.shape)
    cast = sharding.compute_dtype if _casts_from_the_step(sharding) and part.state.writes_casts else None
    return Sinking(part.part, taken(part, through=sink, cast_dtype=cast))


def _casts_from_the_step(sharding: Sharding) -> bool:
    """Whether, on one rank, Adam's step writes each part's cast for the next forward's cast to take
    (csrc/stepped_casts.cpp): two bytes a parameter more for the step to write, six fewer for the cast
    to read and write (the 1B on an H100: about 1.7 ms a step). A step's cast is held from the step, in
    the backward, to the forward that takes it. Where the layers keep their casts from the forward to
    the backward (reshard_after_forward=False) that costs nothing: each step's cast takes the place of
    the kept one that its layer's backward has just freed, and the next forward takes it in turn. Where
    they do not, the steps' casts pile up through the backward as the layers' activations are freed, and
    by its end every part's cast is held: more than the peak without them wherever a layer keeps less
    than its cast, as under "full", or with short rows (the 1B under "gather" keeps about 300 MiB a layer
    at 4,096 tokens, 75 at 1,024, against a cast of 116). There the forward casts, as before."""
    return not sharding.reshard_after_forward


class Launched(NamedTuple):
    """A gather in flight in compiled code: graph values, whose lifetimes the graph decides."""

    part: torch.Tensor  # what the gradient goes to (the launch reads it detached)
    gathered: torch.Tensor  # valid once waited for
    token: torch.Tensor  # made by the launch: what work ordered after it depends on
    late: bool = False  # reduced last: averaged across the replicas after the backward


class Pending(NamedTuple):
    """A gather in eager code: launched where it is waited for."""

    part: torch.Tensor
    late: bool = False


class _Hold(torch.autograd.Function):
    """(x, part), passed through; in the backward, the part's gradient (arriving un-waited from
    the reduction that `wait_gathered` launched) is waited for as x's gradient passes. With
    replicas, that reduction goes on across them (launched when the reduce-scatter ends): the
    gradient is handed on un-waited to `across_replicas`, which waits where the backward ends."""

    @staticmethod
    def forward(ctx, x, part, replicas):
        ctx.replicas = replicas
        return x.view_as(x), part.view_as(part)

    @staticmethod
    def backward(ctx, x_gradient, part_gradient):
        if part_gradient is not None and ctx.replicas == 1:
            part_gradient = ops.wait(part_gradient)
        return x_gradient, part_gradient, None


class _WaitAcrossReplicas(torch.autograd.Function):
    """A part, passed through; in the backward, its gradient (reduce-scattered and summed across the
    replicas by the reduction that `wait_gathered` launched, un-waited) is waited for."""

    @staticmethod
    def forward(ctx, part):
        return part.view_as(part)

    @staticmethod
    def backward(ctx, gradient):
        return torch.ops._c10d_functional.wait_tensor(gradient)


def _hold(sharding: Sharding, x: torch.Tensor, part) -> tuple[torch.Tensor, torch.Tensor]:
    """(x, the part `taken`); compiled, held for the backward (eager code waits where it gathers)."""
    part = taken(part)
    if not torch.compiler.is_compiling() or isinstance(part, Held):  # a Held part takes no gradient to wait for
        return x, part
    return _Hold.apply(x, part, sharding.replicas)


def _wait_across_replicas(sharding: Sharding, parts):
    """`parts` (a part or a list), each `taken` (its step, stepping in the backward, made here: before the
    wait, so that it comes after it); compiled, with replicas, each gradient waited for where the backward
    ends. Made before the layer loop, so that autograd reaches these nodes last."""
    if isinstance(parts, list):
        return [_wait_across_replicas(sharding, part) for part in parts]
    part = taken(parts)  # here, before the wait's node, so that the step comes after the wait
    if not torch.compiler.is_compiling() or sharding.replicas == 1 or isinstance(part, Held):
        return part
    return _WaitAcrossReplicas.apply(part)


def _launch(sharding: Sharding, part) -> tuple[torch.Tensor, torch.Tensor]:
    """The gather of the part (or a Held one's part), detached: no gradient reaches the part through it."""
    part = part.part if isinstance(part, Held) else part
    return ops.all_gather(part.detach(), sharding.compute_dtype, sharding.world, sharding.group_name)


def _launch_gather(sharding: Sharding, part: torch.Tensor, group: str, keep: bool = False,
                   late: bool = False) -> Launched | Pending:
    """keep: the gathered buffer is kept for the backward (the groups whose backward comes first);
    otherwise the backward launches the gather again. late: the part is reduced last (the first
    layer's), its mean across the replicas left to after the backward."""
    if not torch.compiler.is_compiling():
        return Pending(part, late)
    if keep or not sharding.reshard_after_forward:
        return Launched(part, *_launch(sharding, part), late)
    # A region of its own, so that the launch is recomputed in the backward (where its token is
    # first needed) rather than its buffer kept from the forward.
    gathered, token = checkpoint(_launch, sharding, part, use_reentrant=False,
                                 context_fn=partial(create_selective_checkpoint_contexts, recompute_all))
    return Launched(part, gathered, token, late)


def _wait_gather(sharding: Sharding, launched: Launched | Pending, group: str) -> dict[str, torch.Tensor]:
    """The launched group's weights, once its gather is done."""
    if isinstance(launched, Pending):
        return _gather(sharding, launched.part, group, launched.late)
    if isinstance(launched.part, Held):
        return _views(sharding, into_whole(ops.wait(launched.gathered), launched.part), group)
    full = ops.wait_gathered(launched.gathered, launched.part, "avg", sharding.reduce_dtype, sharding.world,
                             sharding.group_name, *_across(sharding, launched.late))
    return _views(sharding, full, group)


def _launch_of(gathers: list, *indices: int) -> list[torch.Tensor]:
    """The tokens of the launches at `indices` that exist (compiled code; eager code orders by running)."""
    return [gathers[i].token for i in indices if 0 <= i < len(gathers) and isinstance(gathers[i], Launched)]


def _after(x: torch.Tensor, forward_deps: list, backward_deps: list) -> torch.Tensor:
    return ops.after(x, forward_deps, backward_deps) if forward_deps or backward_deps else x


class _DivideGradient(torch.autograd.Function):
    """x, whose gradient is divided by `divisor` (as a reduce-scatter "avg" divides)."""

    @staticmethod
    def forward(ctx, x, divisor):
        ctx.divisor = divisor
        return x.view_as(x)

    @staticmethod
    def backward(ctx, gradient):
        return gradient / ctx.divisor, None


class _RowsOfEveryReplica(torch.autograd.Function):
    """(shard ranks, replicas, tokens, width) rows, this part's for every rank's tokens: in the forward,
    this replica's summed over the shard group and scattered, each rank its own tokens' rows; in the
    backward, every rank's rows' gradients gathered, across the replicas (the slow link: one row
    gradient a token) and then inside the shard group, so that the part's gradient is the sum over
    every rank's tokens and needs no all-reduce across the replicas (whose buffer is the table's part)."""

    @staticmethod
    def forward(ctx, rows, group_name, replicate_group_name, replica):
        ctx.group_name, ctx.replicate_group_name = group_name, replicate_group_name
        shard_ranks, replicas, tokens, width = rows.shape
        ctx.shard_ranks, ctx.replicas = shard_ranks, replicas
        mine = rows[:, replica].reshape(shard_ranks * tokens, width)
        functional = torch.ops._c10d_functional
        return functional.wait_tensor(functional.reduce_scatter_tensor(mine, "sum", shard_ranks, group_name))

    @staticmethod
    def backward(ctx, gradient):
        functional = torch.ops._c10d_functional
        across = functional.wait_tensor(functional.all_gather_into_tensor(gradient.contiguous(), ctx.replicas,
                                                                           ctx.replicate_group_name))
        every = functional.wait_tensor(functional.all_gather_into_tensor(across, ctx.shard_ranks, ctx.group_name))
        return every.view(ctx.shard_ranks, ctx.replicas, *gradient.shape), None, None, None


def _gather_tokens(sharding: Sharding, tokens: torch.Tensor) -> torch.Tensor:
    """Every rank's tokens, flat, ordered (shard rank, replica, position): this shard group's alone
    where there is one replica."""
    functional, wait = torch.ops._c10d_functional, torch.ops._c10d_functional.wait_tensor
    flat = tokens.reshape(-1)
    if sharding.replicas > 1:
        flat = wait(functional.all_gather_into_tensor(flat, sharding.replicas, sharding.replicate_group_name))
    return wait(functional.all_gather_into_tensor(flat, sharding.world, sharding.group_name))


def _lookup(sharding: Sharding, tokens: torch.Tensor, part: torch.Tensor, group: str, weight: str) -> torch.Tensor:
    """The rows of a table (the untied embedding) for this rank's tokens, looked up without gathering
    the table: every rank's tokens are gathered (a few KB), each rank takes the rows its part holds,
    zeros elsewhere, and a reduce-scatter sums each rank's rows from all parts (exact: one part holds
    each element). In the backward the rows' gradients are gathered and each rank adds those of its
    own rows into its part's gradient, in f32: a gather of the tokens' rows instead of the table's,
    and no reduce-scatter of the table's gradient. With replicas, the rows of every replica's tokens
    are looked up too and their gradients gathered from every rank (`_RowsOfEveryReplica`): a
    token's row crosses the slow link, where an all-reduce would carry the table's part. As every
    other group's, the part's gradient is that of the mean of the ranks' losses."""
    layout, world, rank, replicas = sharding.layouts[group], sharding.world, sharding.rank, sharding.replicas
    part = taken(part)
    if isinstance(part, Held):  # its gradient comes by the rows' gather, never the table's: to the part as always
        part = part.part
    index = layout.names.index(weight)
    (rows, width), offset = layout.shapes[index], layout.offsets[index]
    start = rank * layout.part_size
    low, high = max(start, offset), min(start + layout.part_size, offset + rows * width)  # the table's elements here
    first = (low - offset) // width
    count = max(-(-(high - offset) // width) - first, 1) if high > low else 1
    # The part's elements of rows first .. first + count, zeros around them (all zeros where the part
    # holds none of the table); its gradient is the sum over every rank's rows, divided as "avg" divides.
    left, piece = (low - offset - first * width, part[low - start:high - start]) if high > low else (0, part[:0])
    slab = _DivideGradient.apply(torch.nn.functional.pad(piece, (left, count * width - left - piece.numel())),
                                 world * replicas)
    local = _gather_tokens(sharding, tokens).to(torch.int64) - first
    held = ((local >= 0) & (local < count))[:, None]
    # (ranks x tokens, width)
    found = (slab.view(count, width)[local.clamp(0, count - 1)] * held).to(sharding.compute_dtype)
    if replicas > 1:
        found = found.view(world, replicas, tokens.numel(), width)
        mine = _RowsOfEveryReplica.apply(found, sharding.group_name, sharding.replicate_group_name, sharding.replica)
        return mine.view(*tokens.shape, width)
    mine = torch.ops._c10d_functional_autograd.reduce_scatter_tensor(found, "sum", world, sharding.group_name)
    return torch.ops._c10d_functional.wait_tensor(mine).view(*tokens.shape, width)


def gathered_weights(model, dtype: torch.dtype):
    """(checkpoint name, full tensor in dtype, on the CPU) for every weight; every rank must iterate it."""
    sharding = model.sharding
    specs = {(s.group, s.index, s.name): s.checkpoint_name for s in model.specs()}
    for decl in model.checked.program.groups.values():
        layout = sharding.layouts[decl.name]
        parts = model.params[decl.key]
        for index, part in enumerate(parts if decl.repeat is not None else [parts]):
            with torch.no_grad():
                full = ops.wait(ops.all_gather(part.detach(), dtype, sharding.world, sharding.group_name)[0]).cpu()
            views = ops.group_views(full, list(layout.offsets), layout.shapes)
            del full
            while views:  # each view goes once yielded, and the group's buffer with the last
                yield (specs[(decl.key, index if decl.repeat is not None else None, layout.names[-len(views)])],
                       views.pop(0))
