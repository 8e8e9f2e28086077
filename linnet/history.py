"""What a training run reports, whatever the framework: a `Step` for each
optimizer step, the `History` of them, the progress line the first rank
prints when nobody asked for `on_step`, and the stop at a loss that is not finite."""

from __future__ import annotations

import math
import statistics
import sys
import time
from dataclasses import dataclass, field

from linnet.errors import NotFinite

__all__ = ["History", "Progress", "Step", "stop_unless_finite"]


@dataclass(frozen=True)
class Step:
    step: int  # 1-based: the number of optimizer steps taken
    loss: float  # token-weighted mean over the global batch
    seconds: float
    tokens: int  # positions in the global batch
    loss_tokens: float  # loss weight in the global batch (answer tokens, for prompted examples)
    lr: float  # NaN where the optimizer does not expose it (optax without inject_hyperparams)
    grad_norm: float | None = None  # the global gradient norm before clipping; None where the run did not clip
    held_out_loss: float | None = None  # after this step, where the run evaluated (eval_every)


@dataclass
class History:
    steps: list[Step] = field(default_factory=list)
    resumed_from: int = 0  # the step the run resumed after (0: started fresh)

    def median_seconds(self, warmup: int = 2) -> float | None:
        """The median step after the first `warmup` (compiling) steps; over every step when the run
        took no more than that; None when it took none (it resumed at its last step)."""
        seconds = [s.seconds for s in self.steps]
        timed = seconds[warmup:] or seconds
        return statistics.median(timed) if timed else None


class Progress:
    """Without on_step: what the first rank shows of the run. On a terminal, a bar rewritten each step;
    elsewhere (a log file), a line every few seconds. Each shows the step, the loss, the gradient norm and
    held-out loss where there are any, tokens/s and the time left; a step with a held-out loss always
    gets a line of its own."""

    BAR = 24  # characters

    def __init__(self, steps: int, rank: int, every_seconds: float = 10.0, stream=None):
        self.steps, self.rank, self.every = steps, rank, every_seconds
        self.stream = stream or sys.stderr
        self.bar = bool(getattr(self.stream, "isatty", lambda: False)())
        self.last = -math.inf
        self.seconds: list[float] = []

    def __call__(self, step: Step) -> None:
        self.seconds.append(step.seconds)
        now = time.monotonic()
        due = now - self.last >= self.every or step.step == self.steps or step.held_out_loss is not None
        if self.rank != 0 or not (self.bar or due):
            return
        self.last = now
        recent = sorted(self.seconds[-20:])[len(self.seconds[-20:]) // 2]
        left = recent * (self.steps - step.step)
        norm = "" if step.grad_norm is None else f"  grad norm {step.grad_norm:.3f}"
        norm += "" if step.held_out_loss is None else f"  held-out loss {step.held_out_loss:.4f}"
        line = (f"step {step.step}/{self.steps}  loss {step.loss:.4f}{norm}  {step.tokens / recent:,.0f} tokens/s  "
                f"{left / 60:.1f} min left")
        if not self.bar:
            print(line, file=self.stream, flush=True)
            return
        filled = round(self.BAR * step.step / self.steps)
        ends = "\n" if step.step == self.steps or step.held_out_loss is not None else ""
        self.stream.write(f"\r[{'#' * filled}{'.' * (self.BAR - filled)}] {line}\033[K{ends}")
        self.stream.flush()


def stop_unless_finite(step: Step, checkpointer) -> None:
    """Raises NotFinite where `step`'s loss or gradient norm (global: every rank sees the same) is inf or
    nan, naming the step, what was not finite and where the run can resume from: `checkpointer` (either
    wing's, or None) has `folder` and `saved_step`, the step of the newest checkpoint there (0: none)."""
    if not math.isfinite(step.loss):
        what = f"the loss is {step.loss}"
    elif step.grad_norm is not None and not math.isfinite(step.grad_norm):
        what = f"the gradient norm is {step.grad_norm}"
    else:
        return
    if checkpointer is None:
        resume = "no checkpoint= was given, so the run cannot resume"
    else:
        saved = checkpointer.saved_step
        resume = (f"{checkpointer.folder} resumes from step {saved}" if saved
                  else f"{checkpointer.folder} holds no checkpoint of this run")
    raise NotFinite(f"step {step.step}: {what}: training stops here and saves nothing of this "
                    f"step; {resume}. Lower the learning rate, or check the data")
