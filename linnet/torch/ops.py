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

from collections.abc import Sequence
from typing import NamedTuple

import torch

from linnet import _C  # noqa: F401  (importing the library registers the ops)

_ops = torch.ops.linnet


class FlatLayout(NamedTuple):
    offsets: list[int]  # where each tensor starts in the flat buffer, in elements
    total: int  # padded length of the buffer: world * part_size
    part_size: int  # one rank's part, a multiple of the alignment


def flat_layout(numels: Sequence[int], align: int, world: int) -> FlatLayout:
    """Lays out tensors of `numels` elements one after another, each starting
    at a multiple of `align` elements, padded to split into `world` equal parts."""
    *offsets, total, part_size = _ops.flat_layout(list(numels), align, world)
    return FlatLayout(offsets, total, part_size)


def flatten(tensors: Sequence[torch.Tensor], offsets: Sequence[int], total: int) -> torch.Tensor:
    """A new 1-D buffer of `total` elements with each tensor copied at its offset, zeros elsewhere."""
    return _ops.flatten(list(tensors), list(offsets), total)


def shard(flat: torch.Tensor, rank: int, world: int) -> torch.Tensor:
    """A copy of rank's part of `flat`: ceil(numel / world) elements, zero past the end."""
    return _ops.shard(flat, rank, world)


def group_views(flat: torch.Tensor, offsets: Sequence[int], shapes: Sequence[Sequence[int]]) -> list[torch.Tensor]:
    """Views of `flat` as tensors of `shapes` at `offsets` (differentiable)."""
    return _ops.group_views(flat, list(offsets), [d for shape in shapes for d in shape], [len(s) for s in shapes])


def all_gather(part: torch.Tensor, dtype: torch.dtype, group_size: int, group_name: str) -> torch.Tensor:
    """Every rank's part, cast to `dtype`, concatenated in rank order; call `wait` before reading it.
    Its gradient is the reduce-scattered (summed, f32) gradient of the result."""
    return _ops.all_gather(part, dtype, group_size, group_name)


def reduce_scatter(full: torch.Tensor, reduce_op: str, group_size: int, group_name: str) -> torch.Tensor:
    """This rank's part of `full` summed ("sum") or averaged ("avg") over ranks, in f32;
    call `wait` before reading it."""
    return _ops.reduce_scatter(full, reduce_op, group_size, group_name)


def wait(tensor: torch.Tensor) -> torch.Tensor:
    """`tensor` once the collective that produces it has finished."""
    return _ops.wait(tensor)


def collective_overloads() -> frozenset:
    """The op overloads that communicate or wait, as a dispatch mode sees them
    (below autograd): a checkpoint policy recomputes these rather than save them."""
    return frozenset(
        {
            _ops.all_gather.default,
            _ops.reduce_scatter.default,
            _ops.wait.default,
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
def _(part, dtype, group_size, group_name):
    return part.new_empty(part.numel() * group_size, dtype=dtype)


@torch.library.register_fake("linnet::reduce_scatter")
def _(full, reduce_op, group_size, group_name):
    return full.new_empty(full.numel() // group_size, dtype=torch.float32)


@torch.library.register_fake("linnet::wait")
def _(tensor):
    return torch.empty_like(tensor)
