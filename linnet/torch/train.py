"""The PyTorch training loop: one packed row a process a step.

    history = train(model, iter(rows[rank::world]), optimizer=optimizer, steps=30,
                    schedule=cosine_schedule(optimizer, 3, 30), checkpoint="ckpt", checkpoint_every=10)

The loss optimised and reported is the token-weighted mean over the whole
global batch (every rank's row): each rank's mean is scaled by its share of
the batch's loss weight, times the world size, before the backward, so the
gradients the reduce-scatter averages over ranks are those of the global mean.

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
import itertools
import math
import time
from dataclasses import dataclass
from typing import Callable, Iterable, Iterator, Sequence

import torch
import torch.distributed as dist

from linnet.torch import watchdog
from linnet.torch.agree import cpu_group, raise_together
from linnet.history import History, Progress, Step, stop_unless_finite
from linnet.data.packing import Example, Row, pack, stack_rows
from linnet.torch.step_in_backward import stepping_in_backward, supported
from linnet.torch.hybrid import backward_and_step

__all__ = ["Example", "pack", "row_tensors", "cosine_schedule", "train", "evaluate", "History", "Step"]


def cosine_schedule(optimizer: torch.optim.Optimizer, warmup: int, steps: int, floor: float = 0.0):
    """Linear warm-up over `warmup` steps, then a cosine down to `floor` times the peak at `steps`."""
    if not 0 <= warmup <= steps:
        raise ValueError(f"cosine_schedule needs 0 <= warmup <= steps, got warmup={warmup}, steps={steps}")

    def factor(step: int) -> float:
        if step < warmup:
            return (step + 1) / (warmup + 1)
        progress = (step - warmup) / max(1, steps - warmup)
        return floor + (1 - floor) * 0.5 * (1 + math.cos(math.pi * min(1.0, progress)))

    return torch.optim.lr_scheduler.LambdaLR(optimizer, factor)


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
    """A step whose work is launched, not yet read: its loss lands in `loss` when the device gets there."""

    step: int
    loss: torch.Tensor  # this rank's mean loss, on the host (pinned on a GPU: copied without waiting)
    local_weight: float
    total_weight: float
    tokens: int
    lr: float
    lap: tuple

    @classmethod
    def of(cls, loss: torch.Tensor, clock: _Clock, **fields) -> "_Launched":
        """The step whose loss this is: its copy to the host launched, then the step's end marked."""
        loss = loss.detach().float()
        if loss.device.type == "cuda":
            loss = torch.empty((), dtype=loss.dtype, pin_memory=True).copy_(loss, non_blocking=True)
        return cls(loss=loss, lap=clock.lap(), **fields)

    def record(self, clock: _Clock) -> Step:
        """The step's record, over every rank (a collective: every rank reads its step together)."""
        seconds = clock.seconds(self.lap)  # the step is done: its loss is on the host
        (loss_sum,) = _all_reduce([float(self.loss) * self.local_weight])
        loss = loss_sum / max(self.total_weight, 1e-12)
        return Step(self.step, loss, seconds, self.tokens, self.total_weight, self.lr)


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
) -> History:
    """`steps` optimizer steps over `batches` (this rank's rows); resumes from `checkpoint` if it holds one,
    and saves into it every `checkpoint_every` steps (if given) and after the last. The run holds the
    checkpoint folder until it returns (another run pointed at it stops at once, naming this one), and
    checks before its first step that it can write a checkpoint there.

    step_in_backward: the optimizer steps each part in the backward, where its gradient is complete, so
    that no step holds every gradient at once (with replicas, until the backward's waits across them;
    linnet/torch/step_in_backward.py), as `fused=True` steps: None (the default) where the model is
    sharded and the optimizer allows it (Adam or AdamW without amsgrad, maximize, differentiable, step
    hooks or gradient hooks on a part), True requires it, False steps after the backward.

    A step whose loss is not finite stops the run on every rank (NotFinite, naming the step), and so does a
    checkpoint whose weights or optimizer state are not: nothing of that step is saved, so `checkpoint`
    resumes from the last good step."""
    from linnet.torch.checkpoint import Checkpointer

    _check_model(model)
    stepping = _stepping(model, optimizer, step_in_backward)
    checkpointer = Checkpointer(checkpoint, model, optimizer, schedule, steps=steps) if checkpoint is not None else None
    try:
        with stepping:
            return _train(model, batches, optimizer, steps, schedule, on_step, checkpointer, checkpoint_every)
    except RuntimeError as error:
        # A collective that failed because peers went away (a machine died): name them, not an address.
        if watchdog.from_communication(error) and (lost := watchdog.lost_ranks()) is not None:
            raise lost from error
        raise
    finally:
        if checkpointer is not None:
            checkpointer.close()


def _stepping(model, optimizer: torch.optim.Optimizer, asked: bool | None):
    """The context that `train` runs in: the optimizer's step in the backward, or none."""
    reason = supported(model, optimizer)
    if asked is False or (asked is None and reason is not None):
        return contextlib.nullcontext()
    if reason is not None:
        raise ValueError(f"train(step_in_backward=True): {reason}")
    return stepping_in_backward(model, optimizer)


def _train(model, batches: Iterable[Row], optimizer: torch.optim.Optimizer, steps: int, schedule,
           on_step: Callable[[Step], None] | None, checkpointer, checkpoint_every: int | None) -> History:
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

    def read_launched() -> None:
        nonlocal launched
        if launched is not None:
            history.steps.append(launched.record(clock))
            report(history.steps[-1])
            launched = None
            stop_unless_finite(history.steps[-1], checkpointer)

    for step in range(history.resumed_from + 1, steps + 1):
        row = next(rows, None)
        local_weight = float(row.weights.sum()) if row is not None else 0.0
        problem = None if row is None else _problem(lambda: row.check_ids(model.checked.dims["Vocab"], f"step {step}"))
        # Every forward of a sharded model is collective: all ranks step, or all stop together.
        one_document = row is not None and row.is_one_document()
        total_weight, ranks_with_a_row, ranks_with_problems, ranks_one_document = _all_reduce(
            [local_weight, float(row is not None), float(problem is not None), float(one_document)])
        if ranks_with_a_row < world or ranks_with_problems:
            read_launched()  # the step before is reported before the run stops
        if ranks_with_a_row < world:
            raise ValueError(f"{world - int(ranks_with_a_row)} of {world} ranks ran out of rows at step {step} "
                             f"of {steps}: give every rank at least {steps} rows")
        raise_together(problem, ranks_with_problems)
        loss = _loss(model, row, device, causal=ranks_one_document == world)
        # scaled so that the gradients averaged over ranks are those of the global weighted mean
        backward_and_step(model, loss * (world * local_weight / max(total_weight, 1e-12)), optimizer)
        optimizer.zero_grad(set_to_none=True)
        lr = optimizer.param_groups[0]["lr"]
        if schedule is not None:
            schedule.step()
        this_step = _Launched.of(loss, clock, step=step, local_weight=local_weight, total_weight=total_weight,
                                 tokens=world * len(row.tokens), lr=lr)
        read_launched()  # the step before, while the device runs this one
        launched = this_step
        rows_consumed += world
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
