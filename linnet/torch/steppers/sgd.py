"""Plain SGD (no momentum), with its weight decay in the gradient, as torch.optim.SGD steps: the
second stepper, written in ATen's arithmetic alone. It keeps no state; momentum's buffer, made from the
first gradient, is not done here, and is refused by name."""

from __future__ import annotations

from typing import NamedTuple

import torch


class SgdSettings(NamedTuple):
    weight_decay: float


def step(param, state, gradient, lr, settings: SgdSettings, cast_dtype) -> None:
    gradient = gradient.to(param.dtype)
    if settings.weight_decay:
        gradient = gradient.add(param, alpha=settings.weight_decay)
    param.sub_(gradient * lr.to(param.device, param.dtype))


class SgdStepper:
    optimizers = (torch.optim.SGD,)
    writes_casts = False

    def unsupported(self, optimizer: torch.optim.Optimizer) -> str | None:
        for index, group in enumerate(optimizer.param_groups):
            if group.get("momentum"):
                return (f"parameter group {index} sets momentum={group['momentum']} (only plain SGD steps in the "
                        f"backward)")
            for option in ("maximize", "differentiable"):
                if group.get(option):
                    return f"parameter group {index} sets {option}=True"
        return None

    def settings(self, optimizer: torch.optim.Optimizer, group: dict) -> SgdSettings:
        return SgdSettings(float(group["weight_decay"]))

    def state(self, optimizer: torch.optim.Optimizer, param: torch.Tensor) -> tuple[torch.Tensor, ...]:
        return ()

    step = staticmethod(step)


SGD = SgdStepper()
