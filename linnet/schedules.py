"""Learning-rate schedules, one formula for both frameworks: the learning rate of each step as a factor of
the peak, named as transformers' get_scheduler names them.

    factor = lr_factor("cosine", warmup=3, steps=30, floor=0.1)    # factor(step) for step 0, 1, ...
    linnet.torch.train.lr_schedule(optimizer, "cosine", 3, 30, floor=0.1)   # a LambdaLR
    linnet.jax.train.lr_schedule(1e-5, "cosine", 3, 30, floor=0.1)          # an optax schedule

- warm-up: over the first `warmup` steps the factor rises linearly to 1, as (step + 1) / (warmup + 1). It
  starts above 0: transformers' starts at 0, a first step that changes nothing.
- then "constant" stays at 1; "linear" falls in a line, and "cosine" along half a cosine, from 1 at the
  end of the warm-up to `floor` at step `steps` (transformers' cosine_with_min_lr, min_lr_rate=floor).

`step` may be a Python int (PyTorch's LambdaLR) or a traced array (optax): the formula takes its math
from `xp` (numpy, or jax.numpy)."""

from __future__ import annotations

import math
from collections.abc import Callable

import numpy as np

__all__ = ["SCHEDULES", "check_schedule", "lr_factor"]

SCHEDULES = ("constant", "linear", "cosine")


def check_schedule(name: str, warmup: int, steps: int, floor: float) -> None:
    """A ValueError naming what is wrong with these settings."""
    if name not in SCHEDULES:
        raise ValueError(f"schedule {name!r}: one of {', '.join(SCHEDULES)}")
    if not 0 <= warmup <= steps:
        raise ValueError(f"the schedule needs 0 <= warmup <= steps, got warmup={warmup}, steps={steps}")
    if not 0 <= floor <= 1:
        raise ValueError(f"the schedule's floor is a fraction of the peak learning rate, from 0 to 1, got {floor}")


def lr_factor(name: str, warmup: int, steps: int, floor: float = 0.0, xp=np) -> Callable:
    """step -> the learning rate's factor of the peak at that step (0-based: the first step is 0)."""
    check_schedule(name, warmup, steps, floor)

    def factor(step):
        rising = (step + 1) / (warmup + 1)
        progress = xp.clip((step - warmup) / max(1, steps - warmup), 0.0, 1.0)
        falling = {"constant": xp.ones_like(progress), "linear": 1.0 - progress,
                   "cosine": 0.5 * (1.0 + xp.cos(math.pi * progress))}[name]
        after = falling if name == "constant" else floor + (1.0 - floor) * falling
        return xp.where(step < warmup, rising, after)

    return factor
