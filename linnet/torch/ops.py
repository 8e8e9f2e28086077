"""Linnet's custom ops, `torch.ops.linnet.*` (registered by linnet._C, built
from csrc/): typed wrappers, and the fake kernels that FakeTensor and
torch.compile use to trace them.

The collectives follow PyTorch's functional collectives: `all_gather` and
`reduce_scatter` launch and return at once; `wait` returns the tensor once its
collective is done. Between the two the result must not be read. They name
their process group by `group_name` (`ProcessGroup.group_name`); with
`group_size` 1 they only cast, and look no group up.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence

import torch

from linnet import _C  # importing the library registers the ops; it also binds the flat layout

_ops = torch.ops.linnet


# The layout is C++ (csrc/flat_layout.h) bound by linnet._C, not an op: it is
# setup-time arithmetic on no tensors. Read-only: offsets (a tuple of where each
# tensor starts, in elements), total (the padded buffer: world * part_size) and
# part_size (one rank's part, a multiple of the alignment).
FlatLayout = _C.FlatLayout


# A pure function of its arguments, so under torch.compile it runs while
# tracing and its layout is a constant (which needs numels that are not
# symbolic sizes).
@torch.compiler.assume_constant_result
def flat_layout(numels: Sequence[int], align: int, world: int) -> FlatLayout:
    """Lays out tensors of `numels` elements one after another, each starting
    at a multiple of `align` elements, padded to split into `world` equal parts.
    Raises ValueError for a negative numel, align or world below 1, or a layout
    that overflows int64."""
    return _C.flat_layout(list(numels), align, world)


def flatten(tensors: Sequence[torch.Tensor], offsets: Sequence[int], total: int) -> torch.Tensor:
    """A new 1-D buffer of `total` elements with each tensor copied at its offset, zeros elsewhere."""
    return _ops.flatten(list(tensors), list(offsets), total)


def shard(flat: torch.Tensor, rank: int, world: int) -> torch.Tensor:
    """A copy of rank's part of `flat`: ceil(numel / world) elements, zero past the end."""
    return _ops.shard(flat, rank, world)


def group_views(flat: torch.Tensor, offsets: Sequence[int], shapes: Sequence[Sequence[int]]) -> list[torch.Tensor]:
    """Views of `flat` as tensors of `shapes` at `offsets` (differentiable)."""
    return _ops.group_views(flat, list(offsets), [d for shape in shapes for d in shape], [len(s) for s in shapes])


def all_gather(part: torch.Tensor, dtype: torch.dtype, group_size: int, group_name: str, *, reduce_op: str = "sum",
               reduce_dtype: torch.dtype | None = None, replicate_group_name: str = "",
               replicas: int = 1) -> tuple[torch.Tensor, torch.Tensor]:
    """Launches the gather of every rank's part, cast to `dtype` and concatenated in rank order;
    returns (gathered, token). Call `wait(gathered)` before reading it. `token` is an empty tensor
    from the same launch: work that depends on it runs after the launch (see `after`), and
    keeping it keeps nothing else alive. The gradient of `gathered` is reduce-scattered into the
    part: summed ("sum") or averaged ("avg") over ranks, in `reduce_dtype` (f32 by default), and
    over the `replicas` ranks of `replicate_group_name` that hold the same part, as `reduce_scatter`'s."""
    return _ops.all_gather(part, dtype, group_size, group_name, reduce_op, reduce_dtype, replicate_group_name, replicas)


def reduce_scatter(full: torch.Tensor, reduce_op: str, reduce_dtype: torch.dtype, group_size: int,
                   group_name: str, replicate_group_name: str = "", replicas: int = 1) -> torch.Tensor:
    """Launches the reduce-scatter of `full` in `reduce_dtype` (bf16 halves the bytes): this rank's
    part summed ("sum") or averaged ("avg") over ranks, returned in f32; call `wait` before reading it.
    With replicas > 1 (hybrid sharding: the ranks of `replicate_group_name` hold the same part), the
    part is then summed across them too, launched as soon as the reduce-scatter ends (on a side
    stream that waits for it: the caller's stream does not), and "avg" averages over every rank of
    both groups. Not differentiable then."""
    return _ops.reduce_scatter(full, reduce_op, reduce_dtype, group_size, group_name, replicate_group_name, replicas)


