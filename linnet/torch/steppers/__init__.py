"""The optimizers that can step a part in the backward (linnet/torch/step_in_backward.py), one file each.

A stepper says what the step of one optimizer reads and does, for one part at a time:

    class Stepper:
        optimizers: tuple[type, ...]     # the torch.optim classes it steps as
        writes_casts: bool               # whether `step` honours cast_dtype (a part's cast for the next forward)
        def unsupported(self, optimizer) -> str | None          # why not (an option it does not compute)
        def settings(self, optimizer, group) -> tuple           # the group's constants (hashable: graph constants)
        def state(self, optimizer, param) -> tuple[Tensor, ...]  # its tensors in optimizer.state[param], made
                                                                # as the optimizer's first step makes them
        step(param, state, gradient, lr, settings, cast_dtype) -> None   # a module-level function: in place

`step` runs inside the backward, compiled with it: `lr` is a 0-d f64 tensor on the host (the group's rate
at this step), `gradient` may be narrower than `param` (on one rank it arrives in the compute dtype). The
result must be the optimizer's own step, as its `fused=True` or for-each form computes it: the tests
compare the two (tests/test_step_in_backward.py). A new optimizer is a new file here and its line in
STEPPERS."""

from __future__ import annotations

import torch

from linnet.torch.steppers.adam import ADAM
from linnet.torch.steppers.sgd import SGD

__all__ = ["STEPPERS", "stepper_for"]

STEPPERS = {optimizer: stepper for stepper in (ADAM, SGD) for optimizer in stepper.optimizers}


def stepper_for(optimizer: torch.optim.Optimizer):
    """The stepper of this optimizer's class (exactly that class: a subclass may step otherwise), or None."""
    return STEPPERS.get(type(optimizer))
