"""The PyTorch training loop: `accumulate` packed rows a process a step.

    history = train(model, iter(rows[rank::world]), optimizer=optimizer, steps=30, accumulate=2,
                    max_grad_norm=1.0, schedule=cosine_schedule(optimizer, 3, 30),
                    checkpoint="ckpt", checkpoint_every=10)

The loss optimised and reported is the token-weighted mean over the whole
global batch (every row of every rank): each row's mean is scaled by its share
of the batch's loss weight, times the world size, before its backward, so the
gradients the reduce-scatters average over ranks, summed over the rows, are
those of the global mean. Clipping scales them by max_grad_norm over their
global norm where that is larger, as torch.nn.utils.clip_grad_norm_ does over
the whole unsharded model.

On a GPU the host runs a step ahead: what the ranks agree on before a step
travels on the CPU (agree.cpu_group), and a step's loss and time (CUDA events)
are read once the next step is launched, so the device never idles between
steps waiting for the host. A step is reported then, and before a checkpoint.
Where the model and optimizer allow it, Adam steps each part in the backward,
where its gradient is complete (linnet/torch/step_in_backward.py). With
hybrid sharding the optimizer steps the parts reduced last (the first
layer's) after the others, under whose step their mean across the machines
runs (linnet/torch/hybrid.py)."""

from __future__ import annotations

import contextlib
import dataclasses
import itertools
import time
from dataclasses import dataclass
from typing import Callable, Iterable, Iterator, Sequence

import torch
import torch.distributed as dist

from linnet.torch import watchdog
from linnet.torch.agree import cpu_group, raise_together
from linnet.history import History, Progress, Step, stop_unless_finite
from linnet.schedules import lr_factor
from linnet.train_options import check_train_options, evaluates_after
from linnet.data.packing import Example, Row, pack, stack_rows
from linnet.torch.step_in_backward import stepping_in_backward, supported
from linnet.torch.hybrid import backward_and_step

__all__ = ["Example", "pack", "row_tensors", "lr_schedule", "cosine_schedule", "clip_grad_norm", "train", "evaluate",
           "History", "Step"]


def lr_schedule(optimizer: torch.optim.Optimizer, name: str, warmup: int, steps: int, floor: float = 0.0):
    """The learning rate of linnet.schedules' `name` ("constant", "linear" or "cosine") over `steps`, after a
    linear warm-up of `warmup` steps, falling to `floor` times the peak (the optimizer's lr)."""
    factor = lr_factor(name, warmup, steps, floor)
    return torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: float(factor(step)))


def cosine_schedule(optimizer: torch.optim.Optimizer, warmup: int, steps: int, floor: float = 0.0):
    """Linear warm-up over `warmup` steps, then a cosine down to `floor` times the peak at `steps`."""
    return lr_schedule(optimizer, "cosine", warmup, steps, floor)


def _world() -> tuple[int, int]:
    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    return 0, 1


def row_tensors(rows: Row | Sequence[Row], device: torch.device | str = "cpu") -> list[torch.Tensor]:
    """A row (a batch of one) or rows as the `loss_packed` entry takes them, on `device`:
    `model.loss_packed(*row_tensors(row, "cuda"))`."""
    arrays = stack_rows([rows] if isinstance(rows, Row) else rows)
    return [torch.from_numpy(a).to(device, non_blocking=True) for a in arrays]


def _loss(model, row: Row, device, causal: bool) -> torch.Tensor:
    """The row's mean loss; `causal` (a row that one document fills, on every rank: a sharded entry is
    collective) takes the plain causal `loss` entry where the model has it, whose fused attention
    (cuDNN's on Hopper) is faster than attention under a document mask."""
    tokens, targets, positions, segments, weights = row_tensors(row, device)
    if causal and "loss" in model.entries:
        return model.loss(tokens, targets, weights)
    return model.loss_packed(tokens, targets, positions, segments, weights)


def _all_reduce(values: list[float], op=None) -> list[float]:
    """values summed (or reduced by op) over the ranks, in f64 on the CPU (Gloo): no GPU synchronisation."""
    tensor = torch.tensor(values, dtype=torch.float64)
    if _world()[1] > 1:
        dist.all_reduce(tensor, op=op or dist.ReduceOp.SUM, group=cpu_group())
    return tensor.tolist()


