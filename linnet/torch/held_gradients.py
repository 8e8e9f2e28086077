"""Gradient accumulation with one reduce-scatter a step rather than one a micro-batch: FSDP2's
`set_requires_gradient_sync(False)`, and `train(..., hold_gradients=True)`.

While a sharded model holds its gradients, each gather's backward adds its group's whole gradient
into a buffer of the whole group's size on this rank, in the reduce dtype (FSDP2 accumulates its
unsharded gradients so), and reduce-scatters nothing. When the model stops holding, every held
buffer's reduce-scatter is launched at once (averaged as a gather's backward averages, across the
replicas too) and the buffers are freed; the next backward adds each result to its part's gradient
as that gradient arrives, by which time the reduce-scatter has long run beside the forward. So N
micro-batches, the last one not held, reduce-scatter twice instead of N times. The price is the
buffers: 4 bytes a weight on every rank while held, the whole model's gradient in f32.

A held backward runs its own compiled function: the entry with each part `Held` beside its buffer
(linnet/torch/collectives.py gathers a Held part from its detached part, and sends the gathered
weights' gradient to the buffer instead of the part). An untied embedding's lookup sends each
micro-batch's gradient to its part as always: its backward gathers the rows' gradients, never the
table's. On one rank nothing is reduce-scattered, so nothing is held."""

from __future__ import annotations

from functools import partial
from typing import NamedTuple

import torch

from linnet.torch import ops
from linnet.torch.param_trees import leaves, map_leaves

__all__ = ["Held", "HeldGradients", "into_whole"]


class Held(NamedTuple):
    """A part whose gathered weights' gradient goes to `whole` this backward, not to the part."""

    part: torch.Tensor
    whole: torch.Tensor  # a leaf the size of the part's gathered buffer, in the reduce dtype: its .grad holds


class _IntoWhole(torch.autograd.Function):
    """The gathered buffer, passed through as a view; its gradient goes to `whole` (cast to whole's dtype)."""

    @staticmethod
    def forward(ctx, gathered, whole):
        ctx.dtype = whole.dtype
        return gathered.view_as(gathered)

    @staticmethod
    def backward(ctx, gradient):
        return None, gradient.to(ctx.dtype)


def into_whole(gathered: torch.Tensor, held: Held) -> torch.Tensor:
    """`gathered` (waited for, gathered from the detached part), its gradient held in `held.whole`."""
    return _IntoWhole.apply(gathered, held.whole)


def with_held(params, wholes):
    """`params` (the model's tree of parts) with each part that has a buffer in `wholes` made Held."""
    if isinstance(params, dict):
        return {key: with_held(value, wholes.get(key)) for key, value in params.items()}
    if isinstance(params, list):
        return [with_held(value, whole) for value, whole in zip(params, wholes)]
    return params if wholes is None else Held(params, wholes)


class HeldGradients:
    """The held gradients of one sharded model (TorchModel.hold_gradients)."""

    def __init__(self, model):
        self.model = model
        self.holding = False
        self._wholes = None  # as model.params: a leaf for each trainable part, made at the first hold
        self._hooks: list = []  # (hook handle, its reduction while not yet added) of each released reduction

    def hold(self) -> None:
        """From the next backward on, each group's whole gradient is added into its buffer."""
        if self.model.stepping is not None:
            raise RuntimeError("gradients cannot be held while an optimizer steps in the backward: each part "
                               "would step without the held gradient")
        self.holding = True

    def release(self) -> None:
        """Launches the held buffers' reduce-scatters and frees the buffers; the next backward adds each
        result to its part's gradient. Nothing happens where nothing is held."""
        if not self.holding:
            return
        self.holding = False
        for handle, pending in self._hooks:  # a reduction no backward has added yet is added by the next one
            if not pending:
                handle.remove()
        self._hooks = [(handle, pending) for handle, pending in self._hooks if pending]
        sharding = self.model.sharding
        across = (sharding.replicate_group_name or "", sharding.replicas)
        for part, whole in zip(leaves(self.model.params), leaves(self._wholes)):
            if whole is None or whole.grad is None:
                continue
            with torch.no_grad():
                reduced = ops.reduce_scatter(whole.grad, "avg", sharding.reduce_dtype, sharding.world,
                                             sharding.group_name, *across)
            whole.grad = None
            pending = [reduced]
            self._hooks.append((part.register_hook(partial(_add_once, pending)), pending))

    def wholes(self):
        """The buffers' leaves, as the model's tree of parts (None where a part takes no gradient)."""
        if self._wholes is None:
            self._wholes = map_leaves(self.model.params, self._whole_of)
        return self._wholes

    def _whole_of(self, part: torch.Tensor):
        if not part.requires_grad:
            return None
        sharding = self.model.sharding
        # A zero that takes the storage of one element: only its gradient is ever the buffer's size.
        zero = torch.zeros((), dtype=sharding.reduce_dtype, device=part.device)
        return zero.expand(part.numel() * sharding.world).requires_grad_()


def _add_once(reduced: list, gradient: torch.Tensor) -> torch.Tensor:
    """A part's gradient, with the held reduction added the first time it arrives."""
    return gradient + ops.wait(reduced.pop()) if reduced else gradient
