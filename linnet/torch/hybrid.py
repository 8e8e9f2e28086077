"""The mean across replicas of the parts that the backward reduces last.

With hybrid sharding a part's gradient is reduce-scattered inside its machine
and then all-reduced across the machines, the two chained by the compiled
backward under the backward of the layers below (linnet/sharding/schedule.py).
The parts reduced last have nothing left below them: the first layer's, and
a group that each entry gathers first (the tied embedding). Their all-reduce
would end the backward with the device waiting on the slow link. So the
generated code marks them `late=True` (linnet.emit.source.late_parts says
which), their compiled reduction stays inside the machine, and their mean
across the replicas follows the backward:

- at once, by a hook on each late part (on the gradient as it reaches the
  part, before it is accumulated): a user's own loop gets the gradients it
  expects, through any number of backward passes. There the late parts'
  all-reduces are waited for one by one where the backward ends, with
  nothing under them;
- in `backward_and_step` (what linnet.torch.train calls), under the optimizer's
  step of every other part: their all-reduces are launched once the backward
  is done, the optimizer steps the other parts, and then, once the
  all-reduces are done, the late ones. That is the same update as one step
  for an optimizer whose update of a parameter reads that parameter's
  gradient and state alone (`PER_PARAMETER`), and whose step has no hooks
  (which would run twice); any other optimizer gets one step after the
  hooks' means, as in a user's loop."""

from __future__ import annotations

from contextlib import contextmanager

import torch
from torch.optim import optimizer as optimizer_module

from linnet.torch import ops

# Optimizers whose step updates each parameter from its own gradient and state alone, counting
# steps by parameter: stepping some parameters, then the rest, is the step of all of them.
PER_PARAMETER = frozenset({
    torch.optim.SGD, torch.optim.Adam, torch.optim.AdamW, torch.optim.Adagrad, torch.optim.Adadelta,
    torch.optim.Adamax, torch.optim.NAdam, torch.optim.RAdam, torch.optim.RMSprop,
})


class LateParts:
    """The late parts of one sharded model, and the mean of their gradients across the replicas."""

    def __init__(self, parts: list[torch.nn.Parameter], reduce_dtype: torch.dtype, replicate_group_name: str,
                 replicas: int):
        self.parts, self.reduce_dtype = parts, reduce_dtype
        self.replicate_group_name, self.replicas = replicate_group_name, replicas
        self._deferred = False
        for part in parts:
            part.register_hook(self._average_now)

    def launch_average(self, gradient: torch.Tensor) -> torch.Tensor:
        """The gradient's mean across the replicas (it is already its shard group's mean), reduced in
        `reduce_dtype`, launched: `ops.wait` it before reading it. The gradient may be dropped once this
        returns. The reduction is `ops.reduce_scatter`'s over a shard group of one rank (a copy into a
        buffer of its own, scaled by 1 / replicas), followed by its all-reduce across the replicas."""
        return ops.reduce_scatter(gradient.detach(), "avg", self.reduce_dtype, 1, "", self.replicate_group_name,
                                  self.replicas)

    def _average_now(self, gradient: torch.Tensor) -> torch.Tensor | None:
        if self._deferred:
            return None
        return ops.wait(self.launch_average(gradient))

    @contextmanager
    def deferred(self):
        """Backward passes inside leave the late parts' gradients as their shard group's mean: the caller
        averages them across the replicas."""
        self._deferred = True
        try:
            yield self
        finally:
            self._deferred = False


def has_step_hooks(optimizer: torch.optim.Optimizer) -> bool:
    """Whether a hook sees the optimizer's step() calls (its own, or every optimizer's): split into two
    calls, or made elsewhere (in the backward), its steps would reach them otherwise."""
    return any((optimizer._optimizer_step_pre_hooks, optimizer._optimizer_step_post_hooks,
                optimizer_module._global_optimizer_pre_hooks, optimizer_module._global_optimizer_post_hooks))


def _steps_each_parameter_alone(optimizer: torch.optim.Optimizer) -> bool:
    """Whether two step() calls over disjoint parameters are one step of all of them."""
    return type(optimizer) in PER_PARAMETER and not has_step_hooks(optimizer)


def backward_and_step(model, loss: torch.Tensor, optimizer: torch.optim.Optimizer) -> None:
    """loss.backward(), then optimizer.step(); where the model has late parts and the optimizer steps each
    parameter alone, the late parts are stepped second, once their means across the replicas, which run
    under the first step, are done. The caller zeroes the gradients after (the first step's are already
    dropped)."""
    late: LateParts | None = model.late_parts
    if late is None or not _steps_each_parameter_alone(optimizer):
        loss.backward()
        optimizer.step()
        return
    with late.deferred():
        loss.backward()
    # Every rank launches the same all-reduces in the same order: a part without a gradient (none, as
    # every rank runs the same code) would take zeros rather than skip a collective the others make.
    launched = [(part, late.launch_average(part.grad if part.grad is not None else torch.zeros_like(part)))
                for part in late.parts]
    for part, _ in launched:
        part.grad = None  # stepped second
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    for part, mean in launched:
        part.grad = ops.wait(mean)
    optimizer.step()