class _Clock:
    """Where each step ends: CUDA events on a GPU (the host, a step ahead, would time its launches),
    the host's clock elsewhere (the CPU computes as it is asked)."""

    def __init__(self, device: torch.device):
        self.device, self.events = device, device.type == "cuda"
        self.start = self._mark()

    def _mark(self):
        if not self.events:
            return time.perf_counter()
        event = torch.cuda.Event(enable_timing=True)
        event.record(torch.cuda.current_stream(self.device))
        return event

    def restart(self) -> None:
        """The next step starts now (after a pause that is no step's: a checkpoint written)."""
        self.start = self._mark()

    def lap(self) -> tuple:
        """Marks a step's end (after its work is launched): (start, end) for `seconds`."""
        start, self.start = self.start, self._mark()
        return start, self.start

    def seconds(self, lap: tuple) -> float:
        """The step's time; on a GPU this waits until the step is done."""
        start, end = lap
        if not self.events:
            return end - start
        end.synchronize()
        return start.elapsed_time(end) / 1000


@dataclass
class _Launched:
    """A step whose work is launched, not yet read: its loss (and gradient norm) land on the host when the
    device gets there."""

    step: int
    loss_sum: torch.Tensor  # this rank's rows' losses times their loss weights, summed (on the host)
    grad_norm: torch.Tensor | None  # the global norm before clipping (on the host), where it was taken
    total_weight: float
    tokens: int
    lr: float
    lap: tuple

    @classmethod
    def of(cls, loss_sum: torch.Tensor, grad_norm: torch.Tensor | None, clock: _Clock, **fields) -> "_Launched":
        """The step whose loss this is: its copies to the host launched, then the step's end marked."""
        return cls(loss_sum=_to_host(loss_sum), grad_norm=None if grad_norm is None else _to_host(grad_norm),
                   lap=clock.lap(), **fields)

    def record(self, clock: _Clock) -> Step:
        """The step's record, over every rank (a collective: every rank reads its step together)."""
        seconds = clock.seconds(self.lap)  # the step is done: its loss is on the host
        (loss_sum,) = _all_reduce([float(self.loss_sum)])
        loss = loss_sum / max(self.total_weight, 1e-12)
        grad_norm = None if self.grad_norm is None else float(self.grad_norm)
        return Step(self.step, loss, seconds, self.tokens, self.total_weight, self.lr, grad_norm)


def _to_host(value: torch.Tensor) -> torch.Tensor:
    """A scalar's f32 copy on the host, launched without waiting (into pinned memory) from a GPU."""
    value = value.detach().float()
    if value.device.type == "cuda":
        return torch.empty((), dtype=value.dtype, pin_memory=True).copy_(value, non_blocking=True)
    return value


def clip_grad_norm(model, max_norm: float | None) -> torch.Tensor:
    """The global norm of the gradients of every part on every rank, as one tensor on the model's device,
    without waiting for it; with `max_norm`, the gradients are scaled by max_norm / (norm + 1e-6) where
    that is below 1, as torch.nn.utils.clip_grad_norm_ does over the unsharded model. Every rank calls it
    (an all-reduce); a part held by each of `replicas` machines counts once."""
    parts = [part for part in model.parameters() if part.grad is not None]
    local = (torch.nn.utils.get_total_norm([part.grad for part in parts], 2.0) if parts
             else torch.zeros((), device=model.device)).float()
    squares = local * local
    sharding = getattr(model, "sharding", None)
    if sharding is not None and _world()[1] > 1:
        dist.all_reduce(squares)
        squares = squares / sharding.replicas
    norm = squares.sqrt()
    if max_norm is not None and parts:
        torch.nn.utils.clip_grads_with_norm_(parts, max_norm, norm)
    return norm


def _problem(check) -> str | None:
    """What check() raised, as a message, or None."""
    try:
        check()
    except ValueError as error:
        return str(error)
    return None


def _check_model(model) -> None:
    _, world = _world()
    sharding = getattr(model, "sharding", None)
    if world > 1 and sharding is None:
        raise RuntimeError(f"{world} processes but the model is not sharded: call linnet.torch.fully_shard(model) "
                           "first")
    if sharding is not None and sharding.world * sharding.replicas != world:
        # The loss is the mean over every rank's row, and the rows are dealt over every rank.
        raise ValueError(f"train needs the model sharded over every one of the {world} processes; it is over "
                         f"{sharding.world * sharding.replicas} (fully_shard(group=...) of some of them)")
    if "loss_packed" not in model.entries:
        raise ValueError(f"train needs the loss_packed entry; the model was loaded with entries {model.entries}")


