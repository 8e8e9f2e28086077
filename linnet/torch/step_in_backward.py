"""Adam's step taken in the backward, a part at a time.

An optimizer steps after the backward, so every gradient is held at once: for
a model sharded in f32, as many bytes as its parts (8B on one GPU: 30 GiB of
the 120 that weights, gradients and moments take). Here the entry receives
each part the optimizer trains as `Stepped`, and the sharded code's bindings
`take` it where they first use it (linnet/torch/collectives.py): through an
identity whose backward runs once the part's whole gradient exists (after its
reduction, and after every use of a tied weight). The part enters detached,
the identity's node made through a leaf that requires grad (`anchor`):
compiled, the backward changes that input in place, which AOT autograd of
torch 2.11 refuses for an input that requires grad (2.13 allows it). There it takes Adam's step
(`linnet::adam_step_`: on CUDA Linnet's kernel, csrc/cuda/adam_step.cu, with ATen's
arithmetic; elsewhere ATen's fused kernel, as `fused=True` steps) and the
gradient is dropped. The identity is made where the part is first used, not
where the entry starts: autograd runs the nodes made last first, so a node
made first would run once the whole backward was done. Compiled, the step is
in the backward graph, and a gradient lives from its reduction to its step.
On one rank a layer's gradient has no reduction: it reaches the step in the
compute dtype, as the layer's products made it (shard.py's `_take`); where the
layers keep their casts (reshard_after_forward=False), the step also writes the
part's cast, which the next forward takes rather than cast the part again
(shard.py's `_casts_from_the_step`, csrc/stepped_casts.cpp).

    with stepping_in_backward(model, optimizer):
        loss = model.loss_packed(...)
        loss.backward()    # steps every parameter it reaches; their .grad stays None
        optimizer.step()   # the others: none, or the parts averaged across replicas last

One entry call a backward: each call makes its own steps, so a second
forward before the backward would step a part twice (autograd refuses it,
as the first step changed what the second reads), and an error raised in
the middle of a backward leaves the parts it reached stepped (`train`
resumes from its checkpoint). With replicas (hybrid sharding) a step is
made where the waits across replicas end the backward, so there every
gradient is still held until then.

The update is the optimizer's, as `fused=True` computes it (bit for bit;
within rounding, 3e-8 after three steps, of the for-each and for-loop
forms; on CUDA, Adam's L2 form within an ulp or so, tests/test_gpu_adam_step.py):
its moments and step counts in `optimizer.state` (what a checkpoint
saves), its learning rate read from its parameter groups at each forward (a
schedule's changes, in a tensor that the compiled graph reads). `train`
steps this way where `supported` finds nothing against it: Adam or AdamW
without amsgrad, maximize, differentiable, step hooks or gradient hooks on a
part, which would each see a step or a gradient that is not there. The parts whose mean
across replicas follows the backward (linnet/torch/hybrid.py) keep their
gradient for the optimizer's step."""

from __future__ import annotations

from contextlib import contextmanager
from typing import NamedTuple

import torch

from linnet.torch import ops
from linnet.torch.hybrid import has_step_hooks


class AdamSettings(NamedTuple):
    """A parameter group's settings, constants of the compiled graph (the stepping entries compile with
    dynamic=False: a change compiles again)."""

    beta1: float
    beta2: float
    weight_decay: float
    eps: float
    decoupled: bool  # AdamW's weight decay; Adam's (L2, in the gradient) otherwise


class PartState(NamedTuple):
    """What a parameter's step reads and changes: the optimizer's state, and its group's lr and settings."""

    exp_avg: torch.Tensor
    exp_avg_sq: torch.Tensor
    step: torch.Tensor  # 0-d f32 on the parameter's device, as fused Adam keeps it
    lr: torch.Tensor  # (1,) f64 on the host: the group's rate at this step, read as a double as a float rate is
    settings: AdamSettings
    anchor: torch.Tensor  # a 0-d leaf that requires grad: the part enters detached (InBackward.parts)


