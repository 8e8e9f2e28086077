"""The sum across replicas of the parts that the backward reduces last.

With hybrid sharding a part's gradient is reduce-scattered inside its machine
and then all-reduced across the machines, the two chained by the compiled
backward under the backward of the layers below (linnet/emit/schedule.py).
The parts reduced last have nothing left below them: the first layer's, and
a group that each entry gathers first (the tied embedding). Their all-reduce
would end the backward with the device waiting on the slow link. So the
generated code marks them `late=True`, their compiled reduction stays inside
the machine, and their sum across the replicas follows the backward:

- at once, by a hook on each such part (on the gradient as it reaches the
  part, before it is accumulated): a user's own loop gets the gradients it
  expects, through any number of backward passes;
- in `step_after_backward` (what linnet.train calls), under the optimizer's
  step of every other part: their all-reduces are launched once the backward
  is done, the optimizer steps the other parts, and then, once the
  all-reduces are done, these. That is the same update as one step for an
  optimizer whose update of a parameter reads that parameter's gradient and
  state alone (`PER_PARAMETER`); any other optimizer gets one step after the
  hooks' sums, as in a user's loop."""

from __future__ import annotations

from contextlib import contextmanager

import torch

from linnet.torch import ops

# Optimizers whose step updates each parameter from its own gradient and state alone, counting
# steps by parameter: stepping some parameters, then the rest, is the step of all of them.
PER_PARAMETER = frozenset({
    torch.optim.SGD, torch.optim.Adam, torch.optim.AdamW, torch.optim.Adagrad, torch.optim.Adadelta,
    torch.optim.Adamax, torch.optim.NAdam, torch.optim.RAdam, torch.optim.RMSprop,
})


class LateParts:
    """The parts reduced last of one sharded model, and the sum of their gradients across the replicas."""

    def __init__(self, parts: list[torch.nn.Parameter], reduce_dtype: torch.dtype, replicate_group_name: str,
                 replicas: int):
        self.parts, self.reduce_dtype = parts, reduce_dtype
        self.replicate_group_name, self.replicas = replicate_group_name, replicas
        self._deferred = False
        for part in parts:
            part.register_hook(self._sum_now)

    def launch(self, gradient: torch.Tensor) -> torch.Tensor:
        """The gradient's mean across the replicas (it is already the shard group's mean), in `reduce_dtype`,
        launched; `ops.wait` it before reading. `gradient` may be dropped once this returns."""
        return ops.reduce_scatter(gradient.detach(), "avg", self.reduce_dtype, 1, "", self.replicate_group_name,
                                  self.replicas)

    def _sum_now(self, gradient: torch.Tensor) -> torch.Tensor | None:
        if self._deferred:
            return None
        return ops.wait(self.launch(gradient))

    @contextmanager
    def deferred(self):
        """Backward passes inside leave these parts' gradients as the shard group's: the caller sums them."""
        self._deferred = True
        try:
            yield self
        finally:
            self._deferred = False


def step_after_backward(model, loss: torch.Tensor, optimizer: torch.optim.Optimizer) -> None:
    """loss.backward(), then optimizer.step(): with parts reduced last and an optimizer of `PER_PARAMETER`,
    in two parts, the parts reduced last stepped once their sums across the replicas are done."""
    late: LateParts | None = model.late_parts
    if late is None or type(optimizer) not in PER_PARAMETER:
        loss.backward()
        optimizer.step()
        return
    with late.deferred():
        loss.backward()
    launched = [(part, late.launch(part.grad)) for part in late.parts if part.grad is not None]
    for part, _ in launched:
        part.grad = None  # stepped second
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    for part, summed in launched:
        part.grad = ops.wait(summed)
    optimizer.step()