def train(
    model,
    batches: Iterable[Row],
    *,
    optimizer: torch.optim.Optimizer,
    steps: int,
    schedule=None,
    on_step: Callable[[Step], None] | None = None,
    checkpoint: str | None = None,
    checkpoint_every: int | None = None,
    step_in_backward: bool | None = None,
    accumulate: int = 1,
    max_grad_norm: float | None = None,
    eval_rows: Sequence[Row] | None = None,
    eval_every: int | None = None,
    hold_gradients: bool = False,
) -> History:
    """`steps` optimizer steps over `batches` (this rank's rows, `accumulate` of them a step); resumes from
    `checkpoint` if it holds one, and saves into it every `checkpoint_every` steps (if given) and after the
    last. The run holds the checkpoint folder until it returns (another run pointed at it stops at once,
    naming this one), and checks before its first step that it can write a checkpoint there.

    accumulate: rows a rank takes for one optimizer step; the step's loss and gradients are the
    token-weighted mean over every row of every rank, as one batch of them. Each row's gradients are
    reduce-scattered into the parts' as its backward runs, and summed there.

    hold_gradients: with accumulate > 1, the backwards of a step's rows but the last hold each group's whole
    gradient on this rank instead (f32: 4 bytes a weight of the whole model, on every rank), and their sum is
    reduce-scattered once, beside the last row (linnet/torch/held_gradients.py): one reduce-scatter a step
    rather than one a row, for that memory.

    max_grad_norm: clip the gradients at this global norm (None: no clipping). Each step's norm before
    clipping is in its Step.grad_norm, and in the progress line.

    eval_rows, eval_every: every `eval_every` steps, and after the last, `evaluate(model, eval_rows)` (this
    rank's held-out rows) once the step is done, in that Step.held_out_loss; its time is no step's.

    step_in_backward: the optimizer steps each part in the backward, where its gradient is complete, so
    that no step holds every gradient at once (with replicas, until the backward's waits across them;
    linnet/torch/step_in_backward.py), as `fused=True` steps: None (the default) where the model is
    sharded and the optimizer allows it (Adam or AdamW without amsgrad, maximize, differentiable, step
    hooks or gradient hooks on a part), True requires it, False steps after the backward. A part cannot
    step before every row's gradient is in it (accumulate > 1) or before the norm over every part is known
    (max_grad_norm): then the optimizer steps after the last backward, holding this rank's f32 gradients,
    and step_in_backward=True is refused.

    A step whose loss is not finite stops the run on every rank (NotFinite, naming the step), and so does a
    checkpoint whose weights or optimizer state are not: nothing of that step is saved, so `checkpoint`
    resumes from the last good step."""
    from linnet.torch.checkpoint import Checkpointer

    _check_model(model)
    check_train_options(accumulate, max_grad_norm, eval_rows, eval_every)
    if hold_gradients and model.sharding is None:
        raise ValueError("train(hold_gradients=True) holds a sharded model's gradients: fully_shard(model) first")
    whole_gradient = ("accumulate > 1 needs every row's gradient before a part steps" if accumulate > 1 else
                      "max_grad_norm needs the norm over every part before a part steps"
                      if max_grad_norm is not None else None)
    stepping = _stepping(model, optimizer, step_in_backward, whole_gradient)
    checkpointer = Checkpointer(checkpoint, model, optimizer, schedule, steps=steps) if checkpoint is not None else None
    try:
        with stepping:
            return _train(model, batches, optimizer, steps, schedule, on_step, checkpointer, checkpoint_every,
                          accumulate, max_grad_norm, eval_rows, eval_every, hold_gradients)
    except RuntimeError as error:
        # A collective that failed because peers went away (a machine died): name them, not an address.
        if watchdog.from_communication(error) and (lost := watchdog.lost_ranks()) is not None:
            raise lost from error
        raise
    finally:
        if checkpointer is not None:
            checkpointer.close()


def _stepping(model, optimizer: torch.optim.Optimizer, asked: bool | None, whole_gradient: str | None):
    """The context that `train` runs in: the optimizer's step in the backward, or none."""
    reason = whole_gradient or supported(model, optimizer)
    if asked is False or (asked is None and reason is not None):
        return contextlib.nullcontext()
    if reason is not None:
        raise ValueError(f"train(step_in_backward=True): {reason}")
    return stepping_in_backward(model, optimizer)


