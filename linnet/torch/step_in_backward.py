"""The optimizer's step taken in the backward, a part at a time.

An optimizer steps after the backward, so every gradient is held at once: for
a model sharded in f32, as many bytes as its parts (8B on one GPU: 30 GiB of
the 120 that weights, gradients and moments take). Here the entry receives
each part the optimizer trains as `Stepped`, and the sharded code's bindings
`take` it where they first use it (linnet/torch/collectives.py): through an
identity whose backward runs once the part's whole gradient exists (after its
reduction, and after every use of a tied weight). The part enters detached,
the identity's node made through a leaf that requires grad (`anchor`):
compiled, the backward changes that input in place, which AOT autograd of
torch 2.11 refuses for an input that requires grad (2.13 allows it). There it takes the optimizer's
step, as the optimizer's stepper in linnet/torch/steppers/ takes it (Adam's: `linnet::adam_step_`,
on CUDA Linnet's kernel, csrc/cuda/adam_step.cu, with ATen's arithmetic; elsewhere ATen's fused
kernel, as `fused=True` steps), and the gradient is dropped. The identity is made where the part is first used, not
where the entry starts: autograd runs the nodes made last first, so a node
made first would run once the whole backward was done. Compiled, the step is
in the backward graph, and a gradient lives from its reduction to its step.
On one rank a layer's gradient has no reduction: it reaches the step in the
compute dtype, as the layer's products made it (shard.py's `_take`); where the
layers keep their casts (reshard_after_forward=False) and the stepper can (Adam's),
the step also writes the part's cast, which the next forward takes rather than
cast the part again (shard.py's `_casts_from_the_step`, csrc/stepped_casts.cpp).

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

The update is the optimizer's (Adam's as `fused=True` computes it, bit for bit;
within rounding, 3e-8 after three steps, of the for-each and for-loop
forms; on CUDA, Adam's L2 form within an ulp or so, tests/test_gpu_adam_step.py):
its state in `optimizer.state` (what a checkpoint saves), its learning rate
read from its parameter groups at each forward (a schedule's changes, in a
tensor that the compiled graph reads). `train` steps this way where
`supported` finds nothing against it: an optimizer with a stepper (Adam,
AdamW, plain SGD) that takes its options, without step hooks or gradient
hooks on a part, which would each see a step or a gradient that is not there.
The parts whose mean across replicas follows the backward
(linnet/torch/hybrid.py) keep their gradient for the optimizer's step."""

from __future__ import annotations

from contextlib import contextmanager
from typing import NamedTuple

import torch

from linnet.torch import ops
from linnet.torch.hybrid import has_step_hooks
from linnet.torch.param_trees import leaves
from linnet.torch.steppers import STEPPERS, stepper_for


class PartState(NamedTuple):
    """What a parameter's step reads and changes: the optimizer's state, and its group's lr and settings."""

    state: tuple  # the stepper's tensors in optimizer.state[param] (Adam's moments and count)
    lr: torch.Tensor  # (1,) f64 on the host: the group's rate at this step, read as a double as a float rate is
    settings: tuple  # the group's constants, as the stepper reads them (the entries compile with dynamic=False)
    anchor: torch.Tensor  # a 0-d leaf that requires grad: the part enters detached (InBackward.parts)
    step: object  # the stepper's step function (linnet/torch/steppers/)
    writes_casts: bool  # whether the step can write the part's cast for the next forward


def supported(model, optimizer: torch.optim.Optimizer) -> str | None:
    """Why `optimizer` cannot step `model`'s parts in the backward, or None where it can."""
    if getattr(model, "sharding", None) is None:
        return "the model is not sharded (linnet.torch.fully_shard), so its code has no place to step a part"
    late = {id(p) for p in _late_parts(model)}
    for group in optimizer.param_groups:
        for param in group["params"]:
            if id(param) not in late and (param._backward_hooks or getattr(param, "_post_accumulate_grad_hooks", None)):
                return "a trained part has a gradient hook, which would never see the gradient the step takes"
    stepper = stepper_for(optimizer)
    if stepper is None:
        known = ", ".join(sorted(optimizer.__name__ for optimizer in STEPPERS))
        return f"{type(optimizer).__name__} has no stepper in linnet/torch/steppers/ (those there: {known})"
    if has_step_hooks(optimizer):
        return "the optimizer has step hooks, which would not see the steps taken in the backward"
    return stepper.unsupported(optimizer)


class _StepInBackward(torch.autograd.Function):
    """`through` (the parameter, detached; or, with `param` given, what the parameter's gradient arrives
    by), passed through as a tensor that requires grad (through `anchor`); its gradient, once whole, steps
    the parameter and goes no further."""

    @staticmethod
    def forward(ctx, through, anchor, param, lr, step, settings, cast_dtype, *state):
        ctx.save_for_backward(through if param is None else param, lr, *state)
        ctx.step, ctx.settings, ctx.cast_dtype = step, settings, cast_dtype
        return through.view_as(through)

    @staticmethod
    def backward(ctx, gradient):
        param, lr, *state = ctx.saved_tensors
        ctx.step(param, tuple(state), gradient, lr.view(()), ctx.settings, ctx.cast_dtype)
        return (None,) * (7 + len(state))


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
    cast_dtype: the step also casts the stepped part to it, for the next forward's cast to take (a stepper that
    `writes_casts`; `ops.adam_step`)."""
    if not isinstance(part, Stepped):
        return part
    state = part.state
    param = None if through is None else part.part  # one tensor is never passed twice (dynamo refuses it)
    return _StepInBackward.apply(part.part if through is None else through, state.anchor, param, state.lr,
                                 state.step, state.settings, cast_dtype, *state.state)


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
        self.optimizer, self.device, self.stepper = optimizer, model.device, stepper_for(optimizer)
        late = {id(p) for p in _late_parts(model)}  # they keep their gradient
        self.group_of = {id(p): index for index, group in enumerate(optimizer.param_groups) for p in group["params"]
                         if p.requires_grad and id(p) not in late}
        # One element, not 0-d: torch.compile reads a 0-d f64 host tensor as a float, then throws away its
        # first compile of the step and starts again ("Restarting analysis", the 8B's first step 40 s longer).
        self.lrs = [torch.zeros(1, dtype=torch.float64) for _ in optimizer.param_groups]
        self.anchor = torch.zeros((), device=self.device, requires_grad=True)  # never given a gradient
        seen: set[int] = set()
        for tensor in leaves(model.params):
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
            settings.append(self.stepper.settings(self.optimizer, group))
        return self._tree(params, settings)

    def _tree(self, params, settings):
        if isinstance(params, torch.Tensor):
            group = self.group_of.get(id(params))
            if group is None:
                return None
            return PartState(self.stepper.state(self.optimizer, params), self.lrs[group], settings[group],
                             self.anchor, self.stepper.step, self.stepper.writes_casts)
        if isinstance(params, dict):
            return {key: self._tree(value, settings) for key, value in params.items()}
        return [self._tree(value, settings) for value in params]


def _late_parts(model) -> list:
    """The parts whose mean across replicas follows the backward: they keep their gradient."""
    late = getattr(model, "late_parts", None)
    return list(late.parts) if late is not None else []


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
        ops.drop_stepped_casts(list(leaves(model.params)))