def cast_into_sink(part: torch.Tensor, sink: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """One rank's gather: `part` cast to `dtype`, whose gradient goes, as it is, to `sink` (a tensor of the cast's
    shape and dtype, such as an expanded zero, that the forward does not read) and not to the part."""
    return _ops.cast_into_sink(part, sink, dtype)


def wait_gathered(gathered: torch.Tensor, part: torch.Tensor, reduce_op: str, reduce_dtype: torch.dtype,
                  group_size: int, group_name: str, replicate_group_name: str = "", replicas: int = 1) -> torch.Tensor:
    """`gathered` (launched by `all_gather` from `part` detached) once its gather is done. The
    gradient of the result is reduce-scattered into `part` where the backward reaches this wait
    (and summed across the replicas, as `reduce_scatter` does), and handed on UN-WAITED: the
    caller must `wait` for the part's gradient before it is read."""
    return _ops.wait_gathered(gathered, part, reduce_op, reduce_dtype, group_size, group_name, replicate_group_name,
                              replicas)


def after(x: torch.Tensor, forward_deps: Sequence[torch.Tensor],
          backward_deps: Sequence[torch.Tensor] = ()) -> torch.Tensor:
    """A copy of `x` that exists only once every tensor of `forward_deps` does; its gradient is a
    copy made only once every tensor of `backward_deps` exists (they are kept, or recomputed, for
    the backward). Generated code orders its collectives with it."""
    return _ops.after(x, list(forward_deps), list(backward_deps))


def wait(tensor: torch.Tensor) -> torch.Tensor:
    """`tensor` once the collective that produces it has finished."""
    return _ops.wait(tensor)


def adam_step(param: torch.Tensor, exp_avg: torch.Tensor, exp_avg_sq: torch.Tensor, step: torch.Tensor,
              gradient: torch.Tensor, lr: torch.Tensor, beta1: float, beta2: float, weight_decay: float, eps: float,
              decoupled: bool = True, copy_dtype: torch.dtype | None = None) -> None:
    """Adam's step of `param` from `gradient`, in place, with its moments and its count (`step`, a 0-d f32
    tensor on param's device, counted up first) and the learning rate `lr` (a 0-d tensor on the host, f64 to
    step as a float rate does, or on param's device): AdamW's weight decay where `decoupled`, Adam's
    otherwise; as torch.optim.Adam(W)(fused=True) steps. copy_dtype: the stepped `param` is also cast to it
    (on CUDA, by the same kernel) and kept until the next `cast_into_sink` of `param` takes it in place of
    casting, unless `param` changes first (`stepped_casts_kept`); a step made below autograd (under
    inference_mode), which counts no new version of `param`, keeps none that a cast would take."""
    _ops.adam_step_(param, exp_avg, exp_avg_sq, step, gradient, lr, beta1, beta2, weight_decay, eps, decoupled,
                    copy_dtype)


def stepped_casts_kept() -> int:
    """How many casts made by `adam_step(..., copy_dtype=...)` wait for the next cast of their part."""
    return _C.stepped_casts_kept()


def drop_stepped_casts(parts: Sequence[torch.Tensor]) -> None:
    """Drops the casts that `adam_step` kept for `parts`: the next cast of each casts it."""
    _C.drop_stepped_casts(list(parts))


def linear_cross_entropy(hidden: torch.Tensor, head: torch.Tensor, targets: torch.Tensor, weights: torch.Tensor,
                         chunk_rows: int = 1024) -> torch.Tensor:
    """The mean over `weights` of the cross-entropies of the logits `hidden @ head.T` (hidden (rows, width), head
    (vocabulary, width), one integer target and one weight a row; a target of -100 is ignored, as F.cross_entropy
    ignores it), as a 0-d f32 tensor. The logits are made `chunk_rows` rows at a time and never held whole; where a
    gradient is wanted, the gradients of hidden and head are made in the same pass and kept for the backward in
    place of the logits (csrc/linear_cross_entropy.cpp)."""
    return _ops.linear_cross_entropy(hidden, head, targets, weights, chunk_rows)


@functools.cache  # asked by a checkpoint policy at every op it sees
def collective_overloads() -> frozenset:
    """The op overloads that communicate or wait, and one rank's gather (its cast), as a dispatch mode sees
    them (below autograd): a checkpoint policy recomputes these rather than save them, or keeps them
    (fully_shard's reshard_after_forward=False)."""
    return frozenset(
        {
            _ops.all_gather.default,
            _ops.cast_into_sink.default,
            _ops.reduce_scatter.default,
            _ops.wait.default,
            _ops.wait_gathered.default,
            torch.ops._c10d_functional.wait_tensor.default,
        }
    )


@torch.library.register_fake("linnet::flatten")
def _(tensors, offsets, total):
    return tensors[0].new_empty(total)


@torch.library.register_fake("linnet::shard")
def _(flat, rank, world):
    return flat.new_empty((flat.numel() + world - 1) // world)


@torch.library.register_fake("linnet::all_gather")
def _(part, dtype, group_size, group_name, reduce_op="sum", reduce_dtype=None, replicate_group_name="", replicas=1):
    return part.new_empty(part.numel() * group_size, dtype=dtype), part.new_empty(0)


@torch.library.register_fake("linnet::cast_into_sink")
def _(part, sink, dtype):
    return part.new_empty(part.shape, dtype=dtype)


@torch.library.register_fake("linnet::reduce_scatter")
def _(full, reduce_op, reduce_dtype, group_size, group_name, replicate_group_name="", replicas=1):
    return full.new_empty(full.numel() // group_size, dtype=torch.float32)


@torch.library.register_fake("linnet::wait_gathered")
def _(gathered, part, reduce_op, reduce_dtype, group_size, group_name, replicate_group_name="", replicas=1):
    return torch.empty_like(gathered)


@torch.library.register_fake("linnet::after")
def _(x, forward_deps, backward_deps):
    return torch.empty_like(x)


@torch.library.register_fake("linnet::wait")
def _(tensor):
    return torch.empty_like(tensor)


@torch.library.register_fake("linnet::adam_step_")
def _(param, exp_avg, exp_avg_sq, step, gradient, lr, beta1, beta2, weight_decay, eps, decoupled=True,
      copy_dtype=None):
    return None


@torch.library.register_fake("linnet::linear_cross_entropy")
def _(hidden, head, targets, weights, chunk_rows):
    return hidden.new_empty((), dtype=torch.float32)


@torch.library.register_fake("linnet::linear_cross_entropy_forward")
def _(hidden, head, targets, weights, chunk_rows, gradients):
    loss = hidden.new_empty((), dtype=torch.float32)
    if not gradients:
        return loss, hidden.new_empty(0), head.new_empty(0)
    return loss, torch.empty_like(hidden, memory_format=torch.contiguous_format), \
        torch.empty_like(head, memory_format=torch.contiguous_format)


@torch.library.register_fake("linnet::softmax_cross_entropy_")
def _(logits, targets, scale):
    return logits.new_empty(logits.shape[0], dtype=torch.float32)
