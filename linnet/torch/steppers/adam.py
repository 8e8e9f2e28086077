"""Adam and AdamW, stepped by `linnet::adam_step_` (on CUDA Linnet's kernel, csrc/cuda/adam_step.cu; elsewhere
ATen's fused kernel), as `fused=True` steps: bit for bit on the CPU."""

from __future__ import annotations

from typing import NamedTuple

import torch

from linnet.torch import ops


class AdamSettings(NamedTuple):
    """A parameter group's settings, constants of the compiled graph (a change compiles again)."""

    beta1: float
    beta2: float
    weight_decay: float
    eps: float
    decoupled: bool  # AdamW's weight decay; Adam's (L2, in the gradient) otherwise


def step(param, state, gradient, lr, settings: AdamSettings, cast_dtype) -> None:
    exp_avg, exp_avg_sq, count = state
    ops.adam_step(param, exp_avg, exp_avg_sq, count, gradient, lr, *settings, copy_dtype=cast_dtype)


class AdamStepper:
    optimizers = (torch.optim.Adam, torch.optim.AdamW)
    writes_casts = True

    def unsupported(self, optimizer: torch.optim.Optimizer) -> str | None:
        for index, group in enumerate(optimizer.param_groups):
            for option in ("amsgrad", "maximize", "differentiable"):
                if group.get(option):
                    return f"parameter group {index} sets {option}=True"
        return None

    def settings(self, optimizer: torch.optim.Optimizer, group: dict) -> AdamSettings:
        decoupled = group.get("decoupled_weight_decay", type(optimizer) is torch.optim.AdamW)
        return AdamSettings(*map(float, group["betas"]), float(group["weight_decay"]), float(group["eps"]),
                            bool(decoupled))

    def state(self, optimizer: torch.optim.Optimizer, param: torch.Tensor) -> tuple[torch.Tensor, ...]:
        state = optimizer.state[param]
        if not state:  # as Adam's first step makes it (fused: the count on the device)
            state["step"] = torch.zeros((), dtype=torch.float32, device=param.device)
            state["exp_avg"] = torch.zeros_like(param, memory_format=torch.preserve_format)
            state["exp_avg_sq"] = torch.zeros_like(param, memory_format=torch.preserve_format)
        elif state["step"].device != param.device or state["step"].dtype != torch.float32:
            # loaded from a checkpoint by an optimizer that counts on the host (or in f64)
            state["step"] = state["step"].to(param.device, torch.float32)
        return state["exp_avg"], state["exp_avg_sq"], state["step"]

    step = staticmethod(step)


ADAM = AdamStepper()
