"""The recompute policies a sharded layer's region runs under (fully_shard's `recompute`), as
torch.utils.checkpoint's selective policies: what a layer keeps from its forward for its backward, and
what the backward computes again (docs/design/recompute.md).

    "gather"   keeps the activations; the gathers (on one rank, casts) and their views are made again;
    "matmuls"  keeps the matrix products and attention; the pointwise work between them and the gathers
               are made again;
    "full"     keeps the layer's input alone.

With reshard_after_forward=False every policy keeps the gathers too."""

from __future__ import annotations

import logging
from functools import partial

import torch
from torch.utils.checkpoint import CheckpointPolicy, checkpoint, create_selective_checkpoint_contexts

from linnet.torch import ops

__all__ = ["POLICIES", "checkpointed", "recompute_all"]

POLICIES = ("gather", "matmuls", "full")


class _ContextFnWarning(logging.Filter):
    """torch.compile warns, once a process, that a checkpoint given a context_fn must hold no
    in-place ops. The generated code is functional, so it would only tell a user of Linnet
    something about Linnet's own code that is true: it is dropped, and only it."""

    def filter(self, record: logging.LogRecord) -> bool:
        return "context_fn is passed to torch.utils.checkpoint" not in record.getMessage()


logging.getLogger("torch._higher_order_ops.wrap").addFilter(_ContextFnWarning())


def _gather_policy(ctx, func, *args, **kwargs):
    """Recompute the gather and the views of what it returns; keep everything else. On one rank a gather
    is a cast: made again in the backward rather than kept, its bf16 bytes (8B: about 13 GiB) cost more
    than a cast a layer (docs/design/recompute.md)."""
    if func in ops.collective_overloads() or getattr(func, "is_view", False):  # higher-order ops have no is_view
        return CheckpointPolicy.MUST_RECOMPUTE
    return CheckpointPolicy.PREFER_SAVE


# What "matmuls" keeps: the products and attention, whose recomputation would cost as much again.
_PRODUCTS = frozenset({
    torch.ops.aten.mm.default, torch.ops.aten.addmm.default, torch.ops.aten.bmm.default,
    torch.ops.aten._scaled_dot_product_cudnn_attention.default,
    torch.ops.aten._scaled_dot_product_flash_attention.default,
    torch.ops.aten._scaled_dot_product_efficient_attention.default,
    torch.ops.aten._scaled_dot_product_flash_attention_for_cpu.default,
    torch.ops.higher_order.flex_attention,
})


def _products_policy(ctx, func, *args, **kwargs):
    """Keep the products and attention; recompute the rest, the gathers among it."""
    if func in _PRODUCTS:
        return CheckpointPolicy.MUST_SAVE
    return CheckpointPolicy.PREFER_RECOMPUTE


def recompute_all(ctx, func, *args, **kwargs):
    return CheckpointPolicy.MUST_RECOMPUTE


def _keeping_gathers(policy):
    """`policy`, but the gathers (on one rank, casts) kept: reshard_after_forward=False."""

    def keeping(ctx, func, *args, **kwargs):
        if func in ops.collective_overloads():
            return CheckpointPolicy.MUST_SAVE
        return policy(ctx, func, *args, **kwargs)

    return keeping


def checkpointed(recompute: str, reshard_after_forward: bool, function, *args):
    """function(*args) in a region checkpointed under the policy `recompute` (one of POLICIES)."""
    if recompute == "full" and reshard_after_forward:
        return checkpoint(function, *args, use_reentrant=False)
    policy = {"full": recompute_all, "matmuls": _products_policy, "gather": _gather_policy}[recompute]
    if not reshard_after_forward:
        policy = _keeping_gathers(policy)
    return checkpoint(function, *args, use_reentrant=False,
                      context_fn=partial(create_selective_checkpoint_contexts, policy))