def _train(model, batches: Iterable[Row], optimizer: torch.optim.Optimizer, steps: int, schedule,
           on_step: Callable[[Step], None] | None, checkpointer, checkpoint_every: int | None, accumulate: int,
           max_grad_norm: float | None, eval_rows: Sequence[Row] | None, eval_every: int | None,
           hold_gradients: bool) -> History:
    rank, world = _world()
    history = History()
    rows: Iterator[Row] = iter(batches)
    rows_consumed = 0  # global rows, over all ranks and every run that led here
    if checkpointer is not None:
        history.resumed_from = checkpointer.resume()
        if history.resumed_from > steps:
            raise ValueError(f"the checkpoint in {checkpointer.folder} is at step {history.resumed_from}, "
                             f"past steps={steps}")
        rows = itertools.islice(rows, checkpointer.rows_to_skip(history.resumed_from, rank, world), None)
        rows_consumed = checkpointer.manifest["rows_consumed"] if history.resumed_from else 0
        checkpointer.check_room()
    report = on_step or Progress(steps, rank)
    device = model.device
    clock, launched = _Clock(device), None
    whole_gradient = accumulate > 1 or max_grad_norm is not None

    def read_launched() -> None:
        nonlocal launched
        if launched is not None:
            record = launched.record(clock)
            if evaluates_after(record.step, steps, eval_every):
                record = dataclasses.replace(record, held_out_loss=evaluate(model, eval_rows))
                clock.restart()
            history.steps.append(record)
            report(history.steps[-1])
            launched = None
            stop_unless_finite(history.steps[-1], checkpointer)

    for step in range(history.resumed_from + 1, steps + 1):
        batch = list(itertools.islice(rows, accumulate))
        weights = [float(row.weights.sum()) for row in batch]
        problem = None
        for index, row in enumerate(batch):
            where = f"step {step}" if accumulate == 1 else f"step {step}, row {index + 1} of {accumulate}"
            problem = problem or _problem(lambda: row.check_ids(model.checked.dims["Vocab"], where))
        # Every forward of a sharded model is collective: all ranks step, or all stop together.
        one_document = len(batch) == accumulate and all(row.is_one_document() for row in batch)
        total_weight, ranks_with_rows, ranks_with_problems, ranks_one_document = _all_reduce(
            [sum(weights), float(len(batch) == accumulate), float(problem is not None), float(one_document)])
        if ranks_with_rows < world or ranks_with_problems:
            read_launched()  # the step before is reported before the run stops
        if ranks_with_rows < world:
            raise ValueError(f"{world - int(ranks_with_rows)} of {world} ranks ran out of rows at step {step} "
                             f"of {steps}: give every rank at least {steps * accumulate} rows")
        raise_together(problem, ranks_with_problems)
        loss_sum = torch.zeros((), device=device)
        for index, (row, weight) in enumerate(zip(batch, weights)):
            if hold_gradients:
                model.hold_gradients(index < accumulate - 1)
            loss = _loss(model, row, device, causal=ranks_one_document == world)
            # scaled so that the gradients averaged over ranks, summed over rows, are the global weighted mean's
            scaled = loss * (world * weight / max(total_weight, 1e-12))
            if whole_gradient:
                scaled.backward()
            else:
                backward_and_step(model, scaled, optimizer)
            loss_sum = loss_sum + loss.detach().float() * weight
        grad_norm = None
        if whole_gradient:
            if max_grad_norm is not None:
                grad_norm = clip_grad_norm(model, max_grad_norm)
            optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        lr = optimizer.param_groups[0]["lr"]
        if schedule is not None:
            schedule.step()
        this_step = _Launched.of(loss_sum, grad_norm, clock, step=step, total_weight=total_weight,
                                 tokens=world * sum(len(row.tokens) for row in batch), lr=lr)
        read_launched()  # the step before, while the device runs this one
        launched = this_step
        if evaluates_after(step, steps, eval_every):
            read_launched()  # evaluated after this step, before the next is launched
        rows_consumed += world * accumulate
        if checkpointer is not None and ((checkpoint_every and step % checkpoint_every == 0) or step == steps):
            read_launched()
            checkpointer.save(step, rows_consumed=rows_consumed)
            clock.restart()
    read_launched()
    return history


@torch.no_grad()
def evaluate(model, batches: Iterable[Row]) -> float:
    """The token-weighted mean loss over `batches` (each rank its own rows), over all ranks."""
    _check_model(model)
    device = model.device
    rows = list(batches)
    # A sharded forward is collective: every rank runs as many rows, the short ones weightless copies.
    # So every rank checks all of its rows first, and all raise together if any rank cannot go on.
    problem = None if rows else "evaluate got no rows on this rank: give every rank at least one"
    for index, row in enumerate(rows):
        problem = problem or _problem(lambda: row.check_ids(model.checked.dims["Vocab"], f"evaluate, row {index}"))
    # The causal entry only where every row of every rank is one document: the ranks call one entry a row.
    packed = any(not row.is_one_document() for row in rows)
    most, ranks_with_problems, any_packed = _all_reduce([float(len(rows)), float(problem is not None), float(packed)],
                                                        dist.ReduceOp.MAX)
    raise_together(problem, ranks_with_problems)
    blank = rows[0]
    weightless = Row(blank.tokens, blank.targets, blank.positions, blank.segments, 0 * blank.weights, 0)
    rows += [weightless] * (int(most) - len(rows))
    loss_sum = weight_sum = 0.0
    for row in rows:
        weight = float(row.weights.sum())
        loss_sum += float(_loss(model, row, device, causal=not any_packed)) * weight
        weight_sum += weight
    loss_sum, weight_sum = _all_reduce([loss_sum, weight_sum])
    if weight_sum == 0:
        raise ValueError("evaluate got no rows with loss weight")
    return loss_sum / weight_sum