def supported(model, optimizer: torch.optim.Optimizer) -> str | None:
    """Why `optimizer` cannot step `model`'s parts in the backward, or None where it can."""
    if getattr(model, "sharding", None) is None:
        return "the model is not sharded (linnet.torch.fully_shard), so its code has no place to step a part"
    late = {id(p) for p in _late_parts(model)}
    for group in optimizer.param_groups:
        for param in group["params"]:
            if id(param) not in late and (param._backward_hooks or getattr(param, "_post_accumulate_grad_hooks", None)):
                return "a trained part has a gradient hook, which would never see the gradient the step takes"
    if type(optimizer) not in (torch.optim.Adam, torch.optim.AdamW):
        return f"{type(optimizer).__name__} is not torch.optim.Adam or AdamW"
    if has_step_hooks(optimizer):
        return "the optimizer has step hooks, which would not see the steps taken in the backward"
    for index, group in enumerate(optimizer.param_groups):
        for option in ("amsgrad", "maximize", "differentiable"):
            if group.get(option):
                return f"parameter group {index} sets {option}=True"
    return None


class _StepInBackward(torch.autograd.Function):
    """`through` (the parameter, detached; or, with `param` given, what the parameter's gradient arrives
    by), passed through as a tensor that requires grad (through `anchor`); its gradient, once whole, steps
    the parameter and goes no further."""

    @staticmethod
    def forward(ctx, through, anchor, param, exp_avg, exp_avg_sq, step, lr, settings, cast_dtype):
        ctx.save_for_backward(through if param is None else param, exp_avg, exp_avg_sq, step, lr)
        ctx.settings, ctx.cast_dtype = settings, cast_dtype
        return through.view_as(through)

    @staticmethod
    def backward(ctx, gradient):
        param, exp_avg, exp_avg_sq, step, lr = ctx.saved_tensors
        ops.adam_step(param, exp_avg, exp_avg_sq, step, gradient, lr.view(()), *ctx.settings,
                      copy_dtype=ctx.cast_dtype)
        return None, None, None, None, None, None, None, None, None


class Stepped(NamedTuple):
    """A part that steps in the backward, as the entry receives it: `taken` where the code first uses it."""

    part: torch.Tensor
    state: PartState


def taken(part, through: torch.Tensor | None = None, cast_dtype: torch.dtype | None = None):
    """The part as the code uses it: a Stepped one through the step in the backward. Made where the part is
    first used (the sharded code's bindings call this: linnet/torch/collectives.py), so that autograd, which runs
    the nodes made last first, reaches the step as soon as the gradient is complete, not at the end.
    through: what the part's gradient arrives by instead (on one rank, the sink its cast's gradient goes to:
    shard.py's `_take`), which steps the part as it is (Adam's step widens a narrower one as it reads it).
    cast_dtype: the step also casts the stepped part to it, for the next forward's cast to take (`ops.adam_step`)."""
    if not isinstance(part, Stepped):
        return part
    state = part.state
    param = None if through is None else part.part  # one tensor is never passed twice (dynamo refuses it)
    return _StepInBackward.apply(part.part if through is None else through, state.anchor, param, state.exp_avg,
                                 state.exp_avg_sq, state.step, state.lr, state.settings, cast_dtype)


def with_steps(params, states):
    """`params` (the model's tree of parts) with each part that has a PartState in `states` (a tree of the same
    shape, None where a part is not stepped) made Stepped."""
    if isinstance(states, PartState):
        return Stepped(params, states)
    if states is None:
        return params
    if isinstance(params, dict):
        return {key: with_steps(value, states.get(key)) for key, value in params.items()}
    return [with_steps(value, state) for value, state in zip(params, states)]


