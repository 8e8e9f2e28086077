"""This rank's parts of a sharded model as DTensor parameters, for code written for FSDP2's:
`torch.nn.utils.clip_grad_norm_` over them takes the norm over every rank, and any `torch.optim`
optimizer steps them in place.

The generated function computes with the model's own parts: plain leaf tensors, whose gradients
the backward of its gathers writes (reduce-scattered). Each DTensor parameter shares its part's
storage, so a step of the DTensor is a step of the part. Each part's gradient moves to its DTensor
as soon as the backward has accumulated it, so that `zero_grad()` (to None or to zeros) and
accumulation over several backwards behave as they do on any parameter."""

from __future__ import annotations

import torch
from torch.distributed.tensor import DeviceMesh, DTensor, Placement


class DTensorParts(torch.nn.Module):
    """parts: the card's group key -> this rank's flat part (or, for a repeated group, a list of them), as
    `TorchModel.params` holds them once sharded. Each part is a DTensor parameter of the same name
    (`layers.3`), sharded along its one dimension over `mesh` with `placements`: a part of n elements on
    each of the world's ranks is a tensor of world x n elements, its padding included (zeros, whose
    gradient is zero)."""

    def __init__(self, parts: dict, mesh: DeviceMesh, placements: tuple[Placement, ...], world: int):
        super().__init__()
        self.mesh, self.placements, self.world = mesh, placements, world
        for key, value in parts.items():
            if isinstance(value, list):
                self.register_module(key, torch.nn.ParameterList([self._wrap(part) for part in value]))
            else:
                self.register_parameter(key, self._wrap(value))

    def _wrap(self, part: torch.Tensor) -> torch.nn.Parameter:
        shared = DTensor.from_local(part.detach(), self.mesh, self.placements, run_check=False,
                                    shape=torch.Size([part.numel() * self.world]), stride=(1,))
        param = torch.nn.Parameter(shared, requires_grad=part.requires_grad)
        if part.requires_grad:
            part.register_post_accumulate_grad_hook(lambda part: self._move_gradient(part, param))
        return param

    def _move_gradient(self, part: torch.Tensor, param: torch.nn.Parameter) -> None:
        gradient, part.grad = part.grad, None
        if param.grad is None:
            param.grad = DTensor.from_local(gradient, self.mesh, self.placements, run_check=False,
                                            shape=param.shape, stride=param.stride())
        else:
            with torch.no_grad():
                param.grad.to_local().add_(gradient)