class InBackward:
    """The step in the backward of one model's parameters by one optimizer (`stepping_in_backward`)."""

    def __init__(self, model, optimizer: torch.optim.Optimizer):
        reason = supported(model, optimizer)
        if reason is not None:
            raise ValueError(f"this optimizer cannot step in the backward: {reason}")
        self.optimizer, self.device = optimizer, model.device
        late = {id(p) for p in _late_parts(model)}  # they keep their gradient
        self.group_of = {id(p): index for index, group in enumerate(optimizer.param_groups) for p in group["params"]
                         if p.requires_grad and id(p) not in late}
        # One element, not 0-d: torch.compile reads a 0-d f64 host tensor as a float, then throws away its
        # first compile of the step and starts again ("Restarting analysis", the 8B's first step 40 s longer).
        self.lrs = [torch.zeros(1, dtype=torch.float64) for _ in optimizer.param_groups]
        self.anchor = torch.zeros((), device=self.device, requires_grad=True)  # never given a gradient
        seen: set[int] = set()
        for tensor in _leaves(model.params):
            if id(tensor) in seen:
                raise ValueError("a tensor appears twice in the model's weights: its gradient would be stepped twice")
            seen.add(id(tensor))
            if id(tensor) in self.group_of and tensor.device != self.device:
                raise ValueError(f"a trained tensor is on {tensor.device}, the model on {self.device}")

    def parts(self, params):
        """`params` as the entry receives them: each part stepped here detached, so that the graph's input
        that the backward changes requires no grad (AOT autograd of torch 2.11 refuses a backward's
        mutation of one that does; 2.13 allows it); its step's node takes `anchor` for that."""
        if isinstance(params, torch.Tensor):
            return params.detach() if id(params) in self.group_of else params
        if isinstance(params, dict):
            return {key: self.parts(value) for key, value in params.items()}
        return [self.parts(value) for value in params]

    def states(self, params):
        """The tree of PartStates for `params` at this step: the learning rates as the groups hold them now,
        and the state of a parameter stepped for the first time made as Adam makes it."""
        settings = []
        for lr, group in zip(self.lrs, self.optimizer.param_groups):
            if torch.is_tensor(group["lr"]):
                lr.copy_(group["lr"])
            else:
                lr.fill_(group["lr"])
            decoupled = group.get("decoupled_weight_decay", type(self.optimizer) is torch.optim.AdamW)
            settings.append(AdamSettings(*map(float, group["betas"]), float(group["weight_decay"]),
                                         float(group["eps"]), bool(decoupled)))
        return self._tree(params, settings)

    def _tree(self, params, settings):
        if isinstance(params, torch.Tensor):
            group = self.group_of.get(id(params))
            if group is None:
                return None
            state = self._state(params)
            return PartState(state["exp_avg"], state["exp_avg_sq"], state["step"], self.lrs[group], settings[group],
                             self.anchor)
        if isinstance(params, dict):
            return {key: self._tree(value, settings) for key, value in params.items()}
        return [self._tree(value, settings) for value in params]

    def _state(self, param: torch.Tensor) -> dict:
        state = self.optimizer.state[param]
        if not state:  # as Adam's first step makes it (fused: the count on the device)
            state["step"] = torch.zeros((), dtype=torch.float32, device=param.device)
            state["exp_avg"] = torch.zeros_like(param, memory_format=torch.preserve_format)
            state["exp_avg_sq"] = torch.zeros_like(param, memory_format=torch.preserve_format)
        elif state["step"].device != param.device or state["step"].dtype != torch.float32:
            # loaded from a checkpoint by an optimizer that counts on the host (or in f64)
            state["step"] = state["step"].to(param.device, torch.float32)
        return state


def _late_parts(model) -> list:
    """The parts whose mean across replicas follows the backward: they keep their gradient."""
    late = getattr(model, "late_parts", None)
    return list(late.parts) if late is not None else []


def _leaves(tree):
    if isinstance(tree, torch.Tensor):
        yield tree
    elif isinstance(tree, dict):
        for value in tree.values():
            yield from _leaves(value)
    else:
        for value in tree:
            yield from _leaves(value)


@contextmanager
def stepping_in_backward(model, optimizer: torch.optim.Optimizer):
    """Inside, a backward through the model's entries steps each parameter the optimizer trains (but the
    parts reduced last across replicas) where its gradient is complete; `optimizer.step()` after it steps
    the rest. Raises ValueError where `supported` finds a reason it cannot."""
    if model.stepping is not None:
        raise RuntimeError("the model already steps in the backward: stepping_in_backward is not reentrant")
    model.stepping = InBackward(model, optimizer)
    try:
        yield model.stepping
    finally:
        model.stepping = None
        # The last step's casts of the parts (linnet/torch/collectives.py, `_casts_from_the_step`): only a forward
        # that steps takes them, and none follows here.
        ops.drop_stepped_casts(list(_leaves(model.params)))
